package tokenize

// Pieces of 128 bytes or more (a long word, a base64 blob, a run of
// digits-free symbols) are merged with a priority queue (rankQueue) instead
// of rescanning every pair after each merge: O(n log n) at worst, about
// linear for runs of one or a few bytes, instead of O(n²), with the same
// result (the lowest rank first, leftmost on ties), so a hostile prompt
// cannot make tokenization quadratic.

const largePiece = 128

// appendLargePiece is appendPiece for long pieces. Parts are named by their
// start offset and linked; rank[i] is the rank of part i merged with the
// next one. Queued entries whose rank no longer matches are stale: a rank
// names one token, so an equal rank means the same span. A span longer
// than the vocabulary's longest token is no token: it is not looked up.
func (b *bpe) appendLargePiece(dst []uint32, piece string) []uint32 {
	n := len(piece)
	m := getMergeScratch(n, false)
	defer m.put()
	next, prev, rank, q := m.next, m.prev, m.rank, &m.q
	tok := m.tok // the token of part i
	// Every part is a token, so a pair's rank is a function of its two
	// tokens: recent pairs are remembered (a run of one byte or of a few
	// repeats the same pairs; a string look-up cost a third of the merge).
	var memo [1024]struct{ l, r, merged uint32 }
	pairRank := func(i int32) uint32 {
		j := next[i]
		if int(j) >= n {
			return noRank
		}
		c := &memo[(tok[i]*0x9e3779b1^tok[j])&1023]
		if c.l == tok[i] && c.r == tok[j] && c.merged != 0 {
			return c.merged - 1
		}
		end := n
		if int(next[j]) < n {
			end = int(next[j])
		}
		r := uint32(noRank)
		if end-int(i) <= b.maxLen {
			if v, ok := b.ranks[piece[i:end]]; ok {
				r = v
			}
		}
		if r != noRank {
			c.l, c.r, c.merged = tok[i], tok[j], r+1
		}
		return r
	}
	for i := range int32(n) {
		next[i], prev[i], tok[i] = i+1, i-1, b.byteRank[piece[i]]
	}
	for i := range int32(n) {
		if rank[i] = pairRank(i); rank[i] != noRank {
			q.push(rank[i], i)
		}
	}
	for q.len() > 0 {
		r, i := q.pop()
		if rank[i] != r {
			continue
		}
		j := next[i]
		next[i], tok[i] = next[j], r
		if int(next[j]) < n {
			prev[next[j]] = i
		}
		rank[j] = noRank // j is gone
		if rank[i] = pairRank(i); rank[i] != noRank {
			q.push(rank[i], i)
		}
		if p := prev[i]; p >= 0 {
			if rank[p] = pairRank(p); rank[p] != noRank {
				q.push(rank[p], p)
			}
		}
	}
	for i := 0; i < n; i = int(next[i]) {
		dst = append(dst, b.ranks[piece[i:next[i]]])
	}
	return dst
}

// mergeLarge is hfTokenizer.merge for long words, with the same scheme:
// rank[i] holds rank<<32|merged id of symbol i with the next one.
func (t *hfTokenizer) mergeLarge(dst []uint32, w string) []uint32 {
	n := len(w)
	m := getMergeScratch(n, true)
	defer m.put()
	next, prev, sym, rank, q := m.next, m.prev, m.tok, m.rank64, &m.q
	for i := range int32(n) {
		next[i], prev[i], sym[i] = i+1, i-1, t.byteID[w[i]]
	}
	pairRank := func(i int32) uint64 {
		if int(next[i]) >= n {
			return noMerge
		}
		return t.pairRank(sym[i], sym[next[i]])
	}
	for i := range int32(n) {
		if rank[i] = pairRank(i); rank[i] != noMerge {
			q.push(uint32(rank[i]>>32), i)
		}
	}
	for q.len() > 0 {
		r, i := q.pop()
		if rank[i] == noMerge || uint32(rank[i]>>32) != r {
			continue
		}
		j := next[i]
		sym[i] = uint32(rank[i])
		next[i] = next[j]
		if int(next[j]) < n {
			prev[next[j]] = i
		}
		rank[j] = noMerge
		if rank[i] = pairRank(i); rank[i] != noMerge {
			q.push(uint32(rank[i]>>32), i)
		}
		if p := prev[i]; p >= 0 {
			if rank[p] = pairRank(p); rank[p] != noMerge {
				q.push(uint32(rank[p]>>32), p)
			}
		}
	}
	for i := 0; i < n; i = int(next[i]) {
		dst = append(dst, sym[i])
	}
	return dst
}
