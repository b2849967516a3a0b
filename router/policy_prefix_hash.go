package router

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
)

// prefixHashPolicy is consistent hashing with bounded loads (CHWBL), as
// KubeAI routes: the key is the chained hash of the prompt's first
// PrefixBlocks blocks (so it covers all of them), each available worker has
// VirtualNodes points on a ring, and the request goes to the first worker
// clockwise from the key whose in-flight count stays within LoadBound × the
// mean (counting this request).
type prefixHashPolicy struct {
	vnodes int
	bound  float64
	blocks int

	mu   sync.Mutex
	ring atomic.Pointer[hashRing]
}

type hashRing struct {
	version uint64
	points  []ringPoint
}

type ringPoint struct {
	pos uint64
	w   WorkerID
}

func newPrefixHashPolicy(cfg *Config) (Policy, error) {
	c := &cfg.PrefixHash
	if c.VirtualNodes == 0 {
		c.VirtualNodes = 256
	}
	if c.LoadBound == 0 {
		c.LoadBound = 1.25
	}
	if c.PrefixBlocks == 0 {
		c.PrefixBlocks = 4
	}
	if c.VirtualNodes < 1 || !(c.LoadBound >= 1) || math.IsInf(c.LoadBound, 1) || c.PrefixBlocks < 1 {
		return nil, fmt.Errorf("virtual_nodes and prefix_blocks must be positive and load_bound at least 1 (got %d, %d, %v)",
			c.VirtualNodes, c.PrefixBlocks, c.LoadBound)
	}
	return &prefixHashPolicy{vnodes: c.VirtualNodes, bound: c.LoadBound, blocks: c.PrefixBlocks}, nil
}

// ringFor returns the ring of s's candidates, rebuilt when membership or
// availability changed. A partial snapshot's ring is built for it alone
// (the version's full ring serves it too: Pick skips the workers left out).
func (p *prefixHashPolicy) ringFor(s *Snapshot) *hashRing {
	if r := p.ring.Load(); r != nil && r.version == s.Version {
		return r
	}
	if s.Partial {
		return p.buildRing(s)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.ring.Load(); r != nil && r.version == s.Version {
		return r
	}
	r := p.buildRing(s)
	p.ring.Store(r)
	return r
}

func (p *prefixHashPolicy) buildRing(s *Snapshot) *hashRing {
	r := &hashRing{version: s.Version, points: make([]ringPoint, 0, len(s.Cands)*p.vnodes)}
	for _, c := range s.Cands {
		id := InstanceID(c.Name)
		for v := 0; v < p.vnodes; v++ {
			r.points = append(r.points, ringPoint{mix64(id ^ mix64(uint64(v)+1)), c.Worker})
		}
	}
	slices.SortFunc(r.points, func(a, b ringPoint) int {
		switch {
		case a.pos < b.pos:
			return -1
		case a.pos > b.pos:
			return 1
		}
		return int(a.w) - int(b.w)
	})
	return r
}

func (p *prefixHashPolicy) Pick(s *Snapshot) int {
	key := s.Seed
	if n := len(s.Req.Hashes); n > 0 {
		key = mix64(uint64(s.Req.Hashes[min(n, p.blocks)-1]))
	}
	total := int64(0)
	for i := range s.Cands {
		total += s.Cands[i].Inflight
		s.Cands[i].Score = 1
	}
	limit := int64(math.Ceil(float64(total+1) * p.bound / float64(len(s.Cands))))
	ring := p.ringFor(s)
	start := sort.Search(len(ring.points), func(i int) bool { return ring.points[i].pos >= key })
	best := -1
	for j := 0; j < len(ring.points); j++ {
		pt := ring.points[(start+j)%len(ring.points)]
		k := candIndex(s.Cands, pt.w)
		if k < 0 {
			continue
		}
		if best < 0 {
			best = k // the unbounded owner, if every worker is over the bound
		}
		if s.Cands[k].Inflight+1 <= limit {
			best = k
			break
		}
	}
	if best < 0 {
		best = 0
	}
	s.Cands[best].Score = 0
	return best
}

func (*prefixHashPolicy) Commit(*Request, *Decision) {}

// candIndex finds worker w in cands (sorted by Worker), or -1.
func candIndex(cands []Candidate, w WorkerID) int {
	k := sort.Search(len(cands), func(i int) bool { return cands[i].Worker >= w })
	if k < len(cands) && cands[k].Worker == w {
		return k
	}
	return -1
}
