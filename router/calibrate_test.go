package router

import (
	"math"
	"math/rand"
	"testing"
	"time"
)

// TestCalibrationConvergesOnSlowWorker feeds TTFTs of a worker that is twice
// as slow as configured (prefill and queue) and of one that matches the
// configuration, and checks the fitted coefficients and the routing.
func TestCalibrationConvergesOnSlowWorker(t *testing.T) {
	r := newTestRouter(t, "kv", 2, nil)
	cc := r.Config().Cost
	rng := rand.New(rand.NewSource(3))
	for i := 0; i < 400; i++ {
		w := WorkerID(i % 2)
		slow := 1.0
		if w == 1 {
			slow = 2
		}
		// Some requests already queued on the worker.
		var queued []*Active
		for k := rng.Intn(4); k > 0; k-- {
			queued = append(queued, r.Commit(&Request{PromptTokens: 100 + rng.Intn(4000)}, Decision{Worker: w}))
		}
		q := &Request{Pinned: true, Pin: w, PromptTokens: 50 + rng.Intn(20000)}
		d, a := mustRoute(t, r, q)
		u, qt := float64(a.uncached), float64(a.queued)
		chunk := math.Min(u, float64(cc.PrefillChunkTokens))
		truth := a.offsetMs + slow*(cc.PrefillMsPerToken*u+cc.PrefillMsPerToken2*u*chunk+cc.QueueMsPerToken*qt)
		truth *= 1 + 0.05*rng.NormFloat64() // measurement noise
		_ = d
		a.ObserveTTFT(time.Duration(truth * float64(time.Millisecond)))
		a.ObserveTTFT(time.Hour) // only the first observation counts
		a.Free()
		for _, b := range queued {
			b.Free()
		}
	}
	st := r.Workers()
	near := func(got, want float64) bool { return math.Abs(got-want) <= 0.1*want }
	if !near(st[0].PrefillMsPerToken, cc.PrefillMsPerToken) || !near(st[0].QueueMsPerToken, cc.QueueMsPerToken) {
		t.Errorf("normal worker fitted %.4f / %.4f, want %.4f / %.4f",
			st[0].PrefillMsPerToken, st[0].QueueMsPerToken, cc.PrefillMsPerToken, cc.QueueMsPerToken)
	}
	if !near(st[1].PrefillMsPerToken, 2*cc.PrefillMsPerToken) || !near(st[1].QueueMsPerToken, 2*cc.QueueMsPerToken) {
		t.Errorf("slow worker fitted %.4f / %.4f, want %.4f / %.4f",
			st[1].PrefillMsPerToken, st[1].QueueMsPerToken, 2*cc.PrefillMsPerToken, 2*cc.QueueMsPerToken)
	}
	if st[1].TTFTSamples != 200 {
		t.Errorf("samples %d, want 200", st[1].TTFTSamples)
	}
	// The slow worker now looks slower for the same request.
	d, _ := r.Select(&Request{PromptTokens: 4000})
	if d.Worker != 0 || d.Candidates[1].CostMs < 1.5*d.Candidates[0].CostMs-20 {
		t.Errorf("calibrated costs %+v", d.Candidates)
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
