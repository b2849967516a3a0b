package router

// kvPolicy picks the lowest predicted TTFT (Candidate.CostMs: queue + prefill
// of uncached tokens + fetch of lower-tier blocks + decode pressure + wait
// for KV memory) plus what the request's prefill costs the requests after
// it (Candidate.ExternalMs).
type kvPolicy struct{ temperature float64 }

func newKVPolicy(cfg *Config) (Policy, error) { return kvPolicy{cfg.Temperature}, nil }

func (p kvPolicy) Pick(s *Snapshot) int {
	for i := range s.Cands {
		s.Cands[i].Score = s.Cands[i].CostMs + s.Cands[i].ExternalMs - s.Cands[i].ReplicaMs
	}
	return pickLowest(s, p.temperature)
}

func (kvPolicy) Commit(*Request, *Decision) {}
