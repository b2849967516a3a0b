package router

import (
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

// mockPrefillMs is the simulated engine's prefill time for u tokens cut
// into 8192-token chunks, with no decodes.
func mockPrefillMs(u int) float64 {
	ms := 0.0
	for u > 0 {
		t := float64(min(u, 8192))
		ms += 4.209989e-7*t*t + 0.01518344*t + 16.50142
		u -= 8192
	}
	return ms
}

func TestCostModelFollowsMockTiming(t *testing.T) {
	cc := DefaultCostConfig()
	co := 1.0
	for _, u := range []int{16, 500, 2000, 8000, 20000, 64000} {
		got := cc.predict(co, &Candidate{}, u, 16, 0)
		want := mockPrefillMs(u)
		if math.Abs(got-want) > 0.05*want {
			t.Errorf("%d tokens: predicted %.1f ms, engine takes %.1f ms", u, got, want)
		}
	}
}

func TestCostModelTerms(t *testing.T) {
	cc := DefaultCostConfig()
	co := 1.0
	base := cc.predict(co, &Candidate{}, 1600, 16, 0)
	hit := cc.predict(co, &Candidate{Overlap: 50, Tiers: [kv.NumTiers]int32{50}}, 1600, 16, 0)
	host := cc.predict(co, &Candidate{Overlap: 50, Tiers: [kv.NumTiers]int32{0, 50}}, 1600, 16, 0)
	queued := cc.predict(co, &Candidate{PrefillTokens: 4000}, 1600, 16, 0)
	busy := cc.predict(co, &Candidate{ActiveBlocks: 10000}, 1600, 16, 0)
	engine := cc.predict(co, &Candidate{PrefillTokens: 100}, 1600, 16, 4000)
	if !(hit < host && host < base) {
		t.Errorf("device hit %.2f, host hit %.2f, miss %.2f: want increasing", hit, host, base)
	}
	if d := queued - base; math.Abs(d-4000*cc.QueueMsPerToken) > 1e-9 {
		t.Errorf("queue term %.3f", d)
	}
	if d := busy - base; math.Abs(d-10000*cc.DecodeMsPerBlock) > 1e-9 {
		t.Errorf("decode term %.3f", d)
	}
	if engine != queued {
		t.Errorf("engine queue view %.3f, want max(own, engine) = %.3f", engine, queued)
	}
	if got := cc.predict(co, &Candidate{Overlap: 200}, 1600, 16, 0); got != cc.PrefillBaseMs {
		t.Errorf("fully cached prompt costs %.3f, want the base %.1f", got, cc.PrefillBaseMs)
	}
}

// TestExternalityPricesMissesByLoad: on an idle fleet kv minimises the
// request's own TTFT; once requests wait for their first token, a cache
// miss also costs them (Candidate.ExternalMs) and kv keeps the request on
// its cache although its own TTFT would be lower elsewhere.
func TestExternalityPricesMissesByLoad(t *testing.T) {
	r := newTestRouter(t, "kv", 2, nil)
	cc := r.Config().Cost
	conv := seq(256, 1)
	r.SetApproximate(0, false)
	r.Index().Store(0, conv[:250], kv.TierDevice, 0) // worker 0 holds 4,000 of the 4,101 tokens
	q := req(conv)
	d, _ := r.Select(q)
	if d.Worker != 0 || d.Candidates[0].ExternalMs != 0 || d.Candidates[1].ExternalMs != 0 {
		t.Fatalf("idle fleet: worker %d, externalities %.2f %.2f, want worker 0 and none",
			d.Worker, d.Candidates[0].ExternalMs, d.Candidates[1].ExternalMs)
	}
	// Two 2,500-token prompts queue on worker 0 and wait for their first token.
	var queued []*Active
	for i := 0; i < 2; i++ {
		_, a := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(156, uint64(10+i)), PromptTokens: 2500})
		queued = append(queued, a)
	}
	if st := r.Workers(); st[0].Pending != 2 || st[1].Pending != 0 {
		t.Fatalf("pending %d and %d, want 2 and 0", st[0].Pending, st[1].Pending)
	}
	d, _ = r.Select(q)
	c0, c1 := d.Candidates[0], d.Candidates[1]
	if c1.CostMs >= c0.CostMs {
		t.Fatalf("setup: own TTFT %.1f on the cache, %.1f elsewhere; want the cache worker slower", c0.CostMs, c1.CostMs)
	}
	waiters := 1.0 // 2 pending over 2 workers
	if want := waiters * cc.PrefillMsPerToken * cc.effectiveTokens(q.PromptTokens); math.Abs(c1.ExternalMs-want) > 1e-9 {
		t.Errorf("miss externality %.3f, want %.3f", c1.ExternalMs, want)
	}
	if want := waiters * cc.PrefillMsPerToken * cc.effectiveTokens(q.PromptTokens-250*16); math.Abs(c0.ExternalMs-want) > 1e-9 {
		t.Errorf("hit externality %.3f, want %.3f", c0.ExternalMs, want)
	}
	if d.Worker != 0 || c0.Score != c0.CostMs+c0.ExternalMs {
		t.Fatalf("loaded fleet: worker %d (scores %.1f %.1f), want the cache worker 0", d.Worker, c0.Score, c1.Score)
	}
	queued[0].PrefillDone()
	queued[1].Free() // freed before its first token
	if st := r.Workers(); st[0].Pending != 0 {
		t.Fatalf("pending %d after first token and free, want 0", st[0].Pending)
	}
	queued[0].Free()
	if !r.Idle() {
		t.Fatalf("not idle: %+v", r.Workers())
	}
}

// TestMemoryWaitFromEngineUsage: the engine's capacity is estimated from
// its reported usage, and a request that would not fit next to the live
// requests is predicted to wait for the excess to be freed.
func TestMemoryWaitFromEngineUsage(t *testing.T) {
	c := newFakeClock()
	r := newTestRouter(t, "kv", 2, func(cfg *Config) { cfg.Now = c.Now })
	_, a := mustRoute(t, r, &Request{Pinned: true, Pin: 0, PromptTokens: 100})
	c.Advance(10 * time.Second) // a request lifetime of 10 s
	a.PrefillDone()
	a.Free()
	// 600 blocks live on worker 0 at 60% usage, nothing waiting: 1,000 blocks.
	live := r.Commit(&Request{Hashes: seq(600, 7), PromptTokens: 600 * 16}, Decision{Worker: 0})
	live.PrefillDone()
	r.SetEngineLoad(0, 4, 1, 0.9) // requests waiting: not a capacity sample
	r.SetEngineLoad(0, 0, 1, 0.6)
	st := r.Workers()[0]
	if math.Abs(st.CacheBlocks-1000) > 1e-6 || st.LifetimeMs != 10000 {
		t.Fatalf("capacity %.1f blocks, lifetime %.0f ms; want 1000 and 10000", st.CacheBlocks, st.LifetimeMs)
	}
	// 700 blocks, 200 of them cached on worker 0: 500 new blocks there, 100
	// more than free; freeing 100 of 600 live blocks takes 1/6 lifetime.
	conv := seq(700, 9)
	r.SetApproximate(0, false)
	r.Index().Store(0, conv[:200], kv.TierDevice, 0)
	d, _ := r.Select(&Request{Hashes: conv, PromptTokens: 700 * 16})
	c0, c1 := d.Candidates[0], d.Candidates[1]
	if want := 10000.0 / 6; math.Abs(c0.MemoryMs-want) > 1e-6 || c1.MemoryMs != 0 {
		t.Fatalf("memory waits %.1f and %.1f ms, want %.1f and 0", c0.MemoryMs, c1.MemoryMs, want)
	}
	cc := r.Config().Cost
	noWait := c0
	noWait.MemoryMs = 0
	if got := c0.CostMs - cc.predict(1, &noWait, 700*16, 16, 0); math.Abs(got-c0.MemoryMs) > 1e-6 {
		t.Fatalf("CostMs carries %.1f ms of memory wait, want %.1f", got, c0.MemoryMs)
	}
	if d.Worker != 1 {
		t.Fatalf("went to worker %d, whose cache saves %.1f ms but whose memory is full", d.Worker, c1.CostMs-(c0.CostMs-c0.MemoryMs))
	}
	live.Free()
	if !r.Idle() {
		t.Fatal("not idle")
	}
}

// TestLoadSignalsIgnoreRequestsThatDoNotReport: a non-streamed request is not
// "awaiting its first token" for its whole answer, a request freed before
// it ran (a retry elsewhere) has no lifetime, and a capacity sample needs
// blocks of this router's own on the engine.
func TestLoadSignalsIgnoreRequestsThatDoNotReport(t *testing.T) {
	c := newFakeClock()
	r := newTestRouter(t, "kv", 2, func(cfg *Config) { cfg.Now = c.Now })
	_, whole := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(10, 1), PromptTokens: 160, Unstreamed: true})
	_, streamed := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(10, 2), PromptTokens: 160})
	if st := r.Workers()[0]; st.Pending != 1 || st.Inflight != 2 {
		t.Fatalf("pending %d inflight %d, want 1 (the streamed request) and 2", st.Pending, st.Inflight)
	}
	c.Advance(5 * time.Second)
	streamed.Free() // never ran: refused, retried elsewhere
	if st := r.Workers()[0]; st.LifetimeMs != 0 {
		t.Fatalf("lifetime %.0f ms from a request that never ran", st.LifetimeMs)
	}
	whole.PrefillDone()
	whole.Free()
	if st := r.Workers()[0]; st.LifetimeMs != 5000 {
		t.Fatalf("lifetime %.0f ms, want 5000 from the request that ran", st.LifetimeMs)
	}
	ours := r.Commit(&Request{Hashes: seq(100, 3), PromptTokens: 1600}, Decision{Worker: 1})
	ours.PrefillDone()
	r.SetEngineLoad(1, 0, 1, 0.5) // our 100 blocks are half the engine: 200
	ours.Free()
	r.SetEngineLoad(1, 0, 3, 0.5) // busy with other clients' requests, none of ours
	if st := r.Workers()[1]; math.Abs(st.CacheBlocks-200) > 1e-9 {
		t.Fatalf("capacity %.1f blocks, want 200 kept when none of the engine's blocks are ours", st.CacheBlocks)
	}
	if !r.Idle() {
		t.Fatalf("not idle: %+v", r.Workers())
	}
}

// TestEngineReportedCapacityWins: the engine's own capacity figure replaces
// the estimate from usage (which is low when others share the engine) and
// is not overwritten by later usage samples; 0 returns to estimating.
func TestEngineReportedCapacityWins(t *testing.T) {
	r := newTestRouter(t, "kv", 2, nil)
	ours := r.Commit(&Request{Hashes: seq(100, 5), PromptTokens: 1600}, Decision{Worker: 0})
	ours.PrefillDone()
	r.SetEngineLoad(0, 0, 4, 0.5) // our 100 blocks are half of what the engine uses: estimate 200
	if st := r.Workers()[0]; math.Abs(st.CacheBlocks-200) > 1e-9 {
		t.Fatalf("estimated capacity %.1f, want 200", st.CacheBlocks)
	}
	r.SetEngineCapacity(0, 1000)
	r.SetEngineLoad(0, 0, 4, 0.5)
	if st := r.Workers()[0]; st.CacheBlocks != 1000 {
		t.Fatalf("capacity %.1f after the engine reported 1000", st.CacheBlocks)
	}
	r.SetEngineCapacity(0, 0)
	r.SetEngineLoad(0, 0, 4, 0.5)
	if st := r.Workers()[0]; st.CacheBlocks >= 1000 {
		t.Fatalf("capacity %.1f: usage samples ignored after the report was withdrawn", st.CacheBlocks)
	}
	ours.Free()
}

// TestUnstreamedPrefillEndsAtPredictedTTFT: a non-streamed request leaves
// the worker's queued prefill once its predicted TTFT has passed, with no
// call from the caller (whose first token it never sees) and no timer; a
// streamed one stays until its PrefillDone.
func TestUnstreamedPrefillEndsAtPredictedTTFT(t *testing.T) {
	c := newFakeClock()
	r := newTestRouter(t, "kv", 2, func(cfg *Config) { cfg.Now = c.Now })
	dw, whole := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(10, 1), PromptTokens: 160, Unstreamed: true})
	_, streamed := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(10, 2), PromptTokens: 160})
	_, early := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(10, 3), PromptTokens: 160, Unstreamed: true})
	if dw.PredictedTTFTms <= 0 {
		t.Fatalf("predicted TTFT %v", dw.PredictedTTFTms)
	}
	if st := r.Workers()[0]; st.PrefillTokens != 480 {
		t.Fatalf("queued prefill %d, want 480", st.PrefillTokens)
	}
	early.Free() // answered before its predicted TTFT: nothing left to end

	c.Advance(time.Duration(dw.PredictedTTFTms * 0.9 * float64(time.Millisecond)))
	if st := r.Workers()[0]; st.PrefillTokens != 320 {
		t.Fatalf("queued prefill %d before the predicted TTFT, want 320", st.PrefillTokens)
	}
	c.Advance(time.Duration(dw.PredictedTTFTms * 10 * float64(time.Millisecond)))
	// Routing sees it too, not only the status.
	d, other := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(10, 4), PromptTokens: 160, Unstreamed: true})
	if k := candIndex(d.Candidates, 0); d.Candidates[k].PrefillTokens != 160 {
		t.Fatalf("routing saw %d queued prefill tokens, want 160 (the streamed request's)", d.Candidates[k].PrefillTokens)
	}
	if st := r.Workers()[0]; st.Inflight != 3 || st.Pending != 1 {
		t.Fatalf("inflight %d pending %d, want 3 and 1", st.Inflight, st.Pending)
	}
	whole.PrefillDone() // the whole answer arrived: a no-op for the counters
	whole.Free()
	streamed.PrefillDone()
	streamed.Free()
	other.Free()
	if !r.Idle() {
		t.Fatalf("not idle: %+v", r.Workers()[0])
	}
}

// Many unstreamed requests with different predicted TTFTs, some freed
// early: at every moment the worker's queued prefill is exactly that of the
// live ones not yet due (the due times are a heap; this checks its order).
func TestUnstreamedPrefillsEndInDueOrder(t *testing.T) {
	c := newFakeClock()
	r := newTestRouter(t, "kv", 1, func(cfg *Config) { cfg.Now = c.Now })
	type req struct {
		a      *Active
		due    int64
		tokens int64
		freed  bool
	}
	var reqs []*req
	route := func(i, tokens int) {
		_, a := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(tokens/16, uint64(1000+i)), PromptTokens: tokens, Unstreamed: true})
		reqs = append(reqs, &req{a: a, due: a.dueNs, tokens: a.prefill})
		c.Advance(time.Duration(i%3) * time.Millisecond)
	}
	// Large prompts first, due later and later as the queue grows; most of
	// them answered early; then small ones, due sooner than the large ones
	// still waiting: pushed after them, they must come out first.
	for i := 0; i < 100; i++ {
		route(i, 16*(100+(i*37)%400))
	}
	for i, q := range reqs {
		if i%4 != 0 {
			q.a.Free()
			q.freed = true
		}
	}
	for i := 100; i < 200; i++ {
		route(i, 16*(1+(i*37)%20))
	}
	// Just before and at every due time still ahead (the routing took
	// simulated time: some are due already).
	var times []int64
	for _, q := range reqs {
		if q.due > c.Now().UnixNano() {
			times = append(times, q.due-1, q.due)
		}
	}
	if len(times) < 100 {
		t.Fatalf("only %d due times ahead", len(times)/2)
	}
	slices.Sort(times)
	for _, at := range times {
		if d := at - c.Now().UnixNano(); d > 0 {
			c.Advance(time.Duration(d))
		}
		want := int64(0)
		for _, q := range reqs {
			if !q.freed && q.due > at {
				want += q.tokens
			}
		}
		if got := r.Workers()[0].PrefillTokens; got != want {
			t.Fatalf("at %d: queued prefill %d, want %d", at, got, want)
		}
	}
	for _, q := range reqs {
		q.a.Free()
	}
	if !r.Idle() {
		t.Fatal("not idle")
	}
}

// TestAuxiliaryRequestsStayOutOfTheStatistics: embeddings and tokenize
// requests (Request.Auxiliary) are load while they run, but do not pull
// the mean lifetime (the wait for KV memory) or the mean uncached tokens
// (the size of the engine's reported queue) towards their own.
func TestAuxiliaryRequestsStayOutOfTheStatistics(t *testing.T) {
	c := newFakeClock()
	r := newTestRouter(t, "kv", 2, func(cfg *Config) { cfg.Now = c.Now })
	_, gen := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: seq(100, 1), PromptTokens: 1600})
	c.Advance(5 * time.Second)
	gen.PrefillDone()
	gen.Free()
	r.SetEngineLoad(0, 10, 1, 0.1) // ten requests waiting on the engine
	probe := &Request{Pinned: true, Pin: 0, Hashes: seq(10, 9), PromptTokens: 160}
	before, _ := r.Select(probe)
	for i := 0; i < 20; i++ {
		_, aux := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Auxiliary: true, Unstreamed: true})
		if st := r.Workers()[0]; st.Inflight != 1 {
			t.Fatalf("an auxiliary request is not in flight: %+v", st)
		}
		c.Advance(10 * time.Millisecond)
		aux.PrefillDone()
		aux.Free()
	}
	after, _ := r.Select(probe)
	if st := r.Workers()[0]; st.LifetimeMs != 5000 {
		t.Fatalf("lifetime %.0f ms, want the generation's 5000", st.LifetimeMs)
	}
	if b, a := before.Candidates[0].CostMs, after.Candidates[0].CostMs; b != a {
		t.Fatalf("predicted TTFT %.2f ms before the auxiliary requests, %.2f after: the engine's queue was resized", b, a)
	}
	if !r.Idle() {
		t.Fatal("not idle")
	}
}

// TestRemoteLoadIsWeighedLikeOwn: the load other replicas report on a
// worker (SetRemoteLoad) counts in selection as this router's own would,
// and shows apart in the status.
func TestRemoteLoadIsWeighedLikeOwn(t *testing.T) {
	for _, policy := range []string{"kv", "least_load", "kv_dynamo", "cache_aware", "prefix_hash"} {
		r := newTestRouter(t, policy, 2, nil)
		req := &Request{Hashes: seq(20, 5), PromptTokens: 320}
		for i := 0; i < 2; i++ {
			d, _ := r.Select(req)
			busy := d.Worker // the one it would pick, busy elsewhere now
			r.SetRemoteLoad(busy, Load{Inflight: 40, Pending: 8, PrefillTokens: 60000, ActiveBlocks: 4000})
			r.SetRemoteLoad(1-busy, Load{})
			if d2, _ := r.Select(req); d2.Worker == busy {
				t.Fatalf("%s: chose worker %d, which other replicas keep busy", policy, busy)
			}
			st := r.Workers()[busy]
			if st.Remote.Inflight != 40 || st.Inflight != 0 {
				t.Fatalf("%s: status %+v", policy, st)
			}
			r.SetRemoteLoad(busy, Load{}) // the replicas' load ended
		}
	}
}
