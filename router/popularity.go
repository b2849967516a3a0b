package router

import (
	"sync"

	"github.com/kvproxy/kvproxy/kv"
)

// popularity counts how many of the recently routed requests began with a
// prompt prefix. Each request counts the block hashes at the sampled depths
// (1 … 8 blocks, then a quarter deeper each time: about 30 for a 1,000-block
// prompt). A chain hash names its whole prefix, so a prefix is never more
// popular than a shorter one of the same chain. Two windows of popWindow
// requests are kept, the current one and the last, so counts are over the
// last popWindow to 2·popWindow requests.
type popularity struct {
	mu        sync.Mutex
	cur, prev map[kv.BlockHash]uint32
	n, prevN  int
}

const popWindow = 512

func newPopularity() *popularity {
	return &popularity{cur: make(map[kv.BlockHash]uint32), prev: make(map[kv.BlockHash]uint32)}
}

// nextDepth is the sampled depth after d.
func nextDepth(d int) int { return max(d+1, d+d/4) }

// record counts one routed request.
func (p *popularity) record(hashes []kv.BlockHash) {
	p.mu.Lock()
	for d := 1; d <= len(hashes); d = nextDepth(d) {
		p.cur[hashes[d-1]]++
	}
	p.n++
	if p.n >= popWindow {
		clear(p.prev)
		p.prev, p.cur = p.cur, p.prev
		p.prevN, p.n = p.n, 0
	}
	p.mu.Unlock()
}

// countLocked is how many of the counted requests began with the prefix h
// names (h a sampled depth's hash).
func (p *popularity) countLocked(h kv.BlockHash) uint32 { return p.cur[h] + p.prev[h] }
