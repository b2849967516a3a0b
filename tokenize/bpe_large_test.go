package tokenize

import (
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// longPieces returns long single pieces (and texts made of them) of the
// kinds a hostile or unusual prompt holds.
func longPieces() []string {
	rng := rand.New(rand.NewPCG(1, 2))
	size := func(n int) int { // pkoukk's reference is quadratic: smaller under -race
		if raceEnabled {
			return max(n/4, 200)
		}
		return n
	}
	randFrom := func(alphabet []rune, n int) string {
		var b strings.Builder
		for range n {
			b.WriteRune(alphabet[rng.IntN(len(alphabet))])
		}
		return b.String()
	}
	return []string{
		strings.Repeat("a", size(300)),
		strings.Repeat("ab", size(700)),
		randFrom([]rune("abcdefghij"), size(2000)),
		randFrom([]rune("aeiourstln"), size(1500)),
		randFrom([]rune("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"), size(1000)), // base64-like
		randFrom([]rune("!@#$%^&*()_=+[]{};:,.<>?"), size(1000)),
		randFrom([]rune("日本語中文한국어"), size(500)),
		randFrom([]rune("éèêàâîôûç"), size(600)),
		strings.Repeat(" ", size(1000)) + "x",
		strings.Repeat("\u00a0", 300),
	}
}

func TestLargePiecesMatchPkoukk(t *testing.T) {
	for _, s := range longPieces() {
		compareWithRef(t, s)
	}
}

func TestLargePiecesHFMatchQuadratic(t *testing.T) {
	paths := []string{tinyHF(t, nil)}
	for _, m := range []string{"llama3", "qwen3"} { // real vocabularies, when installed
		if _, err := os.Stat(refModelDir(m)); err == nil {
			paths = append(paths, refModelDir(m))
		}
	}
	for _, p := range paths {
		tok, err := Load(p)
		if err != nil {
			t.Fatal(err)
		}
		h := tok.(*hfTokenizer)
		for _, s := range append(longPieces(), strings.Repeat("hello", 100), strings.Repeat("hel", 333)+"lo") {
			want := h.mergeQuadratic(nil, s, make([]uint32, 0, len(s)), make([]uint64, 0, len(s)))
			if got := h.mergeLarge(nil, s); !slices.Equal(got, want) {
				t.Fatalf("%s: %.40q...: heap merge differs from the quadratic merge", p, s)
			}
		}
	}
}

func TestLongPieceIsNotQuadratic(t *testing.T) {
	tok := mustGet(t, "cl100k_base")
	s := strings.Repeat("ab", 50_000) // one 100 kB piece: minutes if quadratic
	start := time.Now()
	ids := tok.Encode(nil, s)
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("100 kB piece took %v", d)
	}
	if len(ids) == 0 {
		t.Fatal("no tokens")
	}
}

// FuzzLargeMerge checks the heap merge against the quadratic one on long
// pieces built from the input (repeated until past largePiece bytes).
func FuzzLargeMerge(f *testing.F) {
	for _, s := range []string{"ab", "hello", "aaa", "日本", "x!y", "the quick brown fox"} {
		f.Add(s)
	}
	bpes := []*bpe{&mustGet(f, "cl100k_base").(*tiktokenEncoding).bpe, &mustGet(f, "o200k_base").(*tiktokenEncoding).bpe}
	f.Fuzz(func(t *testing.T, s string) {
		if s == "" {
			return
		}
		piece := strings.Repeat(s, largePiece/len(s)+1)
		if len(piece) > 4096 {
			piece = piece[:4096]
		}
		for _, b := range bpes {
			want := b.mergeQuadratic(nil, piece, make([]bpePart, len(piece)+1))
			if got := b.appendLargePiece(nil, piece); !slices.Equal(got, want) {
				t.Fatalf("%q: heap merge %v, quadratic %v", piece, got, want)
			}
		}
	})
}

// Runs of one byte or of a few bytes merge exactly as the quadratic merge
// does at every length, through the rank buckets and the pair memo of the
// heap merge (the shapes the security review timed: spaces, newlines, tabs,
// one letter, "ab").
func TestRunsMergeAsTheQuadraticMerge(t *testing.T) {
	bpes := map[string]*bpe{"cl100k_base": &mustGet(t, "cl100k_base").(*tiktokenEncoding).bpe, "o200k_base": &mustGet(t, "o200k_base").(*tiktokenEncoding).bpe}
	top := 1500
	if raceEnabled {
		top = 400
	}
	for name, b := range bpes {
		for _, unit := range []string{" ", "\n", "\t", "a", "ab", "abc", " \n", "é", "日本"} {
			for n := largePiece; n < top; n += 1 + n/16 {
				piece := strings.Repeat(unit, n/len(unit)+1)[:n]
				if !utf8.ValidString(piece) {
					continue
				}
				want := b.mergeQuadratic(nil, piece, make([]bpePart, len(piece)+1))
				if got := b.appendLargePiece(nil, piece); !slices.Equal(got, want) {
					t.Fatalf("%s: %d bytes of %q: heap merge %v, quadratic %v", name, n, unit, got, want)
				}
			}
		}
	}
}

// A text whose size in bytes alone proves it over the limit (each token is
// at most the vocabulary's longest, 128 bytes for cl100k) is refused without
// tokenizing any of it: 30 MB of spaces (29 KB gzipped) took 6.5 s of CPU
// to refuse at a limit of 131,072 tokens (found by a security review).
func TestTextOverTheLimitBySizeIsNotTokenized(t *testing.T) {
	hf, err := LoadHF(tinyHF(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	spaces := strings.Repeat(" ", 30<<20) + "x"
	for name, tok := range map[string]Tokenizer{"cl100k_base": mustGet(t, "cl100k_base"), "o200k_base": mustGet(t, "o200k_base"), "tokenizer.json": hf} {
		if got, ok := encodeLimit(tok, nil, spaces, 131072); ok || len(got) != 0 {
			t.Fatalf("%s: 30 MB of spaces, limit 131072: ok %v after %d ids, want none", name, ok, len(got))
		}
		// Past the first slices, the bytes left prove it too.
		text := strings.Repeat(" ", 3<<20) + "x"
		got, ok := encodeLimit(tok, nil, text, 20000)
		if ok || len(got) > 20000 {
			t.Fatalf("%s: 3 MB of spaces, limit 20000: ok %v after %d ids", name, ok, len(got))
		}
		if got, ok := encodeLimit(tok, nil, text, math.MaxInt); !ok || !slices.Equal(got, tok.Encode(nil, text)) {
			t.Fatalf("%s: without a limit: ok %v, %d ids", name, ok, len(got))
		}
	}
}
