package tokenize

import (
	"sync"
	"unicode"
	"unicode/utf8"
)

// The hand-written pre-tokenizers below split text exactly as tiktoken's
// regular expressions do (as run by pkoukk/tiktoken-go's regexp2), without a
// regex engine: each function returns the end of the piece that starts at i,
// reproducing the alternation order and backtracking of the pattern. The
// fuzz test FuzzPretokenizers checks them against the regexes.

// The split patterns reproduced here: cl100k and o200k exactly as
// pkoukk/tiktoken-go compiles them, Qwen 2/3 and GPT-2 as their tokenizer.json
// files write them. The tests check each splitter against its pattern.
const (
	cl100kPattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	o200kPattern  = `[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?` +
		`|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?` +
		`|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	qwenPattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// Character classes, as bits.
const (
	clL  = 1 << iota // \p{L}
	clN              // \p{N}
	clS              // \s (unicode.IsSpace, as regexp2)
	clNL             // \r or \n
	clU              // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] (o200k "upper")
	clW              // [\p{Ll}\p{Lm}\p{Lo}\p{M}] (o200k "lower")
)

func computeClass(r rune) uint8 {
	var c uint8
	if unicode.IsLetter(r) {
		c |= clL
	}
	if unicode.IsNumber(r) {
		c |= clN
	}
	if unicode.IsSpace(r) {
		c |= clS
	}
	if r == '\r' || r == '\n' {
		c |= clNL
	}
	lmLoM := unicode.In(r, unicode.Lm, unicode.Lo, unicode.M)
	if lmLoM || unicode.In(r, unicode.Lu, unicode.Lt) {
		c |= clU
	}
	if lmLoM || unicode.Is(unicode.Ll, r) {
		c |= clW
	}
	return c
}

// bmpClass holds the class of every rune of the Basic Multilingual Plane,
// computed once (about 5 ms) when the first tokenizer is loaded.
var (
	bmpClass     [1 << 16]uint8
	bmpClassOnce sync.Once
)

func initClasses() {
	bmpClassOnce.Do(func() {
		for r := range rune(len(bmpClass)) {
			bmpClass[r] = computeClass(r)
		}
	})
}

// classAt returns the class of the rune at s[i] and its length in bytes.
// s must be valid UTF-8.
func classAt(s string, i int) (uint8, int) {
	if c := s[i]; c < utf8.RuneSelf {
		return bmpClass[c], 1
	}
	r, n := utf8.DecodeRuneInString(s[i:])
	if r < 1<<16 {
		return bmpClass[r], n
	}
	return computeClass(r), n
}

// scanAny returns the end of the run of runes from i whose class has a bit of mask.
func scanAny(s string, i int, mask uint8) int {
	for i < len(s) {
		c, n := classAt(s, i)
		if c&mask == 0 {
			break
		}
		i += n
	}
	return i
}

// scanNone returns the end of the run of runes from i whose class has no bit of mask.
func scanNone(s string, i int, mask uint8) int {
	for i < len(s) {
		c, n := classAt(s, i)
		if c&mask != 0 {
			break
		}
		i += n
	}
	return i
}

func lower(b byte) byte { return b | 0x20 }

// contraction returns the length of (?i:'s|'t|'re|'ve|'m|'ll|'d) at s[i:], or 0.
func contraction(s string, i int) int {
	if i+1 >= len(s) || s[i] != '\'' {
		return 0
	}
	switch lower(s[i+1]) {
	case 's', 't', 'm', 'd':
		return 2
	case 'r', 'v':
		if i+2 < len(s) && lower(s[i+2]) == 'e' {
			return 3
		}
	case 'l':
		if i+2 < len(s) && lower(s[i+2]) == 'l' {
			return 3
		}
	}
	return 0
}

// punctAndNewlines matches ` ?[^\s\p{L}\p{N}]+[\r\n]*` at i (with slash:
// ` ?[^\s\p{L}\p{N}]+[\r\n/]*`, o200k), or returns -1.
func punctAndNewlines(s string, i int, slash bool) int {
	j := i
	if s[i] == ' ' && i+1 < len(s) {
		if c, _ := classAt(s, i+1); c&(clS|clL|clN) == 0 {
			j = i + 1
		}
	}
	c, n := classAt(s, j)
	if c&(clS|clL|clN) != 0 {
		return -1
	}
	j = scanNone(s, j+n, clS|clL|clN)
	for j < len(s) && (s[j] == '\r' || s[j] == '\n' || slash && s[j] == '/') {
		j++
	}
	return j
}

// whitespace matches `\s*[\r\n]+|\s+(?!\S)|\s+` at i, where s[i] is a space.
func whitespace(s string, i int) int {
	j, lastNL, lastStart := i, -1, i
	for j < len(s) {
		c, n := classAt(s, j)
		if c&clS == 0 {
			break
		}
		if c&clNL != 0 {
			lastNL = j
		}
		lastStart = j
		j += n
	}
	switch {
	case lastNL >= 0: // \s*[\r\n]+ : up to the last newline of the run
		return lastNL + 1
	case j == len(s): // \s+(?!\S) at the end of text
		return j
	case lastStart > i: // \s+(?!\S) : leave the last space to the next piece
		return lastStart
	default: // \s+
		return j
	}
}

// splitCL100K returns the end of the cl100k_base piece starting at i:
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// Llama 3's tokenizer.json splits with the same pattern.
func splitCL100K(s string, i int) int { return splitCLStyle(s, i, 3) }

// splitQwen is splitCL100K with single digits (\p{N} instead of
// \p{N}{1,3}): the Split pattern of Qwen 2 and Qwen 3.
func splitQwen(s string, i int) int { return splitCLStyle(s, i, 1) }

func splitCLStyle(s string, i int, maxDigits int) int {
	if n := contraction(s, i); n > 0 {
		return i + n
	}
	c, n := classAt(s, i)
	if c&clL != 0 {
		return scanAny(s, i+n, clL)
	}
	if c&(clNL|clN) == 0 && i+n < len(s) {
		if c2, n2 := classAt(s, i+n); c2&clL != 0 {
			return scanAny(s, i+n+n2, clL)
		}
	}
	if c&clN != 0 {
		return digits(s, i+n, maxDigits)
	}
	if j := punctAndNewlines(s, i, false); j >= 0 {
		return j
	}
	return whitespace(s, i)
}

// splitGPT2 returns the end of the GPT-2 piece starting at i (the pattern of
// the ByteLevel pre-tokenizer with use_regex):
// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
func splitGPT2(s string, i int) int {
	if s[i] == '\'' && i+1 < len(s) {
		switch s[i+1] {
		case 's', 't', 'm', 'd':
			return i + 2
		case 'r', 'v':
			if i+2 < len(s) && s[i+2] == 'e' {
				return i + 3
			}
		case 'l':
			if i+2 < len(s) && s[i+2] == 'l' {
				return i + 3
			}
		}
	}
	j := i // where the run starts: after an optional leading space
	if s[i] == ' ' && i+1 < len(s) {
		j = i + 1
	}
	for _, mask := range [...]uint8{clL, clN} {
		if c, n := classAt(s, j); c&mask != 0 {
			return scanAny(s, j+n, mask)
		}
	}
	if c, n := classAt(s, j); c&(clS|clL|clN) == 0 {
		return scanNone(s, j+n, clS|clL|clN)
	}
	// \s+(?!\S)|\s+ ; no newline rule in GPT-2
	j, lastStart := i, i
	for j < len(s) {
		c, n := classAt(s, j)
		if c&clS == 0 {
			break
		}
		lastStart = j
		j += n
	}
	if j < len(s) && lastStart > i {
		return lastStart
	}
	return j
}

// digits ends \p{N}{1,max} whose first rune ends at i.
func digits(s string, i int, max int) int {
	for k := 1; k < max && i < len(s); k++ {
		c, n := classAt(s, i)
		if c&clN == 0 {
			break
		}
		i += n
	}
	return i
}

// upperLower matches [U]*[W]+ at i (U, W: the clU, clW classes), or returns -1.
func upperLower(s string, i int) int {
	lastW := -1 // end of the last W rune inside the U run
	for i < len(s) {
		c, n := classAt(s, i)
		if c&clU == 0 {
			if c&clW != 0 {
				return scanAny(s, i+n, clW)
			}
			break
		}
		i += n
		if c&clW != 0 {
			lastW = i
		}
	}
	// Backtrack: W+ takes the last W rune of the U run.
	return lastW
}

// upperThenLower matches [U]+[W]* at i, or returns -1.
func upperThenLower(s string, i int) int {
	j := scanAny(s, i, clU)
	if j == i {
		return -1
	}
	return scanAny(s, j, clW)
}

// splitO200K returns the end of the o200k_base piece starting at i:
// [^\r\n\p{L}\p{N}]?[U]*[W]+C?|[^\r\n\p{L}\p{N}]?[U]+[W]*C?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// with U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}], W = [\p{Ll}\p{Lm}\p{Lo}\p{M}],
// C = (?i:'s|'t|'re|'ve|'m|'ll|'d).
func splitO200K(s string, i int) int {
	c, n := classAt(s, i)
	prefix := c&(clNL|clL|clN) == 0 && i+n < len(s) // [^\r\n\p{L}\p{N}]? can take s[i]
	end := -1
	if prefix {
		end = upperLower(s, i+n)
	}
	if end < 0 {
		end = upperLower(s, i)
	}
	if end < 0 && prefix {
		end = upperThenLower(s, i+n)
	}
	if end < 0 {
		end = upperThenLower(s, i)
	}
	if end >= 0 {
		return end + contraction(s, end)
	}
	if c&clN != 0 {
		return digits(s, i+n, 3)
	}
	if j := punctAndNewlines(s, i, true); j >= 0 {
		return j
	}
	return whitespace(s, i)
}
