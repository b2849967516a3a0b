package tokenize

import "sync"

// rankQueue is the priority queue of the heap merges (appendLargePiece,
// mergeLarge): it pops (rank, position) pairs lowest rank first, leftmost
// on ties, as one binary heap of them did, but keeps the positions of each
// rank in a bucket of their own, and the ranks with a bucket in a small
// heap. A bucket's positions are mostly pushed left to right (a piece's
// first pairs, then the merges of one rank done left to right), so most
// go to a queue in order and pop in O(1); the others go to the bucket's own
// heap. A run of spaces or of one letter, whose pairs share a few ranks,
// then merges in linear time: one heap of a position per byte made it
// cost 0.6 µs a byte against 0.04 for text (found by a security review).
type rankQueue struct {
	ranks   []uint32         // min-heap of the ranks with a bucket
	index   map[uint32]int32 // rank → its bucket in buckets
	buckets []rankBucket
	free    []int32 // buckets to reuse
	n       int     // positions queued
	// recent caches index for the ranks used last (a map look-up a push
	// cost a fifth of the merge); an entry is valid while its bucket is.
	recent [256]recentRank
}

type recentRank struct {
	rank   uint32
	bucket int32 // +1: 0 is no entry
}

type rankBucket struct {
	inOrder []int32 // ascending; inOrder[head:] are queued
	head    int
	heap    []int32 // min-heap of positions pushed out of order
}

// mergeScratch is the memory of one heap merge, pooled: a long piece's
// merge needs about 40 bytes a byte.
type mergeScratch struct {
	next, prev []int32
	rank, tok  []uint32
	rank64     []uint64
	q          rankQueue
}

var mergeScratchPool = sync.Pool{New: func() any {
	return &mergeScratch{q: rankQueue{index: make(map[uint32]int32, 64)}}
}}

// getMergeScratch returns scratch with next, prev, rank and tok of length
// n (rank64 of length n if wide), and an empty queue.
func getMergeScratch(n int, wide bool) *mergeScratch {
	m := mergeScratchPool.Get().(*mergeScratch)
	m.next = grow(m.next, n)
	m.prev = grow(m.prev, n)
	if wide {
		m.rank64 = grow(m.rank64, n)
	} else {
		m.rank = grow(m.rank, n)
	}
	m.tok = grow(m.tok, n)
	return m
}

// put returns m to the pool, unless it grew past what is worth keeping.
func (m *mergeScratch) put() {
	m.q.reset()
	if cap(m.next) <= maxWordBytes {
		mergeScratchPool.Put(m)
	}
}

func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// reset empties q, keeping its memory.
func (q *rankQueue) reset() {
	clear(q.index)
	q.ranks, q.free, q.n = q.ranks[:0], q.free[:0], 0
	for i := range q.buckets {
		b := &q.buckets[i]
		b.inOrder, b.head, b.heap = b.inOrder[:0], 0, b.heap[:0]
		q.free = append(q.free, int32(i))
	}
	q.recent = [len(q.recent)]recentRank{}
}

func (q *rankQueue) len() int { return q.n }

// push queues position pos at rank r.
func (q *rankQueue) push(r uint32, pos int32) {
	q.n++
	c := &q.recent[r&255]
	bi, ok := c.bucket-1, c.bucket > 0 && c.rank == r
	if !ok {
		bi, ok = q.index[r]
	}
	if !ok {
		if k := len(q.free); k > 0 {
			bi, q.free = q.free[k-1], q.free[:k-1]
		} else {
			q.buckets = append(q.buckets, rankBucket{})
			bi = int32(len(q.buckets) - 1)
		}
		q.index[r] = bi
		q.ranks = append(q.ranks, r)
		siftUp(q.ranks, len(q.ranks)-1)
	}
	*c = recentRank{rank: r, bucket: bi + 1}
	b := &q.buckets[bi]
	if b.head == len(b.inOrder) || pos > b.inOrder[len(b.inOrder)-1] {
		if len(b.inOrder) == cap(b.inOrder) && b.head >= len(b.inOrder)/2 {
			// Reuse the popped half rather than grow.
			b.inOrder = b.inOrder[:copy(b.inOrder, b.inOrder[b.head:])]
			b.head = 0
		}
		b.inOrder = append(b.inOrder, pos)
		return
	}
	b.heap = append(b.heap, pos)
	siftUp(b.heap, len(b.heap)-1)
}

// pop removes and returns the lowest rank's leftmost position. The queue
// must not be empty.
func (q *rankQueue) pop() (uint32, int32) {
	q.n--
	r := q.ranks[0]
	c := &q.recent[r&255]
	bi := c.bucket - 1
	if c.bucket == 0 || c.rank != r {
		bi = q.index[r]
		*c = recentRank{rank: r, bucket: bi + 1}
	}
	b := &q.buckets[bi]
	var pos int32
	if b.head < len(b.inOrder) && (len(b.heap) == 0 || b.inOrder[b.head] < b.heap[0]) {
		pos = b.inOrder[b.head]
		b.head++
	} else {
		pos = b.heap[0]
		last := len(b.heap) - 1
		b.heap[0] = b.heap[last]
		b.heap = b.heap[:last]
		siftDown(b.heap, 0)
	}
	if b.head == len(b.inOrder) && len(b.heap) == 0 {
		b.inOrder, b.head = b.inOrder[:0], 0
		delete(q.index, r)
		*c = recentRank{}
		q.free = append(q.free, bi)
		last := len(q.ranks) - 1
		q.ranks[0] = q.ranks[last]
		q.ranks = q.ranks[:last]
		siftDown(q.ranks, 0)
	}
	return r, pos
}

func siftUp[T uint32 | int32](h []T, i int) {
	for i > 0 {
		p := (i - 1) / 2
		if h[p] <= h[i] {
			return
		}
		h[p], h[i] = h[i], h[p]
		i = p
	}
}

func siftDown[T uint32 | int32](h []T, i int) {
	for {
		l, m := 2*i+1, i
		if l < len(h) && h[l] < h[m] {
			m = l
		}
		if l+1 < len(h) && h[l+1] < h[m] {
			m = l + 1
		}
		if m == i {
			return
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
}
