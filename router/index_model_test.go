package router

import (
	"math/rand"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

// modelIndex is the obvious Index, for randomized comparison.
type modelIndex struct {
	now     func() time.Time
	entries map[modelKey]modelEntry
}

type modelKey struct {
	h kv.BlockHash
	w WorkerID
}

type modelEntry struct {
	tiers   uint8
	expires time.Time // zero: never
}

func (m *modelIndex) live(k modelKey) (modelEntry, bool) {
	e, ok := m.entries[k]
	if !ok || (!e.expires.IsZero() && !m.now().Before(e.expires)) {
		return modelEntry{}, false
	}
	return e, true
}

func (m *modelIndex) store(w WorkerID, hs []kv.BlockHash, t kv.Tier, ttl time.Duration) {
	for _, h := range hs {
		k := modelKey{h, w}
		e, ok := m.live(k)
		if !ok {
			e = modelEntry{}
		}
		e.tiers |= 1 << t
		switch {
		case ttl == 0:
			e.expires = time.Time{}
		case !ok || (!e.expires.IsZero() && m.now().Add(ttl).After(e.expires)):
			e.expires = m.now().Add(ttl)
		}
		m.entries[k] = e
	}
}

func (m *modelIndex) match(hs []kv.BlockHash, w WorkerID) (depth int32, device int32) {
	for _, h := range hs {
		e, ok := m.live(modelKey{h, w})
		if !ok {
			break
		}
		depth++
		if e.tiers&1 != 0 {
			device++
		}
	}
	return depth, device
}

// TestMemIndexAgreesWithModel runs random stores, removes, clears, sweeps
// and clock steps against MemIndex and the model, comparing every match.
// Few distinct hashes and workers make long probe runs, wrap-around and
// backward-shift deletions common; enough entries force table growth.
func TestMemIndexAgreesWithModel(t *testing.T) {
	for seed := int64(1); seed <= 3; seed++ {
		agreeWithModel(t, seed)
	}
}

func agreeWithModel(t *testing.T, seed int64) {
	c := newFakeClock()
	x := NewMemIndex(MemIndexConfig{Now: c.Now})
	m := &modelIndex{now: c.Now, entries: map[modelKey]modelEntry{}}
	rng := rand.New(rand.NewSource(seed))
	const workers = 9
	pool := seq(3000, 42)
	prompt := func() []kv.BlockHash {
		start := rng.Intn(len(pool) - 64)
		return pool[start : start+1+rng.Intn(63)]
	}
	var buf []Overlap
	for step := 0; step < 20000; step++ {
		w := WorkerID(rng.Intn(workers))
		switch op := rng.Intn(100); {
		case op < 45:
			hs, tier := prompt(), kv.Tier(rng.Intn(2))
			ttl := time.Duration(0)
			if rng.Intn(2) == 0 {
				ttl = time.Duration(1+rng.Intn(20)) * time.Second
			}
			x.Store(w, hs, tier, ttl)
			m.store(w, hs, tier, ttl)
		case op < 65:
			hs := prompt()
			tier := kv.Tier(rng.Intn(2))
			all := rng.Intn(3) == 0
			if all {
				x.Remove(w, hs, AllTiers)
			} else {
				x.Remove(w, hs, tier)
			}
			for _, h := range hs {
				k := modelKey{h, w}
				if e, ok := m.entries[k]; ok {
					if all {
						e.tiers = 0
					} else {
						e.tiers &^= 1 << tier
					}
					if e.tiers == 0 {
						delete(m.entries, k)
					} else {
						m.entries[k] = e
					}
				}
			}
		case op < 66:
			x.ClearWorker(w)
			for k := range m.entries {
				if k.w == w {
					delete(m.entries, k)
				}
			}
		case op < 67:
			x.Sweep()
		case op < 72:
			c.Advance(time.Duration(rng.Intn(3)) * time.Second) // whole seconds: the index rounds expiry up to one
		default:
			hs := prompt()
			buf = x.Match(hs, buf)
			got := depths(buf)
			for v := WorkerID(0); v < workers; v++ {
				d, dev := m.match(hs, v)
				if got[v].Depth != d || (d > 0 && got[v].Tiers[kv.TierDevice] != dev) {
					t.Fatalf("seed %d step %d worker %d: index %+v, model depth %d device %d", seed, step, v, got[v], d, dev)
				}
			}
		}
	}
	// Counts agree once expired entries are swept from both.
	x.Sweep()
	n, per := 0, make([]int, workers)
	for k := range m.entries {
		if _, ok := m.live(k); ok {
			n++
			per[k.w]++
		}
	}
	if x.Len() != n {
		t.Fatalf("len %d, model %d", x.Len(), n)
	}
	for v := range per {
		if x.WorkerBlocks(WorkerID(v)) != per[v] {
			t.Fatalf("worker %d: %d blocks, model %d", v, x.WorkerBlocks(WorkerID(v)), per[v])
		}
	}
}
