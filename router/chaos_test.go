package router

import (
	"fmt"
	"math/rand"
	"sync"
	"testing"
	"time"
)

type lockedClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *lockedClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *lockedClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// TestZeroCountersWithUnstreamedAndRemovals extends the chaos test to
// unstreamed requests (due prefills ended by the clock), ObserveTTFT,
// workers removed and re-added, availability and engine-load changes, under
// every policy: no counter ever goes negative, every counter is zero and no
// due entry is left once everything is freed.
func TestZeroCountersWithUnstreamedAndRemovals(t *testing.T) {
	for _, pol := range []string{"kv", "cache_aware", "prefix_hash", "round_robin", "least_load", "kv_dynamo"} {
		c := &lockedClock{t: time.Unix(1_700_000_000, 0)}
		r := newTestRouter(t, pol, 6, func(cfg *Config) { cfg.Now = c.Now })
		var wg sync.WaitGroup
		var mu sync.Mutex
		var all []*Active
		for g := 0; g < 6; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				rng := rand.New(rand.NewSource(int64(g)))
				var mine []*Active
				for i := 0; i < 1000; i++ {
					switch op := rng.Intn(100); {
					case op < 50:
						n := rng.Intn(40)
						q := &Request{Hashes: seq(n, uint64(rng.Intn(6))), PromptTokens: n*16 + rng.Intn(16), Unstreamed: rng.Intn(2) == 0}
						if rng.Intn(6) == 0 {
							q.Pinned, q.Pin = true, WorkerID(rng.Intn(6))
						}
						_, a, err := r.Route(q)
						if err != nil {
							continue
						}
						mine = append(mine, a)
						if rng.Intn(3) == 0 {
							a.ObserveTTFT(time.Duration(rng.Intn(1000)) * time.Millisecond)
						}
					case op < 70 && len(mine) > 0:
						k := rng.Intn(len(mine))
						a := mine[k]
						switch rng.Intn(4) {
						case 0:
							a.PrefillDone()
						case 1:
							a.OutputBlock()
						default:
							a.Free()
							mine = append(mine[:k], mine[k+1:]...)
						}
					case op < 80:
						c.Advance(time.Duration(rng.Intn(50)) * time.Millisecond)
					case op < 82:
						id := WorkerID(rng.Intn(6))
						r.RemoveWorker(id)
						r.AddWorker(fmt.Sprintf("w%d", id))
					case op < 84:
						r.SetAvailable(WorkerID(rng.Intn(6)), rng.Intn(2) == 0)
					case op < 86:
						r.SetEngineLoad(WorkerID(rng.Intn(6)), rng.Intn(5), rng.Intn(5), rng.Float64())
					default:
						for _, st := range r.Workers() {
							if st.Inflight < 0 || st.PrefillTokens < 0 || st.ActiveBlocks < 0 || st.Pending < 0 {
								t.Errorf("negative counters %+v", st)
							}
						}
					}
				}
				mu.Lock()
				all = append(all, mine...)
				mu.Unlock()
			}(g)
		}
		wg.Wait()
		for _, a := range all {
			a.Free()
		}
		c.Advance(time.Hour)
		r.Workers()
		if !r.Idle() {
			t.Fatalf("%s: not idle: %+v", pol, r.Workers())
		}
		for _, w := range *r.workers.Load() {
			w.mu.Lock()
			n := len(w.due)
			w.mu.Unlock()
			if n != 0 {
				t.Errorf("%s: worker %d has %d due entries", pol, w.id, n)
			}
		}
	}
}
