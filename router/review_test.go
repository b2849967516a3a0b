package router

import (
	"math"
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

// Non-finite coefficients pass a "not negative" check (NaN < 0 is false)
// and make every cost NaN, or Inf×0 = NaN: New must refuse them.
func TestNewRejectsNonFiniteCosts(t *testing.T) {
	for _, v := range []float64{math.NaN(), math.Inf(1)} {
		for i, set := range []func(c *CostConfig){
			func(c *CostConfig) { c.PrefillMsPerToken = v },
			func(c *CostConfig) { c.QueueMsPerToken = v },
			func(c *CostConfig) { c.DecodeMsPerBlock = v },
			func(c *CostConfig) { c.PrefillBaseMs = v },
			func(c *CostConfig) { c.PrefillMsPerToken2 = v },
			func(c *CostConfig) { c.FetchMsPerBlock[kv.TierHost] = v },
		} {
			cfg := DefaultConfig()
			set(&cfg.Cost)
			if _, err := New(cfg); err == nil {
				t.Errorf("coefficient %d = %v accepted", i, v)
			}
		}
	}
	for _, v := range []float64{math.NaN(), math.Inf(1)} {
		for i, set := range []func(c *Config){
			func(c *Config) { c.Temperature = v },
			func(c *Config) { c.Policy, c.Dynamo.OverlapWeight = "kv_dynamo", v },
			func(c *Config) { c.Policy, c.PrefixHash.LoadBound = "prefix_hash", v },
			func(c *Config) { c.Policy, c.CacheAware.BalanceRelThreshold = "cache_aware", v },
			func(c *Config) { c.Policy, c.CacheAware.CacheThreshold = "cache_aware", v },
		} {
			cfg := DefaultConfig()
			set(&cfg)
			if _, err := New(cfg); err == nil {
				t.Errorf("setting %d = %v accepted", i, v)
			}
		}
	}
}

// A policy whose scores are all NaN must still pick a candidate, not
// divide by zero ties.
func TestPickLowestAllNaN(t *testing.T) {
	cands := []Candidate{{Worker: 0, Score: math.NaN()}, {Worker: 1, Score: math.NaN()}}
	s := &Snapshot{Cands: cands, Seed: 7}
	for _, temp := range []float64{0, 0.5} {
		if k := pickLowest(s, temp); k < 0 || k >= len(cands) {
			t.Fatalf("temperature %v: picked %d", temp, k)
		}
	}
}

// An engine that reports waiting requests (traffic this router did not
// send) is predicted to queue them (CostConfig.predict takes the larger of
// the router's and the engine's queue). The calibrator must regress the
// observed TTFT on that same prediction: if it regresses on the router's
// queue alone, an engine exactly as fast as configured is fitted as slower,
// and the foreign queue is then counted twice.
func TestCalibrationSeesEngineReportedQueue(t *testing.T) {
	r := newTestRouter(t, "kv", 1, nil)
	cc := r.Config().Cost
	r.SetEngineLoad(0, 20, 4, 0.1)
	for i := 0; i < 300; i++ {
		q := &Request{Pinned: true, Pin: 0, PromptTokens: 2000}
		eq := r.worker(0).engineQueue(r.Config().BlockSize)
		d, a := mustRoute(t, r, q)
		c := d.Candidates[0]
		truth := cc.compute(&c, q.PromptTokens, max(c.PrefillTokens, eq)) // as configured, engine queue included
		a.ObserveTTFT(time.Duration(truth * float64(time.Millisecond)))
		a.PrefillDone()
		a.Free()
	}
	if s := r.Workers()[0].Slowdown; math.Abs(s-1) > 0.05 {
		t.Fatalf("slowdown %.3f for an engine exactly as configured, want 1", s)
	}
}

// One stalled request (a TTFT hundreds of times the prediction: an engine
// hiccup, a preemption) must not make a worker look slow for the hundreds
// of requests after it. Least squares gives the sample a weight of its
// squared residual; each sample's ratio is bounded instead.
func TestCalibrationSurvivesOneStall(t *testing.T) {
	r := newTestRouter(t, "kv", 1, nil)
	cc := r.Config().Cost
	observe := func(times float64) {
		q := &Request{Pinned: true, Pin: 0, PromptTokens: 2000}
		d, a := mustRoute(t, r, q)
		c := d.Candidates[0]
		truth := times * cc.compute(&c, q.PromptTokens, c.PrefillTokens)
		a.ObserveTTFT(time.Duration(truth * float64(time.Millisecond)))
		a.PrefillDone()
		a.Free()
	}
	for i := 0; i < 300; i++ {
		observe(1)
	}
	observe(500)
	for i := 0; i < 20; i++ {
		observe(1)
	}
	if s := r.Workers()[0].Slowdown; s > 1.25 {
		t.Fatalf("slowdown %.3f 20 requests after one stalled request, want about 1", s)
	}
}

// A worker that really is 6× slow still fits 6 with the bounded samples.
func TestCalibrationFitsLargeSlowdown(t *testing.T) {
	r := newTestRouter(t, "kv", 1, nil)
	cc := r.Config().Cost
	for i := 0; i < 600; i++ {
		q := &Request{Pinned: true, Pin: 0, PromptTokens: 100 + 37*i%5000}
		d, a := mustRoute(t, r, q)
		c := d.Candidates[0]
		truth := 6 * cc.compute(&c, q.PromptTokens, c.PrefillTokens)
		a.ObserveTTFT(time.Duration(truth * float64(time.Millisecond)))
		a.PrefillDone()
		a.Free()
	}
	if s := r.Workers()[0].Slowdown; math.Abs(s-6) > 0.3 {
		t.Fatalf("slowdown %.3f, want 6", s)
	}
}

// A removed worker's routing history must go with it, as its index entries
// do (SGLang's router drops the worker's tree too): when it comes back (an
// engine restarted with a cold cache) cache_aware must neither claim its old
// prefixes nor count its old tree against it.
func TestCacheAwareForgetsRemovedWorker(t *testing.T) {
	r := newTestRouter(t, "cache_aware", 2, nil)
	tree := r.policy.(*cacheAwarePolicy).tree
	_, a := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(20, 1), PromptTokens: 20 * 16})
	a.Free()
	_, b := mustRoute(t, r, &Request{Pinned: true, Pin: 1, Hashes: seq(5, 2), PromptTokens: 5 * 16})
	b.Free()
	r.RemoveWorker(0)
	r.AddWorker("w0")
	if n := tree.WorkerBlocks(0); n != 0 {
		t.Errorf("re-added worker still has %d blocks of routing history", n)
	}
	// A new prompt goes to the smallest tree: the fresh worker's.
	if d, _ := r.Select(req(seq(8, 3))); d.Worker != 0 {
		t.Errorf("new prompt went to %d, want the re-added (empty) worker 0", d.Worker)
	}
}

// A TTL beyond what the index's 32-bit second ticks hold (or one whose sum
// with the clock overflows a Duration) means "for as long as it can", not
// "already expired".
func TestMemIndexHugeTTLDoesNotExpireAtOnce(t *testing.T) {
	c := newFakeClock()
	x := NewMemIndex(MemIndexConfig{Now: c.Now})
	c.Advance(time.Hour)
	h := seq(4, 1)
	for _, ttl := range []time.Duration{math.MaxInt64, (1 << 32) * time.Second} {
		x.Store(0, h, kv.TierDevice, ttl)
		c.Advance(time.Hour)
		if ov := x.Match(h, nil); len(ov) != 1 || ov[0].Depth != 4 {
			t.Errorf("ttl %v: match %+v an hour after Store, want depth 4", ttl, ov)
		}
		x.ClearWorker(0)
	}
}

// Waiting for KV memory ends, at the latest, when every request live on the
// worker has finished: about one lifetime. A request needing more blocks
// than the (possibly under-estimated: several proxy replicas on one
// engine) capacity was priced deficit/active lifetimes: 40 lifetimes on a
// nearly idle worker, against 1.1 on a busy one, so it went to the busy one.
func TestMemoryWaitAtMostOneLifetime(t *testing.T) {
	r := newTestRouter(t, "kv", 2, nil)
	for id := WorkerID(0); id < 2; id++ {
		r.SetEngineCapacity(id, 1000)
		r.worker(id).lifeMs.Store(math.Float64bits(10_000))
	}
	idle := r.Commit(&Request{Hashes: seq(10, 1), PromptTokens: 10 * 16}, Decision{Worker: 0})
	busy := r.Commit(&Request{Hashes: seq(900, 2), PromptTokens: 900 * 16}, Decision{Worker: 1})
	idle.PrefillDone()
	busy.PrefillDone()
	d, _ := r.Select(&Request{Hashes: seq(1400, 3), PromptTokens: 1400 * 16})
	for _, c := range d.Candidates {
		if c.MemoryMs > 10_000 {
			t.Errorf("worker %d: memory wait %.0f ms, more than one lifetime (10000 ms)", c.Worker, c.MemoryMs)
		}
	}
	if d.Worker != 0 {
		t.Errorf("went to the busy worker %d: %+v", d.Worker, d.Candidates)
	}
	idle.Free()
	busy.Free()
}

// prefix_hash caches its ring per membership version. A Select that read
// a worker unavailable, then the version of it being available again,
// cached a ring without the worker under the current version: the worker
// got no prefix_hash traffic until the next change. A stress test (before
// the fix it failed in about one run in three at 20,000 rounds).
func TestPrefixHashRingFollowsAvailability(t *testing.T) {
	r := newTestRouter(t, "prefix_hash", 4, nil)
	p := r.policy.(*prefixHashPolicy)
	bad := 0
	for round := 0; round < 5000; round++ {
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			r.SetAvailable(3, false)
			r.SetAvailable(3, true)
		}()
		go func() {
			defer wg.Done()
			for i := 0; i < 2; i++ {
				r.Select(req(seq(4, uint64(i))))
			}
		}()
		wg.Wait()
		r.Select(req(seq(4, 99)))
		ring := p.ring.Load()
		has := false
		for _, pt := range ring.points {
			if pt.w == 3 {
				has = true
				break
			}
		}
		if ring.version == r.version.Load() && !has {
			bad++
		}
	}
	if bad > 0 {
		t.Fatalf("%d rounds left a ring without worker 3 cached under the current version", bad)
	}
}

// In event mode the engine reports a block once, when it stores it; every
// later hit keeps it hot in the engine but told the index nothing, so the
// size bound (least recently *stored*) pruned the hottest prefix first: the
// shared system prompt stopped matching after 101 of 400 requests.
func TestEventModeHotPrefixSurvivesSizeBound(t *testing.T) {
	r := newTestRouter(t, "kv", 2, func(c *Config) { c.MaxIndexBlocks = 2000 })
	r.SetApproximate(0, false)
	r.SetApproximate(1, false)
	system := seq(8, 1)
	r.Index().Store(0, system, kv.TierDevice, 0) // the engine stored it once
	hits := 0
	for i := 0; i < 400; i++ {
		// every request shares the system prompt; the engine reports only its new blocks
		conv := append(append([]kv.BlockHash{}, system...), seq(20, uint64(100+i))...)
		d, a, err := r.Route(&Request{Hashes: conv, PromptTokens: len(conv) * 16})
		if err != nil {
			t.Fatal(err)
		}
		if d.Overlap >= 8 {
			hits++
		}
		r.Index().Store(d.Worker, conv[8:], kv.TierDevice, 0) // BlockStored of the new blocks (parent known)
		a.Free()
	}
	t.Logf("hits %d of 400, index len %d", hits, r.Index().Len())
	if ov := r.Index().Match(system, nil); len(ov) == 0 {
		t.Fatalf("the hottest prefix was evicted: hits %d of 400", hits)
	}
}

// A worker removed and added again comes back as a new worker would:
// approximate, until an event feed says otherwise. It stayed in event mode,
// so a backend re-added without an event feed was never indexed at all.
func TestReAddedWorkerIsApproximateAgain(t *testing.T) {
	r := newTestRouter(t, "kv", 2, nil)
	r.SetApproximate(0, false) // an event feed ran for it
	r.RemoveWorker(0)
	r.AddWorker("w0") // back, with no event feed
	if !r.Workers()[0].Approximate {
		t.Fatal("re-added worker still in event mode")
	}
	h := seq(8, 1)
	_, a := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: h, PromptTokens: 8 * 16})
	a.Free()
	if d, _ := r.Select(req(h)); d.Overlap != 8 || d.Worker != 0 {
		t.Fatalf("overlap %d on %d after routing there, want 8 on 0", d.Overlap, d.Worker)
	}
}
