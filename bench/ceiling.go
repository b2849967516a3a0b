package bench

import "github.com/kvproxy/kvproxy/kv"

// LRU is a prefix cache of block hashes with least-recently-used eviction:
// the cache of one engine as big as a whole fleet, used for the hit-rate
// ceiling no routing policy can beat with the same total capacity.
type LRU struct {
	capacity int
	nodes    []lruNode // nodes[0] is the list's sentinel
	free     []int32
	index    map[kv.BlockHash]int32
}

type lruNode struct {
	hash       kv.BlockHash
	prev, next int32
}

// NewLRU returns an empty cache holding at most capacity blocks.
func NewLRU(capacity int) *LRU {
	l := &LRU{capacity: max(capacity, 1), index: make(map[kv.BlockHash]int32)}
	l.nodes = append(l.nodes, lruNode{})
	return l
}

// Lookup returns how many leading blocks of hashes are cached, at most
// limit, and refreshes them.
func (l *LRU) Lookup(hashes []kv.BlockHash, limit int) int {
	n := 0
	for n < len(hashes) && n < limit {
		i, ok := l.index[hashes[n]]
		if !ok {
			break
		}
		l.unlink(i)
		l.pushFront(i)
		n++
	}
	return n
}

// Insert caches every block of hashes, evicting the least recently used.
func (l *LRU) Insert(hashes []kv.BlockHash) {
	for _, h := range hashes {
		if i, ok := l.index[h]; ok {
			l.unlink(i)
			l.pushFront(i)
			continue
		}
		if len(l.index) >= l.capacity {
			old := l.nodes[0].prev
			l.unlink(old)
			delete(l.index, l.nodes[old].hash)
			l.free = append(l.free, old)
		}
		var i int32
		if k := len(l.free); k > 0 {
			i = l.free[k-1]
			l.free = l.free[:k-1]
		} else {
			l.nodes = append(l.nodes, lruNode{})
			i = int32(len(l.nodes) - 1)
		}
		l.nodes[i].hash = h
		l.index[h] = i
		l.pushFront(i)
	}
}

// Len is the number of cached blocks.
func (l *LRU) Len() int { return len(l.index) }

func (l *LRU) unlink(i int32) {
	p, n := l.nodes[i].prev, l.nodes[i].next
	l.nodes[p].next = n
	l.nodes[n].prev = p
}

func (l *LRU) pushFront(i int32) {
	head := l.nodes[0].next
	l.nodes[i].prev = 0
	l.nodes[i].next = head
	l.nodes[head].prev = i
	l.nodes[0].next = i
}

// CachedLimit is how many leading blocks of a prompt of n tokens an engine
// can take from cache: like vLLM, at least the last prompt token is always
// computed, so a fully cached prompt still recomputes its last block.
func CachedLimit(n, blockSize int) int {
	if n <= 0 {
		return 0
	}
	return (n - 1) / blockSize
}

// CeilingHitRate replays the workload's prompts in arrival order through one
// LRU cache of capacityBlocks blocks and returns cached prompt tokens over
// prompt tokens. Requests no engine of engineBlocks blocks can take (an
// empty prompt, or prompt and output beyond its cache: the simulator counts
// them as errors, outside its hit rates) are left out; engineBlocks 0 takes
// every request.
func CeilingHitRate(w *Workload, syn Synth, blockSize, capacityBlocks, engineBlocks int) float64 {
	l := NewLRU(capacityBlocks)
	var tokens []uint32
	var hashes []kv.BlockHash
	var prompt, cached int64
	for i := range w.Requests {
		r := &w.Requests[i]
		if engineBlocks > 0 && (r.InputLen == 0 || (r.InputLen+max(r.OutputLen, 1)+blockSize-1)/blockSize > engineBlocks) {
			continue
		}
		tokens = syn.Tokens(tokens[:0], r)
		hashes = kv.HashBlocks(hashes[:0], tokens, blockSize, 0)
		hit := l.Lookup(hashes, CachedLimit(len(tokens), blockSize))
		l.Insert(hashes)
		prompt += int64(len(tokens))
		cached += int64(hit * blockSize)
	}
	if prompt == 0 {
		return 0
	}
	return float64(cached) / float64(prompt)
}
