package router

import (
	"math"
	"sync"
	"sync/atomic"
)

// calibrator refits one worker's PrefillMsPerToken and QueueMsPerToken from
// observed TTFTs by recursive least squares with forgetting:
//
//	ttft − offset ≈ prefill·x + queue·q
//
// where x is the request's uncached tokens (its quadratic term folded in at
// the configured ratio, see CostConfig.effectiveTokens), q the worker's queued prefill tokens at Commit, and
// offset the rest of the prediction (base, decode pressure, fetch). Fitted
// values are clamped to [1/8, 8] × the configured ones, so one bad sample
// cannot make a worker look free or dead.
type calibrator struct {
	enabled atomic.Bool
	prefill atomic.Uint64 // float64 bits, ms per token
	queue   atomic.Uint64
	samples atomic.Int64

	mu   sync.Mutex
	cfgP float64 // configured, ms per token
	cfgQ float64
	th   [2]float64    // ms per 1000 tokens
	p    [2][2]float64 // covariance
}

const (
	calLambda = 0.98  // forgetting factor: about the last 50 samples count
	calP0     = 100.0 // initial variance, (ms per 1k tokens)²
	calPMax   = 1e4
)

func (c *calibrator) init(cc *CostConfig) {
	c.cfgP, c.cfgQ = cc.PrefillMsPerToken, cc.QueueMsPerToken
	c.th = [2]float64{c.cfgP * 1000, c.cfgQ * 1000}
	c.p = [2][2]float64{{calP0, 0}, {0, calP0}}
	c.prefill.Store(math.Float64bits(c.cfgP))
	c.queue.Store(math.Float64bits(c.cfgQ))
}

func (c *calibrator) coeffs() coeffs {
	return coeffs{math.Float64frombits(c.prefill.Load()), math.Float64frombits(c.queue.Load())}
}

// observe feeds one TTFT (ms) minus the offset, for a request with u
// effective uncached tokens (CostConfig.effectiveTokens) behind q queued
// tokens.
func (c *calibrator) observe(y, u, q float64) {
	if !c.enabled.Load() || y <= 0 || math.IsNaN(y) || math.IsInf(y, 0) {
		return
	}
	x := [2]float64{u / 1000, q / 1000}
	if x[0] == 0 && x[1] == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	px := [2]float64{c.p[0][0]*x[0] + c.p[0][1]*x[1], c.p[1][0]*x[0] + c.p[1][1]*x[1]}
	den := calLambda + x[0]*px[0] + x[1]*px[1]
	k := [2]float64{px[0] / den, px[1] / den}
	e := y - (c.th[0]*x[0] + c.th[1]*x[1])
	c.th[0] += k[0] * e
	c.th[1] += k[1] * e
	for i := 0; i < 2; i++ {
		for j := 0; j < 2; j++ {
			c.p[i][j] = (c.p[i][j] - k[i]*px[j]) / calLambda
		}
	}
	for i := 0; i < 2; i++ { // no wind-up along directions never excited
		if c.p[i][i] > calPMax {
			s := math.Sqrt(calPMax / c.p[i][i])
			c.p[i][0] *= s
			c.p[i][1] *= s
			c.p[0][i] *= s
			c.p[1][i] *= s
		}
	}
	c.th[0] = clamp(c.th[0], c.cfgP*1000/8, c.cfgP*1000*8)
	c.th[1] = clamp(c.th[1], c.cfgQ*1000/8, c.cfgQ*1000*8)
	c.prefill.Store(math.Float64bits(c.th[0] / 1000))
	c.queue.Store(math.Float64bits(c.th[1] / 1000))
	c.samples.Add(1)
}

func clamp(x, lo, hi float64) float64 {
	return math.Max(lo, math.Min(hi, x))
}
