package router

import "sync/atomic"

// roundRobinPolicy takes available workers in WorkerID order; its cursor
// advances only on Commit, so a dry run and the real request agree.
type roundRobinPolicy struct{ next atomic.Uint32 }

func newRoundRobinPolicy(*Config) (Policy, error) { return &roundRobinPolicy{}, nil }

// Pick takes the first candidate at or after the cursor, wrapping around.
func (p *roundRobinPolicy) Pick(s *Snapshot) int {
	next := WorkerID(p.next.Load())
	for i := range s.Cands {
		s.Cands[i].Score = float64((uint32(s.Cands[i].Worker) - uint32(next)) % (1 << 31))
	}
	for i := range s.Cands {
		if s.Cands[i].Worker >= next {
			return i
		}
	}
	return 0
}

func (p *roundRobinPolicy) Commit(_ *Request, d *Decision) { p.next.Store(uint32(d.Worker) + 1) }
