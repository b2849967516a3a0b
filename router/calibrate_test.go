package router

import (
	"math"
	"math/rand"
	"testing"
	"time"
)

// TestCalibrationConvergesOnSlowWorker feeds TTFTs of a worker that is twice
// as slow as configured and of one that matches the configuration, and
// checks the fitted factors, coefficients and routing.
func TestCalibrationConvergesOnSlowWorker(t *testing.T) {
	r := newTestRouter(t, "kv", 2, nil)
	cc := r.Config().Cost
	rng := rand.New(rand.NewSource(3))
	for i := 0; i < 600; i++ {
		w := WorkerID(i % 2)
		slow := 1.0 + float64(w)
		// Some requests already queued on the worker.
		var queued []*Active
		for k := rng.Intn(4); k > 0; k-- {
			queued = append(queued, r.Commit(&Request{PromptTokens: 100 + rng.Intn(4000)}, Decision{Worker: w}))
		}
		q := &Request{Pinned: true, Pin: w, PromptTokens: 50 + rng.Intn(20000)}
		d, a := mustRoute(t, r, q)
		c := d.Candidates[w]
		truth := slow * cc.compute(&c, q.PromptTokens, c.PrefillTokens) // nothing cached, no fetch
		truth *= 1 + 0.1*rng.NormFloat64()                              // measurement noise
		a.ObserveTTFT(time.Duration(truth * float64(time.Millisecond)))
		a.ObserveTTFT(time.Hour) // only the first observation counts
		a.Free()
		for _, b := range queued {
			b.Free()
		}
	}
	st := r.Workers()
	near := func(got, want float64) bool { return math.Abs(got-want) <= 0.05*want }
	if !near(st[0].Slowdown, 1) || !near(st[1].Slowdown, 2) {
		t.Errorf("slowdowns %.3f and %.3f, want 1 and 2", st[0].Slowdown, st[1].Slowdown)
	}
	if !near(st[1].PrefillMsPerToken, 2*cc.PrefillMsPerToken) || !near(st[1].QueueMsPerToken, 2*cc.QueueMsPerToken) {
		t.Errorf("slow worker coefficients %.4f / %.4f, want %.4f / %.4f",
			st[1].PrefillMsPerToken, st[1].QueueMsPerToken, 2*cc.PrefillMsPerToken, 2*cc.QueueMsPerToken)
	}
	if st[1].TTFTSamples != 300 {
		t.Errorf("samples %d, want 300", st[1].TTFTSamples)
	}
	// The slow worker now looks twice as slow for the same request.
	d, _ := r.Select(&Request{PromptTokens: 4000})
	if d.Worker != 0 || !near(d.Candidates[1].CostMs, 2*d.Candidates[0].CostMs) {
		t.Errorf("calibrated costs %.1f and %.1f", d.Candidates[0].CostMs, d.Candidates[1].CostMs)
	}
	if !r.Idle() {
		t.Error("not idle")
	}
}

func TestCalibrationOffKeepsConfig(t *testing.T) {
	r := newTestRouter(t, "kv", 1, func(c *Config) { c.Calibrate = false })
	_, a := mustRoute(t, r, &Request{PromptTokens: 1000})
	a.ObserveTTFT(10 * time.Second)
	a.Free()
	if st := r.Workers()[0]; st.PrefillMsPerToken != r.Config().Cost.PrefillMsPerToken || st.TTFTSamples != 0 {
		t.Fatalf("calibration off still fitted: %+v", st)
	}
}

// observer routes a 2,000-token prompt to worker w and observes its TTFT
// as times what the configured coefficients predict.
func observer(t *testing.T, r *Router) func(w WorkerID, times float64) {
	cc := r.Config().Cost
	return func(w WorkerID, times float64) {
		q := &Request{Pinned: true, Pin: w, PromptTokens: 2000}
		d, a := mustRoute(t, r, q)
		c := d.Candidates[w]
		a.ObserveTTFT(time.Duration(times * cc.compute(&c, q.PromptTokens, c.PrefillTokens) * float64(time.Millisecond)))
		a.PrefillDone()
		a.Free()
	}
}

// TestCalibrationRelaxesOnAnIdleWorker: a burst makes worker 1 look 8× slow,
// so kv sends it nothing and no sample can correct the fit. Without samples
// its factor drifts back to 1 (after calIdleGrace, half-life
// calIdleHalfLife), it gets traffic again, and the fit follows what it
// measures then. A worker with regular samples does not drift.
func TestCalibrationRelaxesOnAnIdleWorker(t *testing.T) {
	clock := newFakeClock()
	r := newTestRouter(t, "kv", 2, func(c *Config) { c.Now = clock.Now })
	observe := observer(t, r)
	for i := 0; i < 200; i++ {
		observe(1, 20) // a cold start: far slower than configured
		observe(0, 1)
	}
	if s := r.Workers()[1].Slowdown; s != calClamp {
		t.Fatalf("slowdown %.2f after the burst, want the clamp", s)
	}
	unpinned := func() WorkerID {
		d, a := mustRoute(t, r, &Request{PromptTokens: 2000})
		a.Free()
		return d.Worker
	}
	if w := unpinned(); w != 0 {
		t.Fatalf("routed to %d right after the burst", w)
	}
	// Worker 0 is busy (three prompts queued) and keeps getting samples
	// every second: it does not drift.
	for i := 0; i < 3; i++ {
		a := r.Commit(&Request{PromptTokens: 2000}, Decision{Worker: 0})
		defer a.Free()
	}
	if w := unpinned(); w != 0 {
		t.Fatalf("routed to %d, 8x slow, rather than to the busy worker", w)
	}
	var back time.Duration
	for back = 0; back < 10*time.Minute; back += time.Second {
		clock.Advance(time.Second)
		observe(0, 1)
		if unpinned() == 1 {
			break
		}
	}
	if back < 10*time.Second || back > 3*time.Minute {
		t.Fatalf("worker 1 got traffic again after %v idle, want between the grace (10s) and 3 min", back)
	}
	if s := r.Workers()[0].Slowdown; math.Abs(s-1) > 0.05 {
		t.Fatalf("worker 0, sampled every second, drifted to %.3f", s)
	}
	// Measured again, the fit follows the worker as it is now.
	for i := 0; i < 1000; i++ { // λ^1000 < 1%
		observe(1, 1)
	}
	if s := r.Workers()[1].Slowdown; math.Abs(s-1) > 0.05 {
		t.Fatalf("slowdown %.3f once the worker is measured again at 1x", s)
	}
}

// TestAddedWorkerTakesTheFleetsFit: a fleet measured at a third of the
// configured times (the coefficients were left at their defaults for faster
// engines). A worker added then, never measured, is taken for as fast as
// the others, not as slow as configured, so it gets the traffic that
// measures it; one left idle drifts to the same.
func TestAddedWorkerTakesTheFleetsFit(t *testing.T) {
	clock := newFakeClock()
	r := newTestRouter(t, "kv", 2, func(c *Config) { c.Now = clock.Now })
	observe := observer(t, r)
	for i := 0; i < 1000; i++ {
		observe(WorkerID(i%2), 1.0/3)
	}
	fleet := r.Workers()[0].Slowdown
	if math.Abs(fleet-1.0/3) > 0.03 {
		t.Fatalf("fleet fitted at %.3f, want 1/3", fleet)
	}
	c := r.AddWorker("w-new")
	// Both measured workers have a queued prompt; the new one is idle.
	for w := WorkerID(0); w < 2; w++ {
		a := r.Commit(&Request{PromptTokens: 2000}, Decision{Worker: w})
		defer a.Free()
	}
	d, err := r.Select(&Request{PromptTokens: 2000})
	if err != nil {
		t.Fatal(err)
	}
	if s := r.Workers()[c].Slowdown; math.Abs(s-fleet) > 0.01 || d.Worker != c {
		t.Fatalf("the added worker: slowdown %.3f (fleet %.3f), request routed to %s", s, fleet, d.Name)
	}
	// Worker 1 idle for 10 minutes while worker 0 keeps its fit: 1 drifts
	// to the fleet's, not to 1.
	for i := 0; i < 600; i++ {
		clock.Advance(time.Second)
		observe(0, 1.0/3)
	}
	if s := r.Workers()[1].Slowdown; math.Abs(s-fleet) > 0.03 {
		t.Fatalf("idle worker drifted to %.3f, want the fleet's %.3f", s, fleet)
	}
}

// TestPriorIsThePeerGroups: prefill engines (peer group 1) measured at 4×
// and decode engines at 1/3 of the configured times (their TTFTs are of
// other work). A decode engine added then drifts to the decode engines'
// fit and an idle prefill engine to the prefill engines', whoever reads
// them first: the status, a pinned request, or a retry that avoids the one
// decode engine measured lately.
func TestPriorIsThePeerGroups(t *testing.T) {
	clock := newFakeClock()
	r := newTestRouter(t, "kv", 5, func(c *Config) { c.Now = clock.Now })
	observe := observer(t, r)
	for w := WorkerID(0); w < 2; w++ {
		r.SetPeerGroup(w, 1)
	}
	for i := 0; i < 1000; i++ {
		w := WorkerID(i % 4)
		observe(w, map[bool]float64{true: 4, false: 1.0 / 3}[w < 2])
	}
	// Worker 4 (decode) and worker 1 (prefill) idle for two minutes while
	// 0 and 2 keep being measured.
	for i := 0; i < 120; i++ {
		clock.Advance(time.Second)
		observe(0, 4)
		observe(2, 1.0/3)
		r.Workers() // the status, read as often as anything routes
	}
	added := r.AddWorker("decode-new")
	r.Workers()
	_, a := mustRoute(t, r, &Request{PromptTokens: 2000, Pinned: true, Pin: 2})
	a.Free()
	if _, err := r.Select(&Request{PromptTokens: 2000, Avoid: []WorkerID{0, 1, 2}}); err != nil {
		t.Fatal(err)
	}
	st := r.Workers()
	near := func(got, want float64) bool { return math.Abs(got-want) <= 0.03*want }
	if !near(st[4].Slowdown, st[2].Slowdown) || !near(st[added].Slowdown, st[2].Slowdown) || !near(st[1].Slowdown, st[0].Slowdown) {
		t.Fatalf("idle decode %.3f, added decode %.3f (decode peer %.3f); idle prefill %.3f (prefill peer %.3f)",
			st[4].Slowdown, st[added].Slowdown, st[2].Slowdown, st[1].Slowdown, st[0].Slowdown)
	}
}

// A worker moved to another peer group forgets the fit it learned on the
// other group's work and takes its new peers' at once; a removed worker
// added again starts in group 0, its fit forgotten; any int is a group.
func TestPeerGroupChangesForgetTheFit(t *testing.T) {
	clock := newFakeClock()
	r := newTestRouter(t, "kv", 3, func(c *Config) { c.Now = clock.Now })
	observe := observer(t, r)
	r.SetPeerGroup(0, 1)
	for i := 0; i < 600; i++ {
		w := WorkerID(i % 3)
		observe(w, map[bool]float64{true: 4, false: 1.0 / 3}[w == 0])
	}
	r.SetPeerGroup(0, 0) // a prefill engine reloaded as a decode one
	if _, err := r.Select(&Request{PromptTokens: 2000}); err != nil {
		t.Fatal(err)
	}
	st := r.Workers()
	if math.Abs(st[0].Slowdown-st[1].Slowdown) > 0.03*st[1].Slowdown {
		t.Fatalf("regrouped worker at %.3f, its new peers at %.3f", st[0].Slowdown, st[1].Slowdown)
	}
	r.SetPeerGroup(2, 1)
	r.RemoveWorker(2)
	r.AddWorker("w2")
	r.Select(&Request{PromptTokens: 2000})
	if st = r.Workers(); st[2].PeerGroup != 0 || math.Abs(st[2].Slowdown-st[1].Slowdown) > 0.03*st[1].Slowdown {
		t.Fatalf("re-added worker in group %d at %.3f, group 0 at %.3f", st[2].PeerGroup, st[2].Slowdown, st[1].Slowdown)
	}
	for _, g := range []int{-1, -5, 7} {
		r.SetPeerGroup(1, g)
		if _, err := r.Select(&Request{PromptTokens: 2000}); err != nil {
			t.Fatal(err)
		}
		if pg := r.Workers()[1].PeerGroup; pg < 0 || pg >= peerGroups {
			t.Fatalf("group %d stored as %d", g, pg)
		}
	}
}
