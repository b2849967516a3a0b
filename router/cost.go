package router

import (
	"fmt"

	"github.com/kvproxy/kvproxy/kv"
)

// CostConfig holds the kv policy's coefficients, in milliseconds. The
// defaults follow the simulated engine's step-time fit (mockengine): prefill
// ms ≈ 4.2e-7·T² + 0.0152·T + 16.5 for T uncached tokens; queued prefill is
// computed in chunks, each step paying the base again, so a queued token
// costs a little more than a fresh one; decode steps grow with KV usage, so
// active blocks slow a worker's next prefill.
type CostConfig struct {
	PrefillMsPerToken float64              // predicted ms per uncached prompt token
	QueueMsPerToken   float64              // ms per prefill token already queued/in flight on the worker
	DecodeMsPerBlock  float64              // decode pressure per active KV block on the worker
	FetchMsPerBlock   [kv.NumTiers]float64 // per tier, for blocks held below the device tier; [TierDevice] is unused
	// PrefillBaseMs is the fixed cost of the prefill step (same for every
	// worker; it only makes PredictedTTFTms honest).
	PrefillBaseMs float64
	// PrefillMsPerToken2 is the quadratic (attention) term per uncached token².
	PrefillMsPerToken2 float64
}

// DefaultCostConfig returns coefficients fitted to the simulated engine.
// Fetch times assume 2 MB blocks (Llama-3.1-8B, 16 tokens) at host 55 µs/MB,
// disk 280 µs/MB, shared 1,800 µs/MB.
func DefaultCostConfig() CostConfig {
	return CostConfig{
		PrefillMsPerToken:  0.0152,
		QueueMsPerToken:    0.02,
		DecodeMsPerBlock:   0.005,
		FetchMsPerBlock:    [kv.NumTiers]float64{0, 0.11, 0.56, 3.6},
		PrefillBaseMs:      16.5,
		PrefillMsPerToken2: 4.2e-7,
	}
}

func (c *CostConfig) validate() error {
	bad := c.PrefillMsPerToken < 0 || c.QueueMsPerToken < 0 || c.DecodeMsPerBlock < 0 ||
		c.PrefillBaseMs < 0 || c.PrefillMsPerToken2 < 0
	for _, f := range c.FetchMsPerBlock {
		bad = bad || f < 0
	}
	if bad {
		return fmt.Errorf("router: cost coefficients must not be negative")
	}
	return nil
}

// coeffs are one worker's fitted (or configured) linear coefficients.
type coeffs struct{ prefill, queue float64 }

// predict is the kv cost model: predicted TTFT in ms of a request with
// promptTokens on the candidate c. It is a pure function of its arguments.
// engineQueue is the engine's own view of queued prefill tokens (0 if none);
// the larger of it and the router's view is used.
func (cc *CostConfig) predict(co coeffs, c *Candidate, promptTokens, blockSize int, engineQueue int64) float64 {
	u := float64(uncachedTokens(promptTokens, c.Overlap, blockSize))
	q := c.PrefillTokens
	if engineQueue > q {
		q = engineQueue
	}
	ms := cc.PrefillBaseMs + co.queue*float64(q) + co.prefill*u +
		cc.PrefillMsPerToken2*u*u*(co.prefill/nonzero(cc.PrefillMsPerToken)) +
		cc.DecodeMsPerBlock*float64(c.ActiveBlocks)
	for t := kv.TierHost; t < kv.NumTiers; t++ {
		ms += float64(c.Tiers[t]) * cc.FetchMsPerBlock[t]
	}
	return ms
}

func uncachedTokens(promptTokens, overlap, blockSize int) int {
	u := promptTokens - overlap*blockSize
	if u < 0 {
		return 0
	}
	return u
}

func nonzero(x float64) float64 {
	if x == 0 {
		return 1
	}
	return x
}

// offset is the part of the prediction for c that does not scale with the
// fitted coefficients: base, decode pressure and fetch.
func (cc *CostConfig) offset(c *Candidate) float64 {
	ms := cc.PrefillBaseMs + cc.DecodeMsPerBlock*float64(c.ActiveBlocks)
	for t := kv.TierHost; t < kv.NumTiers; t++ {
		ms += float64(c.Tiers[t]) * cc.FetchMsPerBlock[t]
	}
	return ms
}
