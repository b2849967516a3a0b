package router

import (
	"math"
	"sync"
	"sync/atomic"
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
type calibrator struct {
	enabled atomic.Bool
	scale   atomic.Uint64 // float64 bits
	samples atomic.Int64

	mu       sync.Mutex
	num, den float64 // Σ λ^k y·p, Σ λ^k p²
}

const (
	calLambda = 0.995 // forgetting factor: about the last 200 samples count
	// calPrior weighs the configured coefficients (s = 1) like a few
	// typical samples (p ≈ 200 ms), so the first observations do not jump.
	calPrior = 4 * 200 * 200
	calClamp = 8 // s stays in [1/calClamp, calClamp]
)

func (c *calibrator) init() {
	c.num, c.den = calPrior, calPrior
	c.scale.Store(math.Float64bits(1))
}

func (c *calibrator) factor() float64 { return math.Float64frombits(c.scale.Load()) }

// observe feeds one TTFT in ms, less fetch time, against its prediction p.
func (c *calibrator) observe(y, p float64) {
	if !c.enabled.Load() || !(y > 0) || !(p > 0) || math.IsInf(y, 0) || math.IsInf(p, 0) {
		return
	}
	// Bound each sample's ratio: least squares weighs a sample by its
	// squared residual, so one stalled request (y = 500·p) would pin s at
	// the clamp for hundreds of requests. Beyond twice the clamp a ratio
	// says nothing the clamp would not cut anyway.
	y = math.Max(p/(2*calClamp), math.Min(2*calClamp*p, y))
	c.mu.Lock()
	c.num = calLambda*c.num + y*p
	c.den = calLambda*c.den + p*p
	s := math.Max(1/calClamp, math.Min(calClamp, c.num/c.den))
	c.mu.Unlock()
	c.scale.Store(math.Float64bits(s))
	c.samples.Add(1)
}
