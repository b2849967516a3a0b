package router

import (
	"errors"
	"fmt"
	"math/rand"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

func newTestRouter(t testing.TB, policy string, workers int, mod func(*Config)) *Router {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Policy = policy
	if mod != nil {
		mod(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < workers; i++ {
		if id := r.AddWorker(fmt.Sprintf("w%d", i)); id != WorkerID(i) {
			t.Fatalf("worker %d got id %d", i, id)
		}
	}
	return r
}

func req(h []kv.BlockHash) *Request {
	return &Request{Hashes: h, PromptTokens: len(h)*16 + 5}
}

func mustRoute(t testing.TB, r *Router, q *Request) (Decision, *Active) {
	t.Helper()
	d, a, err := r.Route(q)
	if err != nil {
		t.Fatal(err)
	}
	return d, a
}

func TestNewValidates(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Policy = "fastest"
	_, err := New(cfg)
	if err == nil || !strings.Contains(err.Error(), `"fastest"`) {
		t.Fatalf("err = %v, want it to name the policy", err)
	}
	cfg = DefaultConfig()
	cfg.PrefixHash.LoadBound = 0.5
	cfg.Policy = "prefix_hash"
	if _, err := New(cfg); err == nil {
		t.Fatal("load bound 0.5 accepted")
	}
	cfg = DefaultConfig()
	cfg.Cost.QueueMsPerToken = -1
	if _, err := New(cfg); err == nil {
		t.Fatal("negative coefficient accepted")
	}
	for _, p := range strings.Split(PolicyNames(), ", ") {
		cfg := DefaultConfig()
		cfg.Policy = p
		if _, err := New(cfg); err != nil {
			t.Fatalf("policy %s: %v", p, err)
		}
	}
}

func TestWorkerIdentity(t *testing.T) {
	r := newTestRouter(t, "kv", 3, nil)
	if id := r.AddWorker("w1"); id != 1 {
		t.Fatalf("AddWorker not idempotent: %d", id)
	}
	id, ok := r.WorkerByName("w2")
	if !ok || id != 2 {
		t.Fatalf("WorkerByName = %d %v", id, ok)
	}
	if id, ok := r.WorkerByInstance(InstanceID("w2")); !ok || id != 2 {
		t.Fatalf("WorkerByInstance = %d %v", id, ok)
	}
	if InstanceID("w2") != InstanceID("w2") || InstanceID("w1") == InstanceID("w2") || InstanceID("w1") >= 1<<53 {
		t.Fatal("InstanceID not stable, distinct and JSON-safe")
	}
	r.RemoveWorker(1)
	if st := r.Workers()[1]; !st.Removed || st.Available {
		t.Fatalf("removed worker status %+v", st)
	}
	if id := r.AddWorker("w1"); id != 1 || !r.Workers()[1].Available {
		t.Fatal("re-added worker did not come back under its id")
	}
}

func TestKVPrefersPrefixUntilLoadOutweighs(t *testing.T) {
	r := newTestRouter(t, "kv", 4, nil)
	conv := seq(256, 1) // a 4k-token conversation
	d, a := mustRoute(t, r, req(conv[:128]))
	a.Free()
	home := d.Worker
	// The next turns keep landing on the worker holding the prefix.
	for turn := 0; turn < 5; turn++ {
		d, a := mustRoute(t, r, req(conv[:160+turn*16]))
		a.Free()
		if d.Worker != home {
			t.Fatalf("turn %d went to %d, want home %d", turn, d.Worker, home)
		}
		if d.Overlap < 128 {
			t.Fatalf("turn %d overlap %d, want >= 128", turn, d.Overlap)
		}
	}
	// Unrelated long prompts pile prefill onto the home worker until the
	// queue there costs more than recomputing the prefix elsewhere.
	var actives []*Active
	moved := false
	for i := 0; i < 50 && !moved; i++ {
		d, a := mustRoute(t, r, &Request{Pinned: true, Pin: home, Hashes: seq(512, uint64(100+i)), PromptTokens: 8192})
		actives = append(actives, a)
		_ = d
		d2, err := r.Select(req(conv))
		if err != nil {
			t.Fatal(err)
		}
		moved = d2.Worker != home
	}
	if !moved {
		t.Fatal("kv never left an overloaded home worker")
	}
	for _, a := range actives {
		a.Free()
	}
}

func TestSelectIsDryRun(t *testing.T) {
	for _, p := range strings.Split(PolicyNames(), ", ") {
		t.Run(p, func(t *testing.T) {
			r := newTestRouter(t, p, 8, nil)
			rng := rand.New(rand.NewSource(1))
			for i := 0; i < 200; i++ {
				q := req(seq(1+rng.Intn(40), uint64(rng.Intn(10))))
				before := r.Workers()
				d1, err := r.Select(q)
				if err != nil {
					t.Fatal(err)
				}
				if after := r.Workers(); fmt.Sprint(before) != fmt.Sprint(after) {
					t.Fatal("Select changed worker state")
				}
				d2, a := mustRoute(t, r, q)
				if d1.Worker != d2.Worker {
					t.Fatalf("request %d: dry run chose %d, route chose %d", i, d1.Worker, d2.Worker)
				}
				if rng.Intn(3) > 0 {
					a.Free()
				}
			}
		})
	}
}

func TestTiesSpreadDeterministically(t *testing.T) {
	r := newTestRouter(t, "kv", 4, nil)
	seen := map[WorkerID]bool{}
	for i := 0; i < 40; i++ {
		q := req(seq(8, uint64(1000+i)))
		d, a := mustRoute(t, r, q)
		seen[d.Worker] = true
		a.Free()
	}
	if len(seen) != 4 {
		t.Fatalf("exact ties went to %d workers, want all 4", len(seen))
	}
}

func TestTemperatureSamples(t *testing.T) {
	r := newTestRouter(t, "kv", 4, func(c *Config) { c.Temperature = 5 })
	mustRoute(t, r, req(seq(64, 1)))
	seen := map[WorkerID]int{}
	for i := 0; i < 200; i++ {
		d, a := mustRoute(t, r, req(seq(64, 1)))
		seen[d.Worker]++
		a.Free()
	}
	if len(seen) < 2 {
		t.Fatalf("temperature 5 never left the best worker: %v", seen)
	}
}

func TestPinning(t *testing.T) {
	r := newTestRouter(t, "round_robin", 3, nil)
	d, a := mustRoute(t, r, &Request{Hashes: seq(4, 1), PromptTokens: 64, Pinned: true, Pin: 2})
	if d.Worker != 2 || d.Name != "w2" || d.InstanceID != InstanceID("w2") {
		t.Fatalf("pinned decision %+v", d)
	}
	if st := r.Workers()[2]; st.Inflight != 1 || st.ActiveBlocks != 4 {
		t.Fatalf("pinned request did not register load: %+v", st)
	}
	a.Free()
	r.SetAvailable(1, false)
	if _, _, err := r.Route(&Request{Pinned: true, Pin: 1}); !errors.Is(err, ErrWorkerUnavailable) {
		t.Fatalf("pin to unavailable: %v", err)
	}
	if _, err := r.Select(&Request{Pinned: true, Pin: 7}); !errors.Is(err, ErrWorkerUnavailable) {
		t.Fatalf("pin to unknown: %v", err)
	}
}

func TestUnavailableWorkersSkipped(t *testing.T) {
	for _, p := range strings.Split(PolicyNames(), ", ") {
		r := newTestRouter(t, p, 3, nil)
		r.SetAvailable(0, false)
		r.SetAvailable(2, false)
		for i := 0; i < 20; i++ {
			d, a := mustRoute(t, r, req(seq(4, uint64(i))))
			if d.Worker != 1 || len(d.Candidates) != 1 {
				t.Fatalf("%s: chose %d among %d candidates", p, d.Worker, len(d.Candidates))
			}
			a.Free()
		}
		r.SetAvailable(1, false)
		if _, err := r.Select(req(seq(4, 1))); !errors.Is(err, ErrNoWorker) {
			t.Fatalf("%s: no worker: %v", p, err)
		}
	}
}

func TestRoundRobinCycles(t *testing.T) {
	r := newTestRouter(t, "round_robin", 3, nil)
	var got []WorkerID
	for i := 0; i < 7; i++ {
		d, _ := mustRoute(t, r, req(seq(2, 1)))
		got = append(got, d.Worker)
	}
	if fmt.Sprint(got) != "[0 1 2 0 1 2 0]" {
		t.Fatalf("round robin order %v", got)
	}
	r.SetAvailable(1, false)
	d, _ := mustRoute(t, r, req(nil))
	d2, _ := mustRoute(t, r, req(nil))
	if d.Worker != 2 || d2.Worker != 0 {
		t.Fatalf("skipping unavailable: %d %d", d.Worker, d2.Worker)
	}
}

// Requests that leave out different workers (the two stages of
// disaggregated prefill) each cycle through their own: one shared cursor
// sent every prefill to worker 0 and every decode to worker 2.
func TestRoundRobinCyclesWithinEachSubset(t *testing.T) {
	r := newTestRouter(t, "round_robin", 4, nil)
	var pre, dec []WorkerID
	for i := 0; i < 4; i++ {
		d, _ := mustRoute(t, r, &Request{Avoid: []WorkerID{2, 3}, PromptTokens: 16})
		pre = append(pre, d.Worker)
		d, _ = mustRoute(t, r, &Request{Avoid: []WorkerID{0, 1}, PromptTokens: 16})
		dec = append(dec, d.Worker)
	}
	if fmt.Sprint(pre, dec) != "[0 1 0 1] [2 3 2 3]" {
		t.Fatalf("prefill stage %v, decode stage %v", pre, dec)
	}
}

func TestLeastLoadPicksLeast(t *testing.T) {
	r := newTestRouter(t, "least_load", 3, nil)
	mustRoute(t, r, &Request{Pinned: true, Pin: 0, PromptTokens: 16})
	mustRoute(t, r, &Request{Pinned: true, Pin: 1, PromptTokens: 16})
	mustRoute(t, r, &Request{Pinned: true, Pin: 1, PromptTokens: 16})
	if d, _ := r.Select(req(seq(4, 1))); d.Worker != 2 {
		t.Fatalf("least_load chose %d, want idle 2", d.Worker)
	}
	_, a := mustRoute(t, r, &Request{Pinned: true, Pin: 2, Hashes: seq(10, 3), PromptTokens: 160})
	if d, _ := r.Select(req(seq(4, 1))); d.Worker != 0 {
		t.Fatalf("equal inflight: chose %d, want 0 (fewer active blocks)", d.Worker)
	}
	a.Free()
}

func TestKVDynamoLogit(t *testing.T) {
	r := newTestRouter(t, "kv_dynamo", 2, nil)
	h := seq(100, 1)
	_, a := mustRoute(t, r, &Request{Pinned: true, Pin: 0, Hashes: h[:80], PromptTokens: 80 * 16})
	// While w0 is still prefilling its 80 blocks, the logits are
	// w0: prefill 21 new + 80 in flight, decode 80 active + 21 new = 202.3;
	// w1: prefill 101, decode 101 = 202.6 (the partial block counts 5/16).
	a.PrefillDone()
	// Now w0: 21 + 0 + 80 + 21 = 122.6 against w1's 202.6.
	d, _ := r.Select(req(h))
	if d.Worker != 0 {
		t.Fatalf("kv_dynamo chose %d, want 0 holding 80 of 100 blocks; candidates %+v", d.Worker, d.Candidates)
	}
	if c := d.Candidates; c[0].Score >= c[1].Score-79 {
		t.Fatalf("scores %v %v, want a gap of 80", c[0].Score, c[1].Score)
	}
}

func TestPrefixHashStickyAndBounded(t *testing.T) {
	r := newTestRouter(t, "prefix_hash", 4, nil)
	home := map[int]WorkerID{}
	for i := 0; i < 40; i++ {
		d, a := mustRoute(t, r, req(seq(6, uint64(i))))
		home[i] = d.Worker
		a.Free()
	}
	for i := 0; i < 40; i++ { // sticky, also for longer prompts sharing the first 4 blocks
		q := req(append(seq(6, uint64(i))[:4], seq(20, 999)...))
		d, a := mustRoute(t, r, q)
		if d.Worker != home[i] {
			t.Fatalf("prompt %d moved from %d to %d", i, home[i], d.Worker)
		}
		a.Free()
	}
	// One hot prefix: load spreads, but never beyond ceil(1.25 × mean).
	var actives []*Active
	for i := 0; i < 40; i++ {
		_, a := mustRoute(t, r, req(seq(6, 7)))
		actives = append(actives, a)
		total, maxIn := int64(0), int64(0)
		for _, st := range r.Workers() {
			total += st.Inflight
			maxIn = max(maxIn, st.Inflight)
		}
		if limit := (total*5 + 15) / 16; maxIn > limit+1 {
			t.Fatalf("after %d: max inflight %d over bound for total %d", i, maxIn, total)
		}
	}
	busy := 0
	for _, st := range r.Workers() {
		if st.Inflight >= 10 {
			busy++
		}
	}
	if busy < 3 {
		t.Fatalf("hot prefix not spread: %+v", r.Workers())
	}
	for _, a := range actives {
		a.Free()
	}
}

func TestCacheAware(t *testing.T) {
	r := newTestRouter(t, "cache_aware", 3, nil)
	h := seq(20, 1)
	d, _ := mustRoute(t, r, req(h))
	first := d.Worker
	if d2, _ := r.Select(req(h[:18])); d2.Worker != first {
		t.Fatalf("match > threshold went to %d, want %d", d2.Worker, first)
	}
	// Low match: smallest tree, so not first.
	if d3, _ := r.Select(req(append(h[:5:5], seq(15, 2)...))); d3.Worker == first {
		t.Fatal("low match went to the biggest tree")
	}
	// Imbalance: 40 in flight on first → least loaded even for a full match.
	for i := 0; i < 40; i++ {
		mustRoute(t, r, &Request{Pinned: true, Pin: first, PromptTokens: 1})
	}
	if d4, _ := r.Select(req(h)); d4.Worker == first {
		t.Fatal("imbalanced fleet still went to the loaded worker")
	}
}

func TestApproximateEntriesExpire(t *testing.T) {
	c := newFakeClock()
	r := newTestRouter(t, "kv", 2, func(cfg *Config) { cfg.Now = c.Now; cfg.IndexTTL = 30 * time.Second })
	h := seq(32, 1)
	d, a := mustRoute(t, r, req(h))
	a.Free()
	if d2, _ := r.Select(req(h)); d2.Overlap != 32 || d2.Worker != d.Worker {
		t.Fatalf("overlap %d on %d, want 32 on %d", d2.Overlap, d2.Worker, d.Worker)
	}
	c.Advance(31 * time.Second)
	if d3, _ := r.Select(req(h)); d3.Overlap != 0 {
		t.Fatalf("overlap %d after TTL, want 0", d3.Overlap)
	}
}

func TestEventModeWorkersNotRecordedOnCommit(t *testing.T) {
	r := newTestRouter(t, "kv", 1, nil)
	r.SetApproximate(0, false)
	h := seq(8, 1)
	_, a := mustRoute(t, r, req(h))
	a.Free()
	if n := r.Index().Len(); n != 0 {
		t.Fatalf("event-mode commit stored %d entries", n)
	}
	r.Index().Store(0, h[:5], kv.TierHost, 0)
	d, _ := r.Select(req(h))
	if d.Overlap != 5 || d.Candidates[0].Tiers[kv.TierHost] != 5 {
		t.Fatalf("event entries: overlap %d tiers %v", d.Overlap, d.Candidates[0].Tiers)
	}
	// Host-tier blocks cost fetch time, less than recomputing them.
	miss, _ := r.Select(req(seq(8, 2)))
	fetch := r.Config().Cost.FetchMsPerBlock[kv.TierHost] * 5
	if got := miss.PredictedTTFTms - d.PredictedTTFTms; got <= 0 || got >= 5*16*r.Config().Cost.PrefillMsPerToken {
		t.Fatalf("host hit saves %.3f ms, want in (0, recompute) with fetch %.3f", got, fetch)
	}
}

func TestLoadCounters(t *testing.T) {
	r := newTestRouter(t, "kv", 1, nil)
	shared := seq(10, 1)
	q1 := &Request{Hashes: shared, PromptTokens: 10*16 + 3}
	q2 := &Request{Hashes: append(shared[:8:8], seq(4, 2)...), PromptTokens: 12 * 16}
	_, a1 := mustRoute(t, r, q1)
	_, a2 := mustRoute(t, r, q2)
	st := r.Workers()[0]
	// 10 shared-or-own blocks + partial of q1, + 4 new of q2 = 15 active.
	if st.Inflight != 2 || st.ActiveBlocks != 15 {
		t.Fatalf("after two routes: %+v", st)
	}
	// q1 fully uncached (163), q2 had 8 blocks cached → 64 uncached.
	if st.PrefillTokens != 163+64 {
		t.Fatalf("prefill tokens %d, want 227", st.PrefillTokens)
	}
	a1.PrefillDone()
	a1.PrefillDone()
	a1.OutputBlock()
	if st := r.Workers()[0]; st.PrefillTokens != 64 || st.ActiveBlocks != 16 {
		t.Fatalf("after prefill done + output block: %+v", st)
	}
	a1.Free()
	if st := r.Workers()[0]; st.ActiveBlocks != 12 || st.Inflight != 1 {
		t.Fatalf("after freeing q1: %+v (q2's 12 blocks remain)", st)
	}
	a1.Free()
	a1.OutputBlock()
	a2.Free()
	if !r.Idle() {
		t.Fatalf("not idle: %+v", r.Workers())
	}
}

func TestZeroCountersAfterConcurrentChaos(t *testing.T) {
	r := newTestRouter(t, "kv", 70, nil) // more than 64 workers
	var wg sync.WaitGroup
	actives := make(chan *Active, 4096)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(g)))
			for i := 0; i < 400; i++ {
				n := rng.Intn(64)
				q := &Request{Hashes: seq(n, uint64(rng.Intn(8))), PromptTokens: n*16 + rng.Intn(16)}
				if rng.Intn(5) == 0 {
					q.Pinned, q.Pin = true, WorkerID(rng.Intn(70))
				}
				d, a, err := r.Route(q)
				if err != nil {
					t.Error(err)
					return
				}
				_ = d
				if rng.Intn(2) == 0 {
					a.PrefillDone()
				}
				for k := rng.Intn(3); k > 0; k-- {
					a.OutputBlock()
				}
				actives <- a
			}
		}(g)
	}
	var fw sync.WaitGroup
	for g := 0; g < 4; g++ {
		fw.Add(1)
		go func() {
			defer fw.Done()
			for a := range actives {
				fw.Add(1)
				go func() { a.Free(); fw.Done() }() // a double Free racing the others
				a.OutputBlock()
				a.Free()
				a.PrefillDone()
			}
		}()
	}
	wg.Wait()
	close(actives)
	fw.Wait()
	if !r.Idle() {
		t.Fatalf("counters not zero: %+v", r.Workers())
	}
}

func TestRemoveWorkerDropsLoadAndEntries(t *testing.T) {
	r := newTestRouter(t, "kv", 2, nil)
	_, a := mustRoute(t, r, &Request{Pinned: true, Pin: 1, Hashes: seq(8, 1), PromptTokens: 128})
	r.RemoveWorker(1)
	if st := r.Workers()[1]; st.Inflight != 0 || st.ActiveBlocks != 0 || st.IndexedBlocks != 0 {
		t.Fatalf("removed worker keeps state %+v", st)
	}
	r.AddWorker("w1")
	_, b := mustRoute(t, r, &Request{Pinned: true, Pin: 1, Hashes: seq(8, 1), PromptTokens: 128})
	a.Free() // from before the removal: must not touch the new generation
	if st := r.Workers()[1]; st.Inflight != 1 || st.ActiveBlocks != 8 {
		t.Fatalf("stale Free changed the revived worker: %+v", st)
	}
	b.Free()
	if !r.Idle() {
		t.Fatal("not idle")
	}
}

func TestEngineLoadRaisesQueue(t *testing.T) {
	r := newTestRouter(t, "kv", 2, nil)
	q := req(seq(8, 1))
	r.SetEngineLoad(0, 20, 4, 0.7) // traffic the router did not send
	d, _ := r.Select(q)
	if d.Worker != 1 || d.Candidates[0].CostMs <= d.Candidates[1].CostMs {
		t.Fatalf("engine-reported queue ignored: %+v", d.Candidates)
	}
	if st := r.Workers()[0]; st.EngineWaiting != 20 || st.EngineRunning != 4 || st.EngineKVUsage != 0.7 {
		t.Fatalf("engine load not shown: %+v", st)
	}
}

func TestRouterHasNoTransportDeps(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Skipf("go list unavailable: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.Contains(dep, "fasthttp") || strings.Contains(dep, "zmq") || dep == "net/http" || dep == "net" {
			t.Fatalf("router depends on transport package %s", dep)
		}
	}
}

// TestAvoidedWorkersSkipped: a worker in Request.Avoid is never chosen, even
// holding the whole prefix, under every policy; with every worker avoided
// the answer is ErrNoWorker. A pin overrides Avoid.
func TestAvoidedWorkersSkipped(t *testing.T) {
	for _, p := range strings.Split(PolicyNames(), ", ") {
		r := newTestRouter(t, p, 3, nil)
		hashes := seq(8, 100)
		_, a := mustRoute(t, r, &Request{Hashes: hashes, PromptTokens: 128, Pinned: true, Pin: 1})
		a.Free()
		for i := 0; i < 20; i++ {
			d, a := mustRoute(t, r, &Request{Hashes: hashes, PromptTokens: 128, Avoid: []WorkerID{1}})
			if d.Worker == 1 || len(d.Candidates) != 2 {
				t.Fatalf("%s: chose %d among %d candidates, avoiding 1", p, d.Worker, len(d.Candidates))
			}
			a.Free()
		}
		if _, _, err := r.Route(&Request{Hashes: hashes, PromptTokens: 128, Avoid: []WorkerID{0, 1, 2}}); !errors.Is(err, ErrNoWorker) {
			t.Fatalf("%s: every worker avoided: %v", p, err)
		}
		if d, a := mustRoute(t, r, &Request{Hashes: hashes, PromptTokens: 128, Pinned: true, Pin: 1, Avoid: []WorkerID{1}}); d.Worker != 1 {
			t.Fatalf("%s: pinned to 1, chose %d", p, d.Worker)
		} else {
			a.Free()
		}
	}
}

// TestPrefixHashRingNotCachedFromAPartialSnapshot: the first request after
// a membership change avoids a worker; the ring cached for that version
// must still hold the worker, or every later request of its arc would move.
func TestPrefixHashRingNotCachedFromAPartialSnapshot(t *testing.T) {
	r := newTestRouter(t, "prefix_hash", 3, nil)
	owner := make(map[uint64]WorkerID)
	for i := uint64(0); i < 60; i++ {
		d, a := mustRoute(t, r, req(seq(4, i*10)))
		owner[i] = d.Worker
		a.Free()
	}
	r.SetAvailable(2, false) // a new version
	r.SetAvailable(2, true)  // and another, with the same members
	_, a := mustRoute(t, r, &Request{Hashes: seq(4, 5000), PromptTokens: 64, Avoid: []WorkerID{2}})
	a.Free()
	for i := uint64(0); i < 60; i++ {
		d, a := mustRoute(t, r, req(seq(4, i*10)))
		if d.Worker != owner[i] {
			t.Fatalf("request %d moved from %d to %d after a partial snapshot", i, owner[i], d.Worker)
		}
		a.Free()
	}
}

// Workers removed (backends a discovery or reloads took away) are never
// candidates, however many there were, and one added again by its name is
// one again.
func TestRemovedWorkersLeaveTheDecisions(t *testing.T) {
	r, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 500; i++ {
		r.RemoveWorker(r.AddWorker(fmt.Sprintf("gone-%d", i)))
	}
	a, b := r.AddWorker("a"), r.AddWorker("b")
	back := r.AddWorker("gone-7") // added again
	r.RemoveWorker(a)
	d, err := r.Select(&Request{PromptTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range d.Candidates {
		names = append(names, c.Name)
	}
	if len(d.Candidates) != 2 || d.Candidates[0].Worker != back || d.Candidates[1].Worker != b {
		t.Fatalf("candidates %v, want gone-7 and b", names)
	}
	if n := len(*r.live.Load()); n != 2 {
		t.Fatalf("%d workers walked, want 2", n)
	}
	r.RemoveWorker(b)
	r.AddWorker("b") // back, with nothing removed after it
	if d, err := r.Select(&Request{PromptTokens: 16}); err != nil || len(d.Candidates) != 2 {
		t.Fatalf("after b came back: %d candidates (%v)", len(d.Candidates), err)
	}
}
