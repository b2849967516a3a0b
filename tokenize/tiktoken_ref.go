package tokenize

import (
	"fmt"

	tiktoken "github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

func init() {
	// The offline loader reads the vocabularies embedded in the
	// tiktoken-go-loader module; the default loader would download them.
	tiktoken.SetBpeLoader(tiktoken_loader.NewOfflineLoader())
}

// refTiktoken wraps pkoukk/tiktoken-go.
type refTiktoken struct {
	name string
	enc  *tiktoken.Tiktoken
}

func loadTiktoken(name string) (Tokenizer, error) {
	enc, err := tiktoken.GetEncoding(name)
	if err != nil {
		return nil, fmt.Errorf("tokenize: load %s: %w", name, err)
	}
	return &refTiktoken{name: name, enc: enc}, nil
}

func (t *refTiktoken) Name() string { return t.name }

func (t *refTiktoken) Encode(dst []uint32, text string) []uint32 {
	for _, id := range t.enc.EncodeOrdinary(text) {
		dst = append(dst, uint32(id))
	}
	return dst
}
