package router

import (
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

// fakeClock is a settable clock for TTL tests.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// indexFactory builds an empty Index with a bound (0 = none) and a clock.
type indexFactory func(maxEntries int, now func() time.Time) Index

var indexImpls = map[string]indexFactory{
	"MemIndex": func(maxEntries int, now func() time.Time) Index {
		return NewMemIndex(MemIndexConfig{MaxEntries: maxEntries, Now: now})
	},
}

func seq(n int, salt uint64) []kv.BlockHash {
	h := make([]kv.BlockHash, n)
	for i := range h {
		h[i] = kv.BlockHash(mix64(salt<<20 | uint64(i)))
	}
	return h
}

func depths(ov []Overlap) map[WorkerID]Overlap {
	m := make(map[WorkerID]Overlap, len(ov))
	for _, o := range ov {
		m[o.Worker] = o
	}
	return m
}

func TestIndexSuite(t *testing.T) {
	for name, mk := range indexImpls {
		t.Run(name, func(t *testing.T) { runIndexSuite(t, mk) })
	}
}

func runIndexSuite(t *testing.T, mk indexFactory) {
	t.Run("StoredPrefixMatches", func(t *testing.T) {
		x := mk(0, nil)
		h := seq(10, 1)
		x.Store(1, h[:6], kv.TierDevice, 0)
		x.Store(2, h[:3], kv.TierDevice, 0)
		m := depths(x.Match(h, nil))
		if len(m) != 2 || m[1].Depth != 6 || m[2].Depth != 3 {
			t.Fatalf("match = %+v, want w1:6 w2:3", m)
		}
		if m[1].Tiers[kv.TierDevice] != 6 {
			t.Fatalf("tiers = %v, want 6 device", m[1].Tiers)
		}
		if got := x.Match(seq(4, 99), nil); len(got) != 0 {
			t.Fatalf("unrelated prompt matched %+v", got)
		}
	})
	t.Run("MatchIsLeadingPrefixOnly", func(t *testing.T) {
		x := mk(0, nil)
		h := seq(8, 2)
		x.Store(1, h[:3], kv.TierDevice, 0)
		x.Store(1, h[4:], kv.TierDevice, 0) // a gap at block 3
		x.Store(2, h[1:], kv.TierDevice, 0) // no block 0: no match at all
		m := depths(x.Match(h, nil))
		if len(m) != 1 || m[1].Depth != 3 {
			t.Fatalf("match = %+v, want only w1:3", m)
		}
	})
	t.Run("RemovedBlockStopsMatching", func(t *testing.T) {
		x := mk(0, nil)
		h := seq(6, 3)
		x.Store(1, h, kv.TierDevice, 0)
		x.Store(2, h, kv.TierDevice, 0)
		x.Remove(1, h[2:3], AllTiers)
		m := depths(x.Match(h, nil))
		if m[1].Depth != 2 || m[2].Depth != 6 {
			t.Fatalf("match = %+v, want w1:2 w2:6", m)
		}
		if x.Len() != 11 || x.WorkerBlocks(1) != 5 {
			t.Fatalf("len %d, w1 %d; want 11, 5", x.Len(), x.WorkerBlocks(1))
		}
		x.Remove(1, seq(3, 77), AllTiers) // unknown hashes are ignored
		x.Remove(3, h, AllTiers)          // unknown worker too
		if x.Len() != 11 {
			t.Fatalf("len %d after no-op removes", x.Len())
		}
	})
	t.Run("TierRemovalKeepsOtherTier", func(t *testing.T) {
		x := mk(0, nil)
		h := seq(4, 4)
		x.Store(1, h, kv.TierDevice, 0)
		x.Store(1, h[2:], kv.TierHost, 0) // offloaded copy
		x.Remove(1, h[2:], kv.TierDevice) // evicted from the GPU
		o := depths(x.Match(h, nil))[1]
		if o.Depth != 4 || o.Tiers[kv.TierDevice] != 2 || o.Tiers[kv.TierHost] != 2 {
			t.Fatalf("overlap %+v, want depth 4 = 2 device + 2 host", o)
		}
		if x.Len() != 4 {
			t.Fatalf("len %d, want 4 (one entry per block and worker)", x.Len())
		}
		x.Remove(1, h[3:], kv.TierHost)
		if o := depths(x.Match(h, nil))[1]; o.Depth != 3 {
			t.Fatalf("depth %d after host removal, want 3", o.Depth)
		}
	})
	t.Run("WorkerRestartClearsEntries", func(t *testing.T) {
		x := mk(0, nil)
		h := seq(5, 5)
		x.Store(1, h, kv.TierDevice, 0)
		x.Store(2, h, kv.TierHost, 0)
		x.ClearWorker(1)
		m := depths(x.Match(h, nil))
		if _, ok := m[1]; ok || m[2].Depth != 5 {
			t.Fatalf("match = %+v after clearing w1", m)
		}
		if x.WorkerBlocks(1) != 0 || x.Len() != 5 {
			t.Fatalf("w1 %d len %d, want 0 and 5", x.WorkerBlocks(1), x.Len())
		}
		x.Store(1, h[:2], kv.TierDevice, 0) // rebuilds after restart
		if depths(x.Match(h, nil))[1].Depth != 2 {
			t.Fatal("entries did not rebuild after clear")
		}
	})
	t.Run("ExpiredEntriesStopMatching", func(t *testing.T) {
		c := newFakeClock()
		x := mk(0, c.Now)
		h := seq(4, 6)
		x.Store(1, h, kv.TierDevice, 10*time.Second)
		x.Store(2, h, kv.TierDevice, 0) // event mode: never expires
		c.Advance(9 * time.Second)
		if m := depths(x.Match(h, nil)); m[1].Depth != 4 {
			t.Fatalf("expired too early: %+v", m)
		}
		c.Advance(2 * time.Second)
		m := depths(x.Match(h, nil))
		if _, ok := m[1]; ok || m[2].Depth != 4 {
			t.Fatalf("match = %+v after ttl, want only w2", m)
		}
		if s, ok := x.(interface{ Sweep() int }); ok {
			if n := s.Sweep(); n != 4 || x.Len() != 4 {
				t.Fatalf("sweep dropped %d, len %d; want 4, 4", n, x.Len())
			}
		}
	})
	t.Run("StoreRefreshesTTL", func(t *testing.T) {
		c := newFakeClock()
		x := mk(0, c.Now)
		h := seq(3, 7)
		x.Store(1, h, kv.TierDevice, 10*time.Second)
		c.Advance(8 * time.Second)
		x.Store(1, h[:2], kv.TierDevice, 10*time.Second) // the next turn reuses the prefix
		c.Advance(8 * time.Second)
		if d := depths(x.Match(h, nil))[1].Depth; d != 2 {
			t.Fatalf("depth %d, want 2 (refreshed) ", d)
		}
	})
	t.Run("ExpiredEntryRestoredStartsAfresh", func(t *testing.T) {
		c := newFakeClock()
		x := mk(0, c.Now)
		h := seq(2, 8)
		x.Store(1, h, kv.TierHost, time.Second)
		c.Advance(5 * time.Second)
		x.Store(1, h, kv.TierDevice, 10*time.Second)
		o := depths(x.Match(h, nil))[1]
		if o.Depth != 2 || o.Tiers[kv.TierDevice] != 2 {
			t.Fatalf("overlap %+v, want 2 device blocks", o)
		}
	})
	t.Run("LRUPruneKeepsBound", func(t *testing.T) {
		x := mk(100, nil)
		old := seq(60, 9)
		x.Store(1, old, kv.TierDevice, 0)
		x.Store(1, old[:10], kv.TierDevice, 0) // touched again: most recent
		fresh := seq(60, 10)
		x.Store(2, fresh, kv.TierDevice, 0)
		if x.Len() != 100 {
			t.Fatalf("len %d, want the bound 100", x.Len())
		}
		// Pruning is (approximately) least recently stored first: the newest
		// prompt is whole, and the old prompt keeps at least its refreshed
		// head, losing its tail.
		if d := depths(x.Match(fresh, nil))[2].Depth; d != 60 {
			t.Fatalf("newest prompt depth %d, want 60", d)
		}
		if d := depths(x.Match(old, nil))[1].Depth; d < 10 || d > 40 {
			t.Fatalf("old prompt depth %d, want its refreshed head (10) kept and 20 tail blocks gone", d)
		}
		for i := 0; i < 50; i++ { // a long churn stays at the bound
			x.Store(WorkerID(i%3), seq(30, uint64(100+i)), kv.TierDevice, 0)
			if x.Len() != 100 {
				t.Fatalf("len %d during churn", x.Len())
			}
		}
		if d := depths(x.Match(seq(30, 149), nil))[49%3].Depth; d != 30 {
			t.Fatalf("latest prompt depth %d after churn, want 30", d)
		}
		if x.WorkerBlocks(0)+x.WorkerBlocks(1)+x.WorkerBlocks(2) != 100 {
			t.Fatalf("worker blocks %d+%d+%d != 100", x.WorkerBlocks(0), x.WorkerBlocks(1), x.WorkerBlocks(2))
		}
	})
	t.Run("ManyWorkers", func(t *testing.T) {
		x := mk(0, nil)
		h := seq(8, 11)
		for w := WorkerID(0); w < 200; w++ {
			x.Store(w, h[:1+int(w)%8], kv.TierDevice, 0)
		}
		m := depths(x.Match(h, nil))
		if len(m) != 200 {
			t.Fatalf("%d workers matched, want 200", len(m))
		}
		for w := WorkerID(0); w < 200; w++ {
			if m[w].Depth != int32(1+int(w)%8) {
				t.Fatalf("worker %d depth %d, want %d", w, m[w].Depth, 1+int(w)%8)
			}
		}
	})
	t.Run("ConcurrentStoreRemoveMatch", func(t *testing.T) {
		x := mk(5000, nil)
		var wg sync.WaitGroup
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				var buf []Overlap
				for i := 0; i < 300; i++ {
					h := seq(32, uint64(i%20))
					w := WorkerID((g + i) % 6)
					switch i % 3 {
					case 0:
						x.Store(w, h, kv.TierDevice, time.Minute)
					case 1:
						x.Remove(w, h[16:], AllTiers)
					default:
						buf = x.Match(h, buf)
						for _, o := range buf {
							if o.Depth < 1 || o.Depth > 32 {
								t.Errorf("depth %d out of range", o.Depth)
							}
						}
					}
				}
			}(g)
		}
		wg.Wait()
		if x.Len() > 5000 {
			t.Fatalf("len %d over the bound", x.Len())
		}
	})
}
