package bench

import "github.com/kvproxy/kvproxy/tokenize"

// SingleTokenWords returns the lowercase words of two to four letters that
// tok encodes, after a space, as exactly one token, in a fixed order.
// Chat replay writes one of them per synthesized token (ReplayConfig.Words),
// so that a prompt tokenized by the engine keeps the trace's length.
func SingleTokenWords(tok tokenize.Tokenizer) []string {
	var words []string
	var ids []uint32
	buf := []byte(" abcd")
	for n := 2; n <= 4; n++ {
		w := buf[1 : 1+n]
		for i := range w {
			w[i] = 'a'
		}
		for {
			ids = tok.Encode(ids[:0], string(buf[:1+n]))
			if len(ids) == 1 {
				words = append(words, string(w))
			}
			// the next word in alphabetical order, or done
			i := n - 1
			for i >= 0 && w[i] == 'z' {
				w[i] = 'a'
				i--
			}
			if i < 0 {
				break
			}
			w[i]++
		}
	}
	return words
}
