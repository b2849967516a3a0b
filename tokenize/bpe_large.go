package tokenize

// Pieces of 128 bytes or more (a long word, a base64 blob, a run of
// digits-free symbols) are merged with a heap instead of rescanning every
// pair after each merge: O(n log n) instead of O(n²), with the same result
// (the lowest rank first, leftmost on ties), so a hostile prompt cannot make
// tokenization quadratic.

const largePiece = 128

// mergeHeap is a binary min-heap of rank<<32 | start offset.
type mergeHeap []uint64

func (h *mergeHeap) push(v uint64) {
	*h = append(*h, v)
	s := *h
	for i := len(s) - 1; i > 0; {
		p := (i - 1) / 2
		if s[p] <= s[i] {
			break
		}
		s[p], s[i] = s[i], s[p]
		i = p
	}
}

func (h *mergeHeap) pop() uint64 {
	s := *h
	top := s[0]
	last := len(s) - 1
	s[0] = s[last]
	s = s[:last]
	for i := 0; ; {
		l, m := 2*i+1, i
		if l < len(s) && s[l] < s[m] {
			m = l
		}
		if l+1 < len(s) && s[l+1] < s[m] {
			m = l + 1
		}
		if m == i {
			break
		}
		s[i], s[m] = s[m], s[i]
		i = m
	}
	*h = s
	return top
}

// appendLargePiece is appendPiece for long pieces. Parts are named by their
// start offset and linked; rank[i] is the rank of part i merged with the
// next one. Heap entries whose rank no longer matches are stale: a rank
// names one token, so an equal rank means the same span.
func (b *bpe) appendLargePiece(dst []uint32, piece string) []uint32 {
	n := len(piece)
	next := make([]int, n)
	prev := make([]int, n)
	rank := make([]uint32, n)
	h := make(mergeHeap, 0, n)
	pairRank := func(i int) uint32 {
		j := next[i]
		if j >= n {
			return noRank
		}
		end := n
		if next[j] < n {
			end = next[j]
		}
		if r, ok := b.ranks[piece[i:end]]; ok {
			return r
		}
		return noRank
	}
	for i := range n {
		next[i], prev[i] = i+1, i-1
	}
	for i := range n {
		if rank[i] = pairRank(i); rank[i] != noRank {
			h.push(uint64(rank[i])<<32 | uint64(i))
		}
	}
	for len(h) > 0 {
		e := h.pop()
		r, i := uint32(e>>32), int(uint32(e))
		if rank[i] != r {
			continue
		}
		j := next[i]
		next[i] = next[j]
		if next[j] < n {
			prev[next[j]] = i
		}
		rank[j] = noRank // j is gone
		if rank[i] = pairRank(i); rank[i] != noRank {
			h.push(uint64(rank[i])<<32 | uint64(i))
		}
		if p := prev[i]; p >= 0 {
			if rank[p] = pairRank(p); rank[p] != noRank {
				h.push(uint64(rank[p])<<32 | uint64(p))
			}
		}
	}
	for i := 0; i < n; i = next[i] {
		dst = append(dst, b.ranks[piece[i:next[i]]])
	}
	return dst
}

// mergeLarge is hfTokenizer.merge for long words, with the same heap
// scheme: rank[i] holds rank<<32|merged id of symbol i with the next one.
func (t *hfTokenizer) mergeLarge(dst []uint32, w string) []uint32 {
	n := len(w)
	next := make([]int, n)
	prev := make([]int, n)
	sym := make([]uint32, n)
	rank := make([]uint64, n)
	h := make(mergeHeap, 0, n)
	for i := range n {
		next[i], prev[i], sym[i] = i+1, i-1, t.byteID[w[i]]
	}
	pairRank := func(i int) uint64 {
		if next[i] >= n {
			return noMerge
		}
		return t.pairRank(sym[i], sym[next[i]])
	}
	for i := range n {
		if rank[i] = pairRank(i); rank[i] != noMerge {
			h.push(rank[i]&^0xffffffff | uint64(i))
		}
	}
	for len(h) > 0 {
		e := h.pop()
		i := int(uint32(e))
		if rank[i]>>32 != e>>32 || rank[i] == noMerge {
			continue
		}
		j := next[i]
		sym[i] = uint32(rank[i])
		next[i] = next[j]
		if next[j] < n {
			prev[next[j]] = i
		}
		rank[j] = noMerge
		if rank[i] = pairRank(i); rank[i] != noMerge {
			h.push(rank[i]&^0xffffffff | uint64(i))
		}
		if p := prev[i]; p >= 0 {
			if rank[p] = pairRank(p); rank[p] != noMerge {
				h.push(rank[p]&^0xffffffff | uint64(p))
			}
		}
	}
	for i := 0; i < n; i = next[i] {
		dst = append(dst, sym[i])
	}
	return dst
}
