package router

import (
	"fmt"
	"math"

	"github.com/kvproxy/kvproxy/kv"
)

// CostConfig holds the kv policy's coefficients, in milliseconds. The
// defaults follow the simulated engine's step-time fit (mockengine): a step
// computing T prompt tokens takes 4.2e-7·T² + 0.0152·T + 16.5 ms, prompts are
// cut into chunks of at most 8192 tokens (one step each), queued prefill pays
// the same per chunk (≈ 0.02 ms per token), and a mixed step adds decode time
// growing with KV usage (≈ 54 ms at full usage of 30,000 blocks, so about
// 0.002 ms per active block).
type CostConfig struct {
	PrefillMsPerToken float64              // predicted ms per uncached prompt token
	QueueMsPerToken   float64              // ms per prefill token already queued/in flight on the worker
	DecodeMsPerBlock  float64              // decode pressure per active KV block on the worker
	FetchMsPerBlock   [kv.NumTiers]float64 // per tier, for blocks held below the device tier; [TierDevice] is unused
	// PrefillBaseMs is the fixed cost of the prefill step (same for every
	// worker; it only makes PredictedTTFTms honest).
	PrefillBaseMs float64
	// PrefillMsPerToken2 is the quadratic (attention) term, per token² of a
	// chunk.
	PrefillMsPerToken2 float64
	// PrefillChunkTokens is the engine's prefill chunk (vLLM's
	// max_num_batched_tokens); each chunk pays PrefillBaseMs and its own
	// quadratic term. 0 means one chunk.
	PrefillChunkTokens int
}

// DefaultCostConfig returns coefficients fitted to the simulated engine.
// Fetch times assume 2 MB blocks (Llama-3.1-8B, 16 tokens) at host 55 µs/MB,
// disk 280 µs/MB, shared 1,800 µs/MB.
func DefaultCostConfig() CostConfig {
	return CostConfig{
		PrefillMsPerToken:  0.0152,
		QueueMsPerToken:    0.02,
		DecodeMsPerBlock:   0.002,
		FetchMsPerBlock:    [kv.NumTiers]float64{0, 0.11, 0.56, 3.6},
		PrefillBaseMs:      16.5,
		PrefillMsPerToken2: 4.2e-7,
		PrefillChunkTokens: 8192,
	}
}

func (c *CostConfig) validate() error {
	bad := !finiteNonNeg(c.PrefillMsPerToken) || !finiteNonNeg(c.QueueMsPerToken) || !finiteNonNeg(c.DecodeMsPerBlock) ||
		!finiteNonNeg(c.PrefillBaseMs) || !finiteNonNeg(c.PrefillMsPerToken2) || c.PrefillChunkTokens < 0
	for _, f := range c.FetchMsPerBlock {
		bad = bad || !finiteNonNeg(f)
	}
	if bad {
		return fmt.Errorf("router: cost coefficients must be finite and not negative")
	}
	return nil
}

// predict is the kv cost model: predicted TTFT in ms of a request with
// promptTokens on the candidate c, whose worker runs at slowdown factor
// scale (1 = as configured; see calibrator), c.MemoryMs included. It is a
// pure function of its arguments. engineQueue is the engine's own view of queued prefill tokens
// (0 if none); the larger of it and the router's view is used.
func (cc *CostConfig) predict(scale float64, c *Candidate, promptTokens, blockSize int, engineQueue int64) float64 {
	u := uncachedTokens(promptTokens, c.Overlap, blockSize)
	q := c.PrefillTokens
	if engineQueue > q {
		q = engineQueue
	}
	return scale*cc.compute(c, u, q) + cc.fetch(c) + c.MemoryMs
}

// externality prices the request's prefill by its cost to the requests that
// come after it: computing u prompt tokens on a worker is work that later
// arrivals there wait behind, and in a queue the expected number of requests
// a unit of work delays is about the number in the system (M/G/1:
// L = ρ/(1−ρ)). waiters is that number as the router sees it, the mean
// count of requests awaiting their first token per worker. On an idle fleet
// the term vanishes; as queues form, a cache miss (more tokens to compute,
// cached blocks of others evicted) costs more than the requester's own
// TTFT, so kv keeps conversations on their cache instead of spreading them,
// which would add work and feed the overload. The configured speed is used,
// not the worker's fitted slowdown: multiplied by waiters, the fit's noise
// would outweigh its signal.
func (cc *CostConfig) externality(c *Candidate, promptTokens, blockSize int, waiters float64) float64 {
	if waiters <= 0 {
		return 0
	}
	u := uncachedTokens(promptTokens, c.Overlap, blockSize)
	return waiters * cc.PrefillMsPerToken * cc.effectiveTokens(u)
}

// compute is the predicted compute time at the configured speed: base per
// chunk, decode pressure, queued and uncached prefill.
func (cc *CostConfig) compute(c *Candidate, uncached int, queued int64) float64 {
	steps := 1
	if cc.PrefillChunkTokens > 0 && uncached > cc.PrefillChunkTokens {
		steps = (uncached + cc.PrefillChunkTokens - 1) / cc.PrefillChunkTokens
	}
	return cc.PrefillBaseMs*float64(steps) + cc.DecodeMsPerBlock*float64(c.ActiveBlocks) +
		cc.QueueMsPerToken*float64(queued) + cc.PrefillMsPerToken*cc.effectiveTokens(uncached)
}

// fetch is the time to load the blocks c holds below the device tier.
func (cc *CostConfig) fetch(c *Candidate) float64 {
	ms := 0.0
	for t := kv.TierHost; t < kv.NumTiers; t++ {
		ms += float64(c.Tiers[t]) * cc.FetchMsPerBlock[t]
	}
	return ms
}

// effectiveTokens folds the quadratic term into the linear one: the tokens
// whose compute time PrefillMsPerToken prices, for u uncached tokens.
func (cc *CostConfig) effectiveTokens(u int) float64 {
	if cc.PrefillMsPerToken == 0 {
		return float64(u)
	}
	chunk := u
	if cc.PrefillChunkTokens > 0 && chunk > cc.PrefillChunkTokens {
		chunk = cc.PrefillChunkTokens
	}
	return float64(u) + cc.PrefillMsPerToken2/cc.PrefillMsPerToken*float64(u)*float64(chunk)
}

func uncachedTokens(promptTokens, overlap, blockSize int) int {
	u := promptTokens - overlap*blockSize
	if u < 0 {
		return 0
	}
	return u
}

// finiteNonNeg reports whether x is a finite number ≥ 0 (NaN and ±Inf pass
// a plain "x < 0" check, and make every cost NaN).
func finiteNonNeg(x float64) bool { return x >= 0 && !math.IsInf(x, 1) }
