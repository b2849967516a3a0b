package router

import (
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

// The table halves once deletions leave it under 1/8 full, whichever way
// they came (an engine's entries cleared, removed by events, expired and
// swept, or swept as stores go on), and what stays still matches.
func TestMemIndexShrinksAfterDeletions(t *testing.T) {
	const n = 100_000
	chain := func(from, count int) []kv.BlockHash {
		hs := make([]kv.BlockHash, count)
		for i := range hs {
			hs[i] = kv.BlockHash(from + i + 1)
		}
		return hs
	}
	clock := time.Unix(1000, 0)
	now := func() time.Time { return clock }
	for name, drop := range map[string]func(x *MemIndex){
		"cleared": func(x *MemIndex) { x.ClearWorker(1) },
		"removed": func(x *MemIndex) { x.Remove(1, chain(0, n), kv.NumTiers) },
		"expired and swept": func(x *MemIndex) {
			clock = clock.Add(time.Hour)
			x.Sweep()
		},
		"expired as stores go on": func(x *MemIndex) {
			clock = clock.Add(time.Hour)
			for i := range n / 4 {
				x.Store(2, chain(10*n+i*8, 8), kv.TierDevice, 0)
				x.Remove(2, chain(10*n+i*8, 8), kv.NumTiers)
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			x := NewMemIndex(MemIndexConfig{Now: now})
			keep := chain(5*n, 40)
			x.Store(0, keep, kv.TierDevice, 0)
			x.Store(1, chain(0, n), kv.TierDevice, time.Minute)
			peak := len(x.slots)
			drop(x)
			if x.Len() != len(keep) || len(x.slots) > minSlots {
				t.Fatalf("%d entries in %d slots (%d at the peak); want %d in %d", x.Len(), len(x.slots), peak, len(keep), minSlots)
			}
			if m := x.Match(keep, nil); len(m) != 1 || m[0].Worker != 0 || m[0].Depth != int32(len(keep)) {
				t.Fatalf("after the shrink, the kept chain matches %+v", m)
			}
			x.Store(1, chain(0, n), kv.TierDevice, 0) // grows again
			if m := x.Match(chain(0, n), nil); x.Len() != n+len(keep) || len(m) != 1 || m[0].Depth != n {
				t.Fatalf("after growing again: %d entries, match %+v", x.Len(), m)
			}
		})
	}
}

// A Store or Remove of a large event lets lookups in between its parts: an
// engine event of 2M blocks held the write lock 287 ms in one go, and
// every routing decision with it (the twenty-ninth session's review). A
// reader blocked meanwhile gets the lock at the next part, so it sees the
// event part stored (or part removed).
func TestLargeStoreLetsLookupsIn(t *testing.T) {
	const n = 1 << 20
	x := NewMemIndex(MemIndexConfig{})
	hs := make([]kv.BlockHash, n)
	for i := range hs {
		hs[i] = kv.BlockHash(uint64(i)*0x9e3779b97f4a7c15 + 1)
	}
	for _, op := range []struct {
		name string
		run  func()
		want int
	}{
		{"Store", func() { x.Store(1, hs, kv.TierDevice, 0) }, n},
		{"Remove", func() { x.Remove(1, hs, kv.TierDevice) }, 0},
	} {
		done := make(chan struct{})
		go func() { defer close(done); op.run() }()
		partial := false
		for running := true; running; {
			select {
			case <-done:
				running = false
			default:
			}
			if l := x.Len(); l > 0 && l < n {
				partial = true
			}
		}
		if l := x.Len(); l != op.want || !partial {
			t.Fatalf("%s: %d entries after it, want %d; a lookup saw it in part: %v", op.name, l, op.want, partial)
		}
	}
}
