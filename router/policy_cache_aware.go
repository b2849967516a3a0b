package router

import (
	"fmt"
	"math"
	"time"
)

// CacheAwareConfig configures cache_aware, the SGLang router's policy.
type CacheAwareConfig struct {
	BalanceAbsThreshold int     // default 32
	BalanceRelThreshold float64 // default 1.5
	CacheThreshold      float64 // default 0.5
	MaxTreeBlocks       int     // bound on the routing-history tree, default 2_000_000
}

// DefaultCacheAwareConfig returns SGLang router's defaults.
func DefaultCacheAwareConfig() CacheAwareConfig {
	return CacheAwareConfig{BalanceAbsThreshold: 32, BalanceRelThreshold: 1.5, CacheThreshold: 0.5, MaxTreeBlocks: 2_000_000}
}

// cacheAwarePolicy is the SGLang router's cache-aware policy. It keeps its
// own approximate tree of routing history (the blocks it sent to each
// worker, LRU-bounded, independent of the router's index and of engine
// events). If the load is imbalanced — max−min in-flight > abs threshold and
// max > rel threshold × min — it picks the least loaded worker; otherwise the
// longest prefix match if matched/total > cache threshold, else the worker
// whose tree is smallest.
type cacheAwarePolicy struct {
	cfg  CacheAwareConfig
	tree *MemIndex
}

func newCacheAwarePolicy(cfg *Config) (Policy, error) {
	c := &cfg.CacheAware
	d := DefaultCacheAwareConfig()
	if c.BalanceAbsThreshold == 0 {
		c.BalanceAbsThreshold = d.BalanceAbsThreshold
	}
	if c.BalanceRelThreshold == 0 {
		c.BalanceRelThreshold = d.BalanceRelThreshold
	}
	if c.CacheThreshold == 0 {
		c.CacheThreshold = d.CacheThreshold
	}
	if c.MaxTreeBlocks == 0 {
		c.MaxTreeBlocks = d.MaxTreeBlocks
	}
	if c.BalanceAbsThreshold < 0 || !(c.BalanceRelThreshold >= 1) || math.IsInf(c.BalanceRelThreshold, 1) || !(c.CacheThreshold >= 0 && c.CacheThreshold <= 1) || c.MaxTreeBlocks < 0 {
		return nil, fmt.Errorf("bad cache_aware thresholds %+v", *c)
	}
	return &cacheAwarePolicy{cfg: *c, tree: NewMemIndex(MemIndexConfig{MaxEntries: c.MaxTreeBlocks, Now: cfg.Now})}, nil
}

func (p *cacheAwarePolicy) Pick(s *Snapshot) int {
	c := s.Cands
	lo, hi := c[0].Inflight, c[0].Inflight
	for i := range c {
		lo, hi = min(lo, c[i].Inflight), max(hi, c[i].Inflight)
	}
	if hi-lo > int64(p.cfg.BalanceAbsThreshold) && float64(hi) > p.cfg.BalanceRelThreshold*float64(lo) {
		for i := range c {
			c[i].Score = float64(c[i].Inflight)
		}
		return pickLowest(s, 0)
	}
	sc := getScratch()
	defer putScratch(sc)
	sc.ov = p.tree.Match(s.Req.Hashes, sc.ov)
	best, depth := -1, int32(0)
	for _, o := range sc.ov {
		if k := candIndex(c, o.Worker); k >= 0 && (o.Depth > depth || (o.Depth == depth && k < best)) {
			best, depth = k, o.Depth
		}
	}
	total := len(s.Req.Hashes)
	if best >= 0 && total > 0 && float64(depth)/float64(total) > p.cfg.CacheThreshold {
		for i := range c {
			c[i].Score = 1
		}
		c[best].Score = 0
		return best
	}
	for i := range c {
		c[i].Score = float64(p.tree.WorkerBlocks(c[i].Worker))
	}
	return pickLowest(s, 0)
}

// Commit records the request's blocks as routed to the chosen worker.
func (p *cacheAwarePolicy) Commit(req *Request, d *Decision) {
	if len(req.Hashes) > 0 {
		p.tree.Store(d.Worker, req.Hashes, 0, time.Duration(0))
	}
}

// forgetWorker drops the routing history of a removed worker.
func (p *cacheAwarePolicy) forgetWorker(w WorkerID) { p.tree.ClearWorker(w) }
