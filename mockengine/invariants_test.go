package mockengine

import (
	"math/rand/v2"
	"testing"

	"github.com/kvproxy/kvproxy/kv"
)

// checkInvariants verifies the cache's books: every block is exactly one of
// referenced, cached-and-evictable (on the LRU), or free; the index points at
// blocks holding its hashes; the host tier's index matches its entries.
func checkInvariants(t *testing.T, m *Model) {
	t.Helper()
	c := m.cache
	used, lru, free := 0, 0, 0
	for i := range c.blocks {
		b := &c.blocks[i]
		switch {
		case b.ref > 0:
			used++
		case b.cached:
			lru++
		default:
			free++
		}
		if b.ref < 0 {
			t.Fatalf("block %d has ref %d", i, b.ref)
		}
	}
	if used != c.used || lru != c.nLRU || free != len(c.free) || used+lru+free != len(c.blocks) {
		t.Fatalf("books: used %d/%d lru %d/%d free %d/%d", used, c.used, lru, c.nLRU, free, len(c.free))
	}
	n := 0
	for b := c.head; b != noBlock; b = c.blocks[b].next {
		if c.blocks[b].ref != 0 || !c.blocks[b].cached {
			t.Fatalf("LRU holds block %d with ref %d cached %v", b, c.blocks[b].ref, c.blocks[b].cached)
		}
		n++
	}
	if n != c.nLRU {
		t.Fatalf("LRU walk %d, count %d", n, c.nLRU)
	}
	c.index.each(func(h kv.BlockHash, b int32) {
		if c.blocks[b].hash != h || !c.blocks[b].cached {
			t.Fatalf("index %x → block %d holding %x", h, b, c.blocks[b].hash)
		}
		if got, ok := c.index.get(h); !ok || got != b {
			t.Fatalf("index entry %x not found by get", h)
		}
	})
	cached := 0
	for i := range c.blocks {
		if c.blocks[i].cached {
			cached++
		}
	}
	if cached != c.index.len() {
		t.Fatalf("%d cached blocks, %d indexed", cached, c.index.len())
	}
	refs := make(map[int32]int32)
	for _, s := range m.running {
		for _, b := range s.blocks {
			refs[b]++
		}
	}
	for b, r := range refs {
		if c.blocks[b].ref != r {
			t.Fatalf("block %d: ref %d, held by %d running sequences", b, c.blocks[b].ref, r)
		}
	}
	if len(refs) != c.used {
		t.Fatalf("%d blocks held by running sequences, %d counted used", len(refs), c.used)
	}
	if h := m.host; h != nil {
		if h.index.len() != h.n {
			t.Fatalf("host: %d indexed, %d entries", h.index.len(), h.n)
		}
		h.index.each(func(k kv.BlockHash, i int32) {
			if h.entries[i].hash != k {
				t.Fatalf("host index %x → entry holding %x", k, h.entries[i].hash)
			}
			if got, ok := h.index.get(k); !ok || got != i {
				t.Fatalf("host index entry %x not found by get", k)
			}
		})
	}
}

// A random workload with shared prefixes, aborts, preemption and both tiers
// keeps the books straight after every step, leaks nothing at the end, and
// its events describe the cache exactly.
func TestInvariantsUnderChurn(t *testing.T) {
	for _, host := range []int{0, 24} {
		m := NewModel(ModelConfig{BlockSize: 8, CacheBlocks: 64, HostCacheBlocks: host, MaxNumSeqs: 6, MaxNumBatchedTokens: 96, RecordEvents: true})
		r := rand.New(rand.NewPCG(7, uint64(host)))
		prefixes := [][]uint32{toks(40, 1), toks(64, 2), toks(24, 3)}
		var live []*Seq
		mirror := map[kv.Tier]map[uint64]bool{kv.TierDevice: {}, kv.TierHost: {}}
		for step := 0; step < 5000; step++ {
			if r.IntN(2) == 0 {
				p := append([]uint32(nil), prefixes[r.IntN(len(prefixes))]...)
				p = append(p, toks(r.IntN(120), uint32(100+step))...)
				s := &Seq{ID: uint64(step), Prompt: p, MaxTokens: 1 + r.IntN(60)}
				if r.IntN(4) == 0 {
					s.Salt = "s"
				}
				if m.Add(s) == nil {
					live = append(live, s)
				}
			}
			if len(live) > 0 && r.IntN(15) == 0 {
				m.Abort(live[r.IntN(len(live))])
			}
			m.Step()
			for _, e := range m.DrainEvents(nil) {
				seen := mirror[e.Tier]
				for _, h := range e.EngineHashes {
					switch e.Kind {
					case kv.BlockStored:
						if seen[h] {
							t.Fatalf("step %d: %v block %x stored twice", step, e.Tier, h)
						}
						seen[h] = true
					case kv.BlockRemoved:
						if !seen[h] {
							t.Fatalf("step %d: %v block %x removed but never stored", step, e.Tier, h)
						}
						delete(seen, h)
					}
				}
			}
			checkInvariants(t, m)
		}
		// The event stream alone rebuilds exactly what the engine holds.
		res := m.AppendResident(nil)
		n := 0
		for _, b := range res {
			if !mirror[b.Tier][uint64(b.EngineHash)] {
				t.Fatalf("host %d: resident %v block %x never announced", host, b.Tier, b.EngineHash)
			}
		}
		for _, set := range mirror {
			n += len(set)
		}
		if n != len(res) {
			t.Fatalf("host %d: events announce %d blocks, %d resident", host, n, len(res))
		}
		for _, s := range live {
			m.Abort(s)
		}
		checkInvariants(t, m)
		if m.Usage() != 0 || !m.Idle() {
			t.Fatalf("host %d: leaked: usage %v idle %v", host, m.Usage(), m.Idle())
		}
		c := m.Counters()
		if c.Preemptions == 0 || c.PrefixHits == 0 || (host > 0 && c.HostHits == 0) {
			t.Fatalf("host %d: the workload must exercise preemption and hits: %+v", host, c)
		}
	}
}
