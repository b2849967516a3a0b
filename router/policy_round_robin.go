package router

import "sync/atomic"

// roundRobinPolicy takes available workers in WorkerID order; its cursor
// advances only on Commit, so a dry run and the real request agree.
type roundRobinPolicy struct{ next atomic.Uint32 }

func newRoundRobinPolicy(*Config) (Policy, error) { return &roundRobinPolicy{}, nil }

// Pick takes the first candidate at or after the cursor, wrapping around.
func (p *roundRobinPolicy) Pick(s *Snapshot) int {
	next := int(p.next.Load())
	n := int(s.Cands[len(s.Cands)-1].Worker) + 1
	for i := range s.Cands { // distance from the cursor in cycle order
		s.Cands[i].Score = float64((int(s.Cands[i].Worker) - next%n + n) % n)
	}
	for i := range s.Cands {
		if int(s.Cands[i].Worker) >= next {
			return i
		}
	}
	return 0
}

func (p *roundRobinPolicy) Commit(_ *Request, d *Decision) { p.next.Store(uint32(d.Worker) + 1) }
