package mockengine

import (
	"maps"
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
	findable := 0
	c.index.each(func(h kv.BlockHash, b int32) {
		if got, ok := c.index.get(h); !ok || got != b {
			t.Fatalf("index entry %x not found by get", h)
		}
		for ; b != noBlock; b = c.blocks[b].copy {
			if c.blocks[b].hash != h || !c.blocks[b].cached {
				t.Fatalf("index %x → block %d holding %x (cached %v)", h, b, c.blocks[b].hash, c.blocks[b].cached)
			}
			if findable++; findable > len(c.blocks) {
				t.Fatalf("index %x: a cycle in its copies", h)
			}
		}
	})
	cached := 0
	for i := range c.blocks {
		if c.blocks[i].cached {
			cached++
		}
	}
	if cached != findable || (!c.copies && cached != c.index.len()) {
		t.Fatalf("%d cached blocks, %d findable, %d indexed (copies kept: %v)", cached, findable, c.index.len(), c.copies)
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
// its events describe the cache exactly: each block once, or, with copies
// kept (vLLM), each copy.
func TestInvariantsUnderChurn(t *testing.T) {
	for _, tc := range []struct {
		host   int
		copies bool
	}{{0, false}, {24, false}, {0, true}, {24, true}} {
		host := tc.host
		m := NewModel(ModelConfig{BlockSize: 8, CacheBlocks: 64, HostCacheBlocks: host, MaxNumSeqs: 6, MaxNumBatchedTokens: 96, RecordEvents: true, DuplicateBlocks: tc.copies})
		r := rand.New(rand.NewPCG(7, uint64(host)))
		prefixes := [][]uint32{toks(40, 1), toks(64, 2), toks(24, 3)}
		var live []*Seq
		mirror := map[kv.Tier]map[uint64]int{kv.TierDevice: {}, kv.TierHost: {}}
		copiesSeen := 0
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
						if seen[h] > 0 && (!tc.copies || e.Tier != kv.TierDevice) {
							t.Fatalf("step %d: %v block %x stored twice", step, e.Tier, h)
						}
						if seen[h] > 0 {
							copiesSeen++
						}
						seen[h]++
					case kv.BlockRemoved:
						if seen[h] == 0 {
							t.Fatalf("step %d: %v block %x removed but never stored", step, e.Tier, h)
						}
						if seen[h]--; seen[h] == 0 {
							delete(seen, h)
						}
					}
				}
			}
			checkInvariants(t, m)
		}
		// The event stream alone rebuilds exactly what the engine holds,
		// copy for copy.
		res := m.AppendResident(nil)
		held := map[kv.Tier]map[uint64]int{kv.TierDevice: {}, kv.TierHost: {}}
		for _, b := range res {
			held[b.Tier][uint64(b.EngineHash)]++
		}
		for tier, set := range mirror {
			if !maps.Equal(set, held[tier]) {
				t.Fatalf("%+v: the events announce %d %v blocks, %d resident, or other copies", tc, len(set), tier, len(held[tier]))
			}
		}
		if cs := m.Counters().Copies; tc.copies != (copiesSeen > 0) || cs != uint64(copiesSeen) {
			t.Fatalf("%+v: %d copies announced, %d counted", tc, copiesSeen, cs)
		}
		for _, s := range live {
			m.Abort(s)
		}
		checkInvariants(t, m)
		if m.Usage() != 0 || !m.Idle() {
			t.Fatalf("%+v: leaked: usage %v idle %v", tc, m.Usage(), m.Idle())
		}
		c := m.Counters()
		if c.Preemptions == 0 || c.PrefixHits == 0 || (host > 0 && c.HostHits == 0) {
			t.Fatalf("%+v: the workload must exercise preemption and hits: %+v", tc, c)
		}
	}
}
