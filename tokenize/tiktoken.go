package tokenize

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"math"
	"strconv"
	"unicode/utf8"

	"github.com/pkoukk/tiktoken-go-loader/assets"
)

// tiktokenEncoding is a tiktoken encoding (cl100k_base, o200k_base) with the
// hand-written pre-tokenizer of its split pattern and an allocation-free BPE
// merge loop; token for token identical to pkoukk/tiktoken-go's
// EncodeOrdinary (see the tests).
type tiktokenEncoding struct {
	name  string
	split func(s string, i int) int
	bpe   bpe
}

var tiktokenSplitters = map[string]func(string, int) int{
	"cl100k_base": splitCL100K,
	"o200k_base":  splitO200K,
}

// loadTiktoken reads an encoding's vocabulary from the files embedded in
// pkoukk/tiktoken-go-loader.
func loadTiktoken(name string) (Tokenizer, error) {
	split, ok := tiktokenSplitters[name]
	if !ok {
		return nil, fmt.Errorf("tokenize: no pre-tokenizer for %s", name)
	}
	data, err := assets.Assets.ReadFile(name + ".tiktoken")
	if err != nil {
		return nil, fmt.Errorf("tokenize: load %s: %w", name, err)
	}
	ranks, err := parseTiktokenFile(data)
	if err != nil {
		return nil, fmt.Errorf("tokenize: load %s: %w", name, err)
	}
	initClasses()
	return &tiktokenEncoding{name: name, split: split, bpe: newBPE(ranks)}, nil
}

// parseTiktokenFile parses "base64-token rank" lines. Token bytes share one
// backing string.
func parseTiktokenFile(data []byte) (map[string]uint32, error) {
	lines := bytes.Count(data, []byte{'\n'}) + 1
	arena := make([]byte, 0, len(data)) // decoded tokens are shorter than their base64
	type span struct{ off, end, rank int }
	spans := make([]span, 0, lines)
	for n := 1; len(data) > 0; n++ {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i], data[i+1:]
		} else {
			data = nil
		}
		if len(line) == 0 {
			continue
		}
		sp := bytes.IndexByte(line, ' ')
		if sp < 0 {
			return nil, fmt.Errorf("line %d: no rank", n)
		}
		rank, err := strconv.Atoi(string(line[sp+1:]))
		if err != nil || rank < 0 || rank >= noRank {
			return nil, fmt.Errorf("line %d: bad rank %q", n, line[sp+1:])
		}
		off := len(arena)
		arena, err = base64.StdEncoding.AppendDecode(arena, line[:sp])
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		spans = append(spans, span{off, len(arena), rank})
	}
	all := string(arena)
	ranks := make(map[string]uint32, len(spans))
	for _, s := range spans {
		ranks[all[s.off:s.end]] = uint32(s.rank)
	}
	return ranks, nil
}

func (t *tiktokenEncoding) Name() string { return t.name }

// Encode appends the ids of text like tiktoken's encode_ordinary. Invalid
// UTF-8 is read as pkoukk/tiktoken-go reads it: each bad byte is U+FFFD.
func (t *tiktokenEncoding) Encode(dst []uint32, text string) []uint32 {
	dst, _ = t.encodeLimit(dst, text, math.MaxInt)
	return dst
}

// encodeLimit is Encode stopping once dst holds more than limit ids, or
// once the bytes left prove that it would (see overLimit).
func (t *tiktokenEncoding) encodeLimit(dst []uint32, text string, limit int) ([]uint32, bool) {
	if !utf8.ValidString(text) {
		text = string([]rune(text))
	}
	for i := 0; i < len(text); {
		if overLimit(len(dst), len(text)-i, t.bpe.maxLen, limit) {
			return dst, false
		}
		end := t.split(text, i)
		for i+wordSlice(text[i:end]) < end { // a word of megabytes: in slices
			k := i + wordSlice(text[i:end])
			dst = t.bpe.appendPiece(dst, text[i:k])
			if i = k; overLimit(len(dst), len(text)-i, t.bpe.maxLen, limit) {
				return dst, false
			}
		}
		dst = t.bpe.appendPiece(dst, text[i:end])
		i = end
	}
	return dst, len(dst) <= limit
}

// overLimit reports whether n ids and the ids of rest more bytes are more
// than limit, whatever the rest's tokens: no token is longer than maxLen
// bytes, so rest bytes are at least rest/maxLen ids. A prompt whose size
// alone puts it over the limit is refused without being tokenized (a
// security review's 30 MB of spaces, 29 KB gzipped, took 6.5 s to refuse).
func overLimit(n, rest, maxLen, limit int) bool {
	return n > limit || maxLen > 0 && (rest+maxLen-1)/maxLen > limit-n
}
