package tokenize

import (
	"strings"
	"testing"
)

// BenchmarkEncodeRuns encodes 1 MiB of one hostile shape (a run of spaces,
// of one letter, of "ab": one piece each, merged by the heap merge) next to
// 1 MiB of ordinary text, with no limit: tokenizing should cost about the
// same per byte whatever the shape. The Llama 3 tokenizer.json is measured
// when the reference models are installed.
//
//	go test -run '^$' -bench EncodeRuns -benchmem ./tokenize
func BenchmarkEncodeRuns(b *testing.B) {
	const n = 1 << 20
	for _, name := range []string{"cl100k_base", "o200k_base", "llama3"} {
		b.Run(name, func(b *testing.B) {
			var tok Tokenizer
			if name == "llama3" {
				tok, _ = loadRefModel(b, name)
			} else {
				tok = mustGet(b, name)
			}
			text, _ := textOfTokens(tok, n/4)
			for _, c := range []struct{ name, text string }{
				{"spaces", strings.Repeat(" ", n-1) + "x"},
				{"letters", strings.Repeat("a", n)},
				{"ab", strings.Repeat("ab", n/2)},
				{"text", text[:n]},
			} {
				b.Run(c.name, func(b *testing.B) {
					b.ReportAllocs()
					b.SetBytes(int64(len(c.text)))
					var dst []uint32
					for b.Loop() {
						dst = tok.Encode(dst[:0], c.text)
					}
					b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(c.text)), "ns/byte")
				})
			}
		})
	}
}
