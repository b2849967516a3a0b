package router

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// calibrator fits one worker's slowdown factor s from observed TTFTs, by
// least squares with forgetting:
//
//	ttft − fetch ≈ s · p
//
// where p is what the configured coefficients predicted at Commit for the
// request (base, decode pressure, queued and uncached tokens). A worker twice
// as slow as configured converges to s = 2, and the cost model multiplies
// its whole prediction (fetch aside) by s. One factor rather than one per
// coefficient: TTFTs are noisy (admission waits, batching), and in the
// fleet simulator the single factor did as well as a two-coefficient RLS fit
// on a homogeneous fleet and better on a heterogeneous one. s is clamped to
// [1/8, 8], and each sample's ratio y/p to [1/16, 16].
//
// A fit that makes a worker look slow takes its traffic away, and with it
// the samples that could correct the fit: a burst at start-up (a cold
// engine, one slow request) could leave a worker at 8× for good. So a
// worker without samples for longer than calIdleGrace drifts back to a
// prior, with half-life calIdleHalfLife, until it gets traffic and is
// measured again. The prior is the mean factor of the workers of its peer
// group (Router.SetPeerGroup) measured lately (the configured
// coefficients, s = 1, when none is): a worker added
// to a fleet that runs faster than configured, or one left idle, is taken
// for as fast as the others, not as slow as configured, and gets the
// traffic that measures it.
type calibrator struct {
	enabled atomic.Bool
	scale   atomic.Uint64 // float64 bits
	samples atomic.Int64
	relaxed atomic.Int64  // Unix ns of the last relax check
	prior   atomic.Uint64 // float64 bits: the factor an idle fit drifts to
	lastAt  atomic.Int64  // Unix ns of the last sample, 0 before any

	mu       sync.Mutex
	num, den float64 // Σ λ^k y·p, Σ λ^k p²
	last     int64   // Unix ns of the last sample
}

const (
	calLambda = 0.995 // forgetting factor: about the last 200 samples count
	// calPrior weighs the configured coefficients (s = 1) like a few
	// typical samples (p ≈ 200 ms), so the first observations do not jump.
	calPrior = 4 * 200 * 200
	calClamp = 8 // s stays in [1/calClamp, calClamp]

	calIdleGrace    = int64(10 * time.Second)
	calIdleHalfLife = 30 * time.Second
	calRelaxEvery   = int64(time.Second) // how often relax recomputes s
)

func (c *calibrator) init() {
	c.num, c.den = calPrior, calPrior
	c.scale.Store(math.Float64bits(1))
	c.prior.Store(math.Float64bits(1))
}

// measured reports whether the worker had a sample within calIdleGrace of
// now (Unix ns).
func (c *calibrator) measured(now int64) bool {
	last := c.lastAt.Load()
	return last != 0 && now-last <= calIdleGrace
}

func (c *calibrator) factor() float64 { return math.Float64frombits(c.scale.Load()) }

// forget drops the fit: the worker is measured anew, and until then takes
// its peers' prior at the next relax (a worker revived, or moved to other
// peers, whose fit was of other work).
func (c *calibrator) forget() {
	c.mu.Lock()
	c.num, c.den, c.last = calPrior, calPrior, 0
	c.lastAt.Store(0)
	c.relaxed.Store(0)
	c.samples.Store(0)
	c.scale.Store(c.prior.Load())
	c.mu.Unlock()
}

// idleWeight is the weight left to the fit at now (Unix ns): 1 within
// calIdleGrace of the last sample, then halving every calIdleHalfLife.
// c.mu is held.
func (c *calibrator) idleWeight(now int64) float64 {
	idle := now - c.last - calIdleGrace
	if idle <= 0 {
		return 1
	}
	return math.Exp2(-float64(idle) / float64(calIdleHalfLife))
}

// relax recomputes s at now for the time without samples, towards prior
// (at most once per calRelaxEvery); the fit itself changes only when a
// sample comes.
func (c *calibrator) relax(now int64, prior float64) {
	if now-c.relaxed.Load() < calRelaxEvery || !c.enabled.Load() {
		return
	}
	c.relaxed.Store(now)
	c.prior.Store(math.Float64bits(prior))
	c.mu.Lock()
	d := c.idleWeight(now)
	s := calFit(d*c.num+(1-d)*calPrior*prior, d*c.den+(1-d)*calPrior)
	c.scale.Store(math.Float64bits(s)) // under mu: a forget in between must win
	c.mu.Unlock()
}

func calFit(num, den float64) float64 {
	return math.Max(1/calClamp, math.Min(calClamp, num/den))
}

// observe feeds one TTFT in ms, less fetch time, against its prediction p,
// observed at now (Unix ns).
func (c *calibrator) observe(y, p float64, now int64) {
	if !c.enabled.Load() || !(y > 0) || !(p > 0) || math.IsInf(y, 0) || math.IsInf(p, 0) {
		return
	}
	// Bound each sample's ratio: least squares weighs a sample by its
	// squared residual, so one stalled request (y = 500·p) would pin s at
	// the clamp for hundreds of requests. Beyond twice the clamp a ratio
	// says nothing the clamp would not cut anyway.
	y = math.Max(p/(2*calClamp), math.Min(2*calClamp*p, y))
	c.mu.Lock()
	if d := c.idleWeight(now); d < 1 {
		c.num = d*c.num + (1-d)*calPrior*math.Float64frombits(c.prior.Load())
		c.den = d*c.den + (1-d)*calPrior
	}
	c.last = now
	c.lastAt.Store(now)
	c.num = calLambda*c.num + y*p
	c.den = calLambda*c.den + p*p
	c.scale.Store(math.Float64bits(calFit(c.num, c.den)))
	c.samples.Add(1)
	c.mu.Unlock()
}
