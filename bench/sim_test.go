package bench

import (
	"bytes"
	"image/png"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

// smallChat is a multi-turn workload small enough for unit tests but with
// real prefix reuse (shared system prompts, growing conversations).
func smallChat() *Workload {
	c := DefaultMultiTurn()
	c.Conversations = 40
	c.SystemPrompts = 3
	c.SystemLen = 600
	c.UserLen = 120
	c.OutputLen = 40
	c.Rate = 4
	c.Think = 3 * time.Second
	return GenerateMultiTurn(c)
}

func smallFleet() SimConfig {
	return SimConfig{Engines: 4, CacheBlocks: 2000, BlockSize: 16, Seed: 3}
}

func TestSimSameSeedSameNumbers(t *testing.T) {
	w := smallChat()
	pols := []string{"kv", "round_robin", "cache_aware"}
	a, err := SimulateAll(w, smallFleet(), pols)
	if err != nil {
		t.Fatal(err)
	}
	b, err := SimulateAll(w, smallFleet(), pols)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("two runs with the same seed differ:\n%+v\n%+v", a, b)
	}
	for _, r := range a {
		if r.Errors != 0 || len(r.TTFTs) != len(w.Requests) {
			t.Fatalf("%s: %d errors, %d of %d requests finished", r.Policy, r.Errors, len(r.TTFTs), len(w.Requests))
		}
		if r.TTFTP50 <= 0 || r.ITLP50 <= 0 || r.E2EP50 < r.TTFTP50 || r.ThroughputTokS <= 0 {
			t.Fatalf("%s: implausible result %+v", r.Policy, r)
		}
	}
}

func TestSimKVPolicyFindsPrefixes(t *testing.T) {
	w := smallChat()
	ceiling := CeilingHitRate(w, Synth{Seed: 3}, 16, 4*2000, 2000)
	res, err := SimulateAll(w, smallFleet(), []string{"kv", "round_robin"})
	if err != nil {
		t.Fatal(err)
	}
	kv, rr := res[0], res[1]
	t.Logf("ceiling %.3f kv %.3f round_robin %.3f", ceiling, kv.HitRate, rr.HitRate)
	if kv.HitRate <= rr.HitRate {
		t.Fatalf("kv hit rate %.3f not above round_robin's %.3f on a reuse-heavy workload", kv.HitRate, rr.HitRate)
	}
	if rr.ForgoneHitRate <= kv.ForgoneHitRate {
		t.Fatalf("round_robin forgoes %.3f of the prompt, kv %.3f: kv should forgo less", rr.ForgoneHitRate, kv.ForgoneHitRate)
	}
	if float64(kv.HitRate) > ceiling+1e-9 {
		t.Fatalf("kv hit rate %.3f above the one-cache ceiling %.3f", kv.HitRate, ceiling)
	}
}

func TestSimApproximateModeAndHetero(t *testing.T) {
	w := smallChat()
	cfg := smallFleet()
	cfg.Approximate = true
	cfg.Speed = HeteroSpeeds(cfg.Engines, 0.5)
	cfg.Scrape = 500 * time.Millisecond
	if cfg.Speed[0] != 1 || cfg.Speed[3] != 0.5 {
		t.Fatalf("speeds %v", cfg.Speed)
	}
	res, err := SimulateAll(w, cfg, []string{"kv", PolicyKVFixed})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res {
		if r.Errors != 0 || len(r.TTFTs) != len(w.Requests) || r.HitRate <= 0 {
			t.Fatalf("%s: %+v", r.Policy, r)
		}
	}
}

// An index TTL shorter than the think time forgets every conversation
// between its turns: approximate-mode kv then spreads them and finds fewer
// of their prefixes in the engines' caches.
func TestSimIndexTTL(t *testing.T) {
	w := smallChat()
	hit := map[time.Duration]float64{}
	for _, ttl := range []time.Duration{time.Second, time.Hour} {
		cfg := smallFleet()
		cfg.Approximate = true
		cfg.IndexTTL = ttl
		r, err := Simulate(w, cfg, "kv")
		if err != nil {
			t.Fatal(err)
		}
		hit[ttl] = float64(r.HitRate)
	}
	t.Logf("hit rate: TTL 1s %.3f, 1h %.3f", hit[time.Second], hit[time.Hour])
	if hit[time.Second] >= hit[time.Hour] {
		t.Fatalf("hit rate with a 1 s index TTL %.3f, not below the 1 h TTL's %.3f", hit[time.Second], hit[time.Hour])
	}
}

func TestSimSlowerFleetIsSlower(t *testing.T) {
	w := smallChat()
	fast, err := Simulate(w, smallFleet(), "round_robin")
	if err != nil {
		t.Fatal(err)
	}
	cfg := smallFleet()
	cfg.Speed = []float64{0.5, 0.5, 0.5, 0.5}
	slow, err := Simulate(w, cfg, "round_robin")
	if err != nil {
		t.Fatal(err)
	}
	if slow.ITLP50 < 1.9*fast.ITLP50 || slow.TTFTP50 <= fast.TTFTP50 {
		t.Fatalf("half-speed engines: itl %.2f vs %.2f ms, ttft %.1f vs %.1f ms", slow.ITLP50, fast.ITLP50, slow.TTFTP50, fast.TTFTP50)
	}
}

func TestSimUnknownPolicy(t *testing.T) {
	if _, err := Simulate(smallChat(), smallFleet(), "no_such_policy"); err == nil {
		t.Fatal("unknown policy accepted")
	}
}

func TestWriteCharts(t *testing.T) {
	res, err := SimulateAll(smallChat(), smallFleet(), []string{"kv", "least_load"})
	if err != nil {
		t.Fatal(err)
	}
	c := 0.5
	dir := t.TempDir()
	if err := WriteCharts(dir, "small", &Report{Results: res, CeilingHitRate: &c}); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"small-ttft-cdf.png", "small-hit-rate.png"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		img, err := png.Decode(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if img.Bounds().Dx() != chartW {
			t.Fatalf("%s: width %d", f, img.Bounds().Dx())
		}
	}
}

func BenchmarkSynthTokens(b *testing.B) {
	r := Request{Segments: []Segment{{Key: 1, Len: 512}, {Key: 2, Len: 512}}, InputLen: 1024}
	buf := make([]uint32, 0, 1024)
	b.ReportAllocs()
	b.SetBytes(1024 * 4)
	for b.Loop() {
		buf = Synth{Seed: 1}.Tokens(buf[:0], &r)
	}
}

// BenchmarkSimulate reports simulated requests per second of wall time.
func BenchmarkSimulate(b *testing.B) {
	w := smallChat()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Simulate(w, smallFleet(), "kv"); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(w.Requests)*b.N)/b.Elapsed().Seconds(), "req/s")
}

// A small device cache with a host tier: blocks move down and back, and the
// events of both tiers keep the router's index consistent.
func TestSimHostTier(t *testing.T) {
	w := smallChat()
	cfg := smallFleet()
	cfg.CacheBlocks = 300
	base, err := Simulate(w, cfg, "kv")
	if err != nil {
		t.Fatal(err)
	}
	cfg.HostCacheBlocks = 4000
	host, err := Simulate(w, cfg, "kv")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("hit rate device only %.3f, with host tier %.3f", base.HitRate, host.HitRate)
	if host.Errors != 0 || host.HitRate <= base.HitRate {
		t.Fatalf("host tier should add hits: %.3f vs %.3f (errors %d)", host.HitRate, base.HitRate, host.Errors)
	}
}

// TestSimKVKeepsConversationsUnderOverload: with queues on every engine, a
// cache miss costs the requests behind it as well as its own requester; kv
// prices that (router's externality term) and keeps conversations on their
// caches instead of spreading them, which would add prefill work and feed
// the overload. Without the term kv's hit rate fell to 0.76 here against
// cache_aware's 0.80, with p90 TTFT 1.7 s against 1.3 s (with it: 0.84,
// 0.4 s).
func TestSimKVKeepsConversationsUnderOverload(t *testing.T) {
	c := DefaultMultiTurn()
	c.Seed = 3
	c.Conversations = 200
	c.SystemPrompts = 3
	c.SystemLen = 600
	c.UserLen = 120
	c.OutputLen = 40
	c.Rate = 4
	c.Think = 3 * time.Second
	w := GenerateMultiTurn(c).Scale(8) // arrivals 8× faster: engines overloaded
	cfg := smallFleet()
	cfg.Scrape = time.Second
	res, err := SimulateAll(w, cfg, []string{"kv", "cache_aware"})
	if err != nil {
		t.Fatal(err)
	}
	kv, ca := res[0], res[1]
	t.Logf("kv p90 %.0f ms hit %.3f; cache_aware p90 %.0f ms hit %.3f", kv.TTFTP90, kv.HitRate, ca.TTFTP90, ca.HitRate)
	if kv.HitRate < ca.HitRate || kv.TTFTP90 > ca.TTFTP90 {
		t.Fatalf("under overload kv hit %.3f, p90 %.0f ms; cache_aware hit %.3f, p90 %.0f ms: kv should keep conversations together",
			kv.HitRate, kv.TTFTP90, ca.HitRate, ca.TTFTP90)
	}
}

// TestSimKVSpreadsAPopularSystemPrompt: at light load, conversations that
// all begin with one system prompt. Each new conversation saves the
// prompt's prefill on an engine that holds it, so kv pricing TTFT alone kept
// them on the first engines to hold it while the rest idled, and lost to
// kv_dynamo, which spreads; priced as under-replicated, the prompt is copied
// to every engine once and kv leads.
func TestSimKVSpreadsAPopularSystemPrompt(t *testing.T) {
	c := DefaultMultiTurn()
	c.Seed = 3
	c.Conversations = 1000
	c.SystemPrompts = 1
	c.Rate = 0.5
	c.Think = 10 * time.Second
	engines := map[string]map[string]int{"kv": {}, "kv_dynamo": {}}
	var mu sync.Mutex
	cfg := SimConfig{Engines: 8, CacheBlocks: 30000, BlockSize: 16, Seed: 3,
		OnRequest: func(p string, r RequestRecord) { mu.Lock(); engines[p][r.Worker]++; mu.Unlock() }}
	res, err := SimulateAll(GenerateMultiTurn(c), cfg, []string{"kv", "kv_dynamo"})
	if err != nil {
		t.Fatal(err)
	}
	kv, dyn := res[0], res[1]
	t.Logf("kv p50 %.1f ms, hit %.3f, engines %v; kv_dynamo p50 %.1f ms, hit %.3f", kv.TTFTP50, kv.HitRate, engines["kv"], dyn.TTFTP50, dyn.HitRate)
	if len(engines["kv"]) < 8 || kv.TTFTP50 > dyn.TTFTP50 || kv.HitRate < dyn.HitRate {
		t.Fatalf("kv ran on %d of 8 engines, p50 %.1f ms, hit %.3f; kv_dynamo p50 %.1f ms, hit %.3f: kv should spread the one system prompt and lead",
			len(engines["kv"]), kv.TTFTP50, kv.HitRate, dyn.TTFTP50, dyn.HitRate)
	}
}

// TestSimReplicasShareLoad: two replicas taking requests in turn, each
// with a router of its own. Exchanging their load (ShareLoad) they spread
// a paced run of long requests over every engine as one router would;
// without it each counts only its own, and the run ends with every
// replica's counters at zero either way.
func TestSimReplicasShareLoad(t *testing.T) {
	w := &Workload{Name: "paced"}
	for i := 0; i < 4; i++ {
		w.Requests = append(w.Requests, Request{Arrival: time.Duration(i) * 50 * time.Millisecond,
			Segments: []Segment{{Key: uint64(100 + i), Len: 2048}}, InputLen: 2048, OutputLen: 400, Session: -1})
	}
	engines := func(share time.Duration) map[string]int {
		seen := map[string]int{}
		var mu sync.Mutex
		cfg := SimConfig{Engines: 4, CacheBlocks: 4000, Replicas: 2, ShareLoad: share,
			OnRequest: func(_ string, r RequestRecord) { mu.Lock(); seen[r.Worker]++; mu.Unlock() }}
		if _, err := Simulate(w, cfg, "least_load"); err != nil {
			t.Fatal(err)
		}
		return seen
	}
	if got := engines(10 * time.Millisecond); len(got) != 4 {
		t.Fatalf("sharing load, 4 long requests 50 ms apart used %d engines (%v), want 4", len(got), got)
	}
	t.Logf("without sharing: %v", engines(0))
}

// A prompt no engine can hold fails at once: the simulator does not build
// its tokens (16M of them here, 64 MB) to find that out.
func TestSimRefusesAPromptNoEngineHoldsWithoutBuildingIt(t *testing.T) {
	w := &Workload{Name: "huge", Requests: []Request{
		{InputLen: MaxTraceTokens, OutputLen: 1, Segments: []Segment{{Key: keyUnique, Len: MaxTraceTokens}}, Session: -1},
		{Arrival: time.Second, InputLen: 100, OutputLen: 2, Segments: []Segment{{Key: keyUnique | 1, Len: 100}}, Session: -1},
	}}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	res, err := Simulate(w, smallFleet(), "round_robin")
	runtime.ReadMemStats(&after)
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 1 || len(res.TTFTs) != 1 {
		t.Fatalf("want the huge request failed and the other served: %+v", res)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 16<<20 {
		t.Fatalf("allocated %d MB for a request that cannot fit", alloc>>20)
	}
}

// Disaggregated prefill in the simulator: every prompt is computed on a
// prefill engine and decoded on another, which pulls it; the hit rate is
// the prefill engines' (the decode engine's pulled blocks are not hits),
// and conversations still find their earlier turns there.
func TestSimDisaggregatedPrefill(t *testing.T) {
	c := DefaultMultiTurn()
	c.Seed = 5
	c.Conversations = 60
	c.OutputLen = 20
	w := GenerateMultiTurn(c)
	cfg := smallFleet()
	cfg.Engines, cfg.PrefillEngines = 4, 2
	workers := map[string]int{}
	cached := 0
	cfg.OnRequest = func(_ string, r RequestRecord) {
		if r.Err != "" {
			t.Errorf("request %d failed: %s", r.Index, r.Err)
		}
		workers[r.Worker]++
		cached += r.Cached
	}
	res, err := Simulate(w, cfg, "kv")
	if err != nil {
		t.Fatal(err)
	}
	if workers["engine-0"]+workers["engine-1"] > 0 || workers["engine-2"] == 0 || workers["engine-3"] == 0 {
		t.Fatalf("decoded on %v: want only the two decode engines", workers)
	}
	if res.HitRate <= 0.3 || res.HitRate >= 0.99 || cached == 0 {
		t.Fatalf("hit rate %.3f: want the prefill engines' prefix hits, not the pulled prompts", res.HitRate)
	}
}

// The hop from the router to the engine (SimConfig.HopPerToken and
// HopJitter): each request reaches its engine that long after it was
// routed, its TTFT counts it, and requests routed together can reach an
// engine in another order than they were routed, as they do live.
func TestSimHopDelaysAndReordersRequests(t *testing.T) {
	w := &Workload{Name: "pair", Requests: []Request{
		{InputLen: 8000, OutputLen: 2, Segments: []Segment{{Key: keyUnique, Len: 8000}}, Session: -1},
		{InputLen: 100, OutputLen: 2, Segments: []Segment{{Key: keyUnique | 1, Len: 100}}, Session: -1},
	}}
	run := func(perToken, jitter time.Duration, seed uint64) (big, small time.Duration) {
		t.Helper()
		cfg := smallFleet()
		cfg.Pin = []int{0, 0} // both on one engine, routed in file order
		cfg.HopPerToken, cfg.HopJitter, cfg.Seed = perToken, jitter, seed
		ttft := map[int]time.Duration{}
		cfg.OnRequest = func(_ string, r RequestRecord) {
			if r.Err != "" {
				t.Fatalf("request %d failed: %s", r.Index, r.Err)
			}
			ttft[r.Index] = r.TTFT
		}
		if _, err := Simulate(w, cfg, "round_robin"); err != nil {
			t.Fatal(err)
		}
		return ttft[0], ttft[1]
	}
	big0, small0 := run(0, 0, 3)
	if small0 <= big0/2 {
		t.Fatalf("no hop: the small request (TTFT %v) should wait behind the big one routed before it (%v)", small0, big0)
	}
	// 1 µs a token: the small request is at the engine after 0.1 ms, the
	// big one after 8 ms, so the small one goes first and the big one's
	// TTFT counts its 8 ms on the way.
	_, small1 := run(time.Microsecond, 0, 3)
	if small1 >= small0/2 {
		t.Fatalf("with the hop the small request should overtake the big one: TTFT %v, %v without the hop", small1, small0)
	}
	// A jitter far above the per-token part: over seeds, either request
	// reaches the engine first; the same seed gives the same run.
	overtaken := 0
	for seed := uint64(1); seed <= 20; seed++ {
		b, s := run(time.Nanosecond, 50*time.Millisecond, seed)
		if b2, s2 := run(time.Nanosecond, 50*time.Millisecond, seed); b2 != b || s2 != s {
			t.Fatalf("seed %d: two runs differ: %v %v, then %v %v", seed, b, s, b2, s2)
		}
		if s < b/2 {
			overtaken++
		}
	}
	if overtaken == 0 || overtaken == 20 {
		t.Fatalf("the small request went first in %d of 20 seeds: the jitter should reorder them in some", overtaken)
	}
}

// A request's TTFT counts its hop exactly, twice with a prefill stage
// (kvproxy sends it to the decode engine once the prefill is done).
func TestSimHopCountsInTTFT(t *testing.T) {
	w := &Workload{Name: "one", Requests: []Request{
		{Arrival: time.Second, InputLen: 3000, OutputLen: 3, Segments: []Segment{{Key: keyUnique, Len: 3000}}, Session: -1},
	}}
	for _, prefill := range []int{0, 2} {
		ttft := func(perToken time.Duration) time.Duration {
			t.Helper()
			cfg := smallFleet()
			cfg.PrefillEngines, cfg.HopPerToken = prefill, perToken
			cfg.Scrape = 7 * time.Millisecond // scrapes fall inside the hop and must not delay it
			res, err := Simulate(w, cfg, "kv")
			if err != nil || len(res.TTFTs) != 1 {
				t.Fatalf("prefill engines %d: %v, %+v", prefill, err, res)
			}
			return res.TTFTs[0]
		}
		base, hopped := ttft(0), ttft(10*time.Microsecond)
		want := 30 * time.Millisecond // 3,000 tokens at 10 µs
		if prefill > 0 {
			want *= 2
		}
		if d := hopped - base; d < want-time.Microsecond || d > want+time.Microsecond {
			t.Errorf("prefill engines %d: TTFT %v with the hop, %v without: %v more, want %v", prefill, hopped, base, d, want)
		}
	}
}

// Under load, with load scrapes between the hops: no request's first token
// comes before its hop is over, and every request is served.
func TestSimHopUnderLoadWithScrapes(t *testing.T) {
	w := smallChat()
	cfg := smallFleet()
	cfg.HopPerToken, cfg.Scrape = 20*time.Microsecond, 7*time.Millisecond
	served := 0
	cfg.OnRequest = func(_ string, r RequestRecord) {
		if r.Err != "" {
			t.Errorf("request %d failed: %s", r.Index, r.Err)
			return
		}
		served++
		if hop := time.Duration(r.Prompt) * cfg.HopPerToken; r.TTFT < hop {
			t.Errorf("request %d: TTFT %v shorter than its hop %v", r.Index, r.TTFT, hop)
		}
	}
	if _, err := Simulate(w, cfg, "kv"); err != nil {
		t.Fatal(err)
	}
	if served != len(w.Requests) {
		t.Fatalf("%d of %d requests served", served, len(w.Requests))
	}
}

// Engines that keep and announce every copy of a block, as vLLM's block
// pool does: each copy is stored and, on eviction, removed on its own. The
// index keeps one entry per block, so it may under-report (one copy's
// removal drops a block another still holds) but never claims a block no
// engine holds, whatever order the copies come and go in.
func TestSimIndexNeverOverReportsEnginesThatKeepCopies(t *testing.T) {
	w := &Workload{Name: "copies"}
	for i := 0; i < 400; i++ {
		key := uint64(i / 4 % 40) // four at once of each prompt, each prompt again later
		w.Requests = append(w.Requests, Request{Arrival: time.Duration(i/4) * 150 * time.Millisecond,
			Segments: []Segment{{Key: key, Len: 512}}, InputLen: 512, OutputLen: 20 + i%30, Session: -1})
	}
	cfg := SimConfig{Engines: 3, CacheBlocks: 300, BlockSize: 16, Seed: 5, Replicas: 2, DuplicateBlocks: true}
	s, err := newSim(cfg.withDefaults(), "kv")
	if err != nil {
		t.Fatal(err)
	}
	s.run(w)
	var copies uint64
	for _, e := range s.engines {
		copies += e.model.Counters().Copies
		held := map[kv.BlockHash]bool{}
		for _, b := range e.model.AppendResident(nil) {
			held[b.Hash] = true
		}
		for r, rt := range s.rts {
			indexed := 0
			for h := range held {
				if slices.ContainsFunc(rt.Index().Match([]kv.BlockHash{h}, nil), func(o router.Overlap) bool { return o.Worker == e.id }) {
					indexed++
				}
			}
			if n := rt.Index().WorkerBlocks(e.id); n != indexed {
				t.Fatalf("%s, replica %d: the index holds %d blocks, %d of them held by the engine", e.name, r, n, indexed)
			}
			t.Logf("%s, replica %d: %d of the engine's %d blocks indexed", e.name, r, indexed, len(held))
		}
	}
	if copies == 0 {
		t.Fatal("the engines made no copies: the workload does not test them")
	}
}
