package router

// leastLoadPolicy picks the fewest in-flight requests, then the fewest active
// blocks; exact ties are broken by the request's seed.
type leastLoadPolicy struct{}

func newLeastLoadPolicy(*Config) (Policy, error) { return leastLoadPolicy{}, nil }

func (leastLoadPolicy) Pick(s *Snapshot) int {
	for i := range s.Cands {
		c := &s.Cands[i]
		c.Score = float64(c.Inflight)*(1<<32) + float64(c.ActiveBlocks)
	}
	return pickLowest(s, 0)
}

func (leastLoadPolicy) Commit(*Request, *Decision) {}
