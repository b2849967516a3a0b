package router

// kvPolicy picks the lowest predicted TTFT (Candidate.CostMs): queue + prefill
// of uncached tokens + fetch of lower-tier blocks + decode pressure.
type kvPolicy struct{ temperature float64 }

func newKVPolicy(cfg *Config) (Policy, error) { return kvPolicy{cfg.Temperature}, nil }

func (p kvPolicy) Pick(s *Snapshot) int     { return pickLowest(s, p.temperature) }
func (kvPolicy) Commit(*Request, *Decision) {}
