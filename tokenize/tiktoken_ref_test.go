package tokenize

import (
	"slices"
	"strings"
	"testing"

	"fmt"

	tiktoken "github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

func init() {
	// The offline loader reads the vocabularies embedded in the
	// tiktoken-go-loader module; the default loader would download them.
	tiktoken.SetBpeLoader(tiktoken_loader.NewOfflineLoader())
}

// refTiktoken wraps pkoukk/tiktoken-go: the reference the fast tiktoken
// encodings are tested and benchmarked against.
type refTiktoken struct {
	name string
	enc  *tiktoken.Tiktoken
}

func loadRefTiktoken(name string) (Tokenizer, error) {
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

var refTokenizers = map[string]Tokenizer{}

func mustRef(t testing.TB, name string) Tokenizer {
	t.Helper()
	if tok, ok := refTokenizers[name]; ok {
		return tok
	}
	tok, err := loadRefTiktoken(name)
	if err != nil {
		t.Fatal(err)
	}
	refTokenizers[name] = tok
	return tok
}

func compareWithRef(t *testing.T, text string) {
	t.Helper()
	for _, name := range []string{"cl100k_base", "o200k_base"} {
		got := mustGet(t, name).Encode(nil, text)
		want := mustRef(t, name).Encode(nil, text)
		if !slices.Equal(got, want) {
			t.Fatalf("%s %q:\n got %v\nwant %v", name, text, got, want)
		}
	}
}

func TestTiktokenMatchesPkoukk(t *testing.T) {
	for _, s := range pretokSeeds {
		compareWithRef(t, s)
	}
	compareWithRef(t, longText(20000))
	compareWithRef(t, strings.Repeat("\u00a0 ", 400)+strings.Repeat("a", 700)+strings.Repeat("🙂", 100))
}

func FuzzTiktoken(f *testing.F) {
	for _, s := range pretokSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		compareWithRef(t, s)
	})
}
