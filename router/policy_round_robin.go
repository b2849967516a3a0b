package router

import "sync"

// roundRobinPolicy takes the available worker chosen least recently (never
// chosen: lowest WorkerID first), which cycles through the workers in
// WorkerID order. It remembers each worker's last turn rather than one
// cursor: requests that leave out different workers (Request.Avoid: the
// prefill and decode stages of disaggregated prefill, adapters, context
// lengths) each cycle through their own, where a shared cursor sent every
// prefill to the first prefill engine and every decode to the first decode
// engine. Turns advance only on Commit, so a dry run and the real request
// agree.
type roundRobinPolicy struct {
	mu    sync.Mutex // Pick runs beside Commit (Select takes no router lock)
	turns uint64
	last  []uint64 // by WorkerID: the turn it was last chosen at, 0 never
}

func newRoundRobinPolicy(*Config) (Policy, error) { return &roundRobinPolicy{}, nil }

// Pick takes the candidate chosen least recently.
func (p *roundRobinPolicy) Pick(s *Snapshot) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	best := 0
	for i := range s.Cands {
		t := p.turn(s.Cands[i].Worker)
		s.Cands[i].Score = float64(t)
		if t < p.turn(s.Cands[best].Worker) {
			best = i
		}
	}
	return best
}

func (p *roundRobinPolicy) turn(w WorkerID) uint64 {
	if int(w) < len(p.last) {
		return p.last[w]
	}
	return 0
}

func (p *roundRobinPolicy) Commit(_ *Request, d *Decision) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for int(d.Worker) >= len(p.last) {
		p.last = append(p.last, 0)
	}
	p.turns++
	p.last[d.Worker] = p.turns
}
