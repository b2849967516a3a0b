package router

import "fmt"

// dynamoPolicy is NVIDIA Dynamo's KV router cost: logit = overlap_weight ×
// prefill_blocks + decode_blocks, lower wins, where prefill_blocks are the
// request's uncached blocks plus the prefill blocks in flight on the worker
// and decode_blocks the worker's active blocks plus the request's own new
// blocks (Dynamo counts the blocks a request would add; here its uncached
// blocks stand for them, without a per-worker lookup of live prefixes).
type dynamoPolicy struct {
	weight      float64
	temperature float64
}

func newDynamoPolicy(cfg *Config) (Policy, error) {
	if cfg.Dynamo.OverlapWeight == 0 {
		cfg.Dynamo.OverlapWeight = 1
	}
	if !finiteNonNeg(cfg.Dynamo.OverlapWeight) {
		return nil, fmt.Errorf("overlap_weight %v must be finite and not negative", cfg.Dynamo.OverlapWeight)
	}
	return dynamoPolicy{cfg.Dynamo.OverlapWeight, cfg.Temperature}, nil
}

func (p dynamoPolicy) Pick(s *Snapshot) int {
	bs := float64(s.BlockSize)
	for i := range s.Cands {
		c := &s.Cands[i]
		newBlocks := float64(uncachedTokens(s.Req.PromptTokens, c.Overlap, s.BlockSize)) / bs
		prefill := newBlocks + float64(c.PrefillTokens)/bs
		c.Score = p.weight*prefill + float64(c.ActiveBlocks) + newBlocks
	}
	return pickLowest(s, p.temperature)
}

func (dynamoPolicy) Commit(*Request, *Decision) {}
