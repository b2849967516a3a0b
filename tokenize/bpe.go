package tokenize

import (
	"math"
	"unicode/utf8"
)

// bpe is a byte-level BPE vocabulary: token bytes → rank, where a token's
// rank is both its id and its merge priority (tiktoken's convention).
type bpe struct {
	ranks    map[string]uint32
	maxLen   int         // bytes of the longest token
	byteRank [256]uint32 // the rank of each byte's token
}

func newBPE(ranks map[string]uint32) bpe {
	b := bpe{ranks: ranks}
	for t, r := range ranks {
		b.maxLen = max(b.maxLen, len(t))
		if len(t) == 1 {
			b.byteRank[t[0]] = r
		}
	}
	return b
}

const noRank = math.MaxUint32

type bpePart struct {
	start int
	rank  uint32
}

// rankOf is the rank of piece[parts[i].start:parts[i+skip+2].start].
func (b *bpe) rankOf(piece string, parts []bpePart, i, skip int) uint32 {
	if i+skip+2 < len(parts) {
		if r, ok := b.ranks[piece[parts[i].start:parts[i+skip+2].start]]; ok {
			return r
		}
	}
	return noRank
}

// appendPiece appends the tokens of one pre-tokenized piece, merging the
// lowest-ranked adjacent pair first (leftmost on ties), exactly as tiktoken's
// byte_pair_merge. Pieces shorter than largePiece bytes do not allocate.
func (b *bpe) appendPiece(dst []uint32, piece string) []uint32 {
	if r, ok := b.ranks[piece]; ok {
		return append(dst, r)
	}
	if len(piece) >= largePiece {
		return b.appendLargePiece(dst, piece)
	}
	var stack [largePiece + 1]bpePart
	return b.mergeQuadratic(dst, piece, stack[:len(piece)+1])
}

// mergeQuadratic rescans every pair after each merge: fastest for short
// pieces. parts is scratch space of length len(piece)+1.
func (b *bpe) mergeQuadratic(dst []uint32, piece string, parts []bpePart) []uint32 {
	for i := range parts {
		parts[i] = bpePart{start: i, rank: noRank}
	}
	for i := 0; i+2 < len(parts); i++ {
		parts[i].rank = b.rankOf(piece, parts, i, 0)
	}
	for len(parts) > 1 {
		minRank, i := uint32(noRank), -1
		for j := 0; j < len(parts)-1; j++ {
			if parts[j].rank < minRank {
				minRank, i = parts[j].rank, j
			}
		}
		if i < 0 {
			break
		}
		parts[i].rank = b.rankOf(piece, parts, i, 1)
		if i > 0 {
			parts[i-1].rank = b.rankOf(piece, parts, i-1, 1)
		}
		parts = append(parts[:i+1], parts[i+2:]...)
	}
	for i := 0; i+1 < len(parts); i++ {
		dst = append(dst, b.ranks[piece[parts[i].start:parts[i+1].start]])
	}
	return dst
}

// maxWordBytes bounds the word one BPE merges at once. A longer one
// (megabytes of letters or base64 with no break) is merged in slices of
// this size, cut where a rune starts: its tokens then differ from the
// engine's past the first cut, which loses cache matches only deep inside
// such a word, and the merge's memory (about 28 bytes a byte of the word)
// and an encoding's limit stay bounded (found by the twelfth session's
// abuse trial: a 16 MB word took 13.5 s, and no limit could stop it).
const maxWordBytes = 1 << 20

// wordSlice is the length of the slice of w to merge next: all of it, or
// at most maxWordBytes, ending where a rune starts.
func wordSlice(w string) int {
	if len(w) <= maxWordBytes {
		return len(w)
	}
	k := maxWordBytes
	for k > maxWordBytes-utf8.UTFMax && !utf8.RuneStart(w[k]) {
		k--
	}
	return k
}
