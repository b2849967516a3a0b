package backends

import (
	"math/bits"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

func newRouter(t testing.TB) *router.Router {
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func tokens(n int, base uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = base + uint32(i)*7
	}
	return t
}

// depth is how many leading blocks of tokens worker name holds, and in which tiers.
func depth(t *testing.T, r *router.Router, name string, toks []uint32, ns kv.Namespace) (int, [kv.NumTiers]int32) {
	t.Helper()
	id, ok := r.WorkerByName(name)
	if !ok {
		t.Fatalf("no worker %q", name)
	}
	for _, o := range r.Index().Match(kv.HashBlocks(nil, toks, 16, ns), nil) {
		if o.Worker == id {
			return int(o.Depth), o.Tiers
		}
	}
	return 0, [kv.NumTiers]int32{}
}

func stored(hashes []uint64, parent *uint64, toks []uint32, tier kv.Tier) kv.Event {
	ev := kv.Event{Kind: kv.BlockStored, EngineHashes: hashes, Tokens: toks, BlockSize: 16, Tier: tier}
	if parent != nil {
		ev.HasParent, ev.EngineParent = true, *parent
	}
	return ev
}

func ptr(v uint64) *uint64 { return &v }

func TestKVApplyStoredChainMatches(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "gpu-0"}, r)
	toks := tokens(80, 1)
	// Two events: blocks 0-2, then 3-4 chained on engine hash 12.
	a.ApplyEvents(0, []kv.Event{stored([]uint64{10, 11, 12}, nil, toks[:48], kv.TierDevice)})
	if d, _ := depth(t, r, "gpu-0", toks, 0); d != 3 {
		t.Fatalf("depth after first event: %d", d)
	}
	a.ApplyEvents(0, []kv.Event{stored([]uint64{13, 14}, ptr(12), toks[48:], kv.TierDevice)})
	if d, tiers := depth(t, r, "gpu-0", toks, 0); d != 5 || tiers[kv.TierDevice] != 5 {
		t.Fatalf("depth after child event: %d %v", d, tiers)
	}
	// A different continuation of block 1 shares blocks 0-1 only.
	other := append(append([]uint32(nil), toks[:32]...), tokens(16, 9999)...)
	a.ApplyEvents(0, []kv.Event{stored([]uint64{20}, ptr(11), other[32:], kv.TierDevice)})
	if d, _ := depth(t, r, "gpu-0", other, 0); d != 3 {
		t.Fatalf("branch depth %d", d)
	}
	if s := a.Stats(); s.StoredBlocks != 6 || s.Blocks[kv.TierDevice] != 6 || s.Workers != 1 {
		t.Fatalf("stats %+v", s)
	}
	// The worker is in event mode: routing commits do not add entries.
	if ws := r.Workers(); len(ws) != 1 {
		t.Fatalf("workers %+v", ws)
	}
}

func TestKVApplyRemovedStopsMatching(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "b"}, r)
	toks := tokens(64, 5)
	a.ApplyEvents(0, []kv.Event{stored([]uint64{1, 2, 3, 4}, nil, toks, kv.TierDevice)})
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{3, 4, 99}}})
	if d, _ := depth(t, r, "b", toks, 0); d != 2 {
		t.Fatalf("depth %d", d)
	}
	s := a.Stats()
	if s.RemovedBlocks != 2 || s.UnknownRemovals != 1 || s.Blocks[kv.TierDevice] != 2 || r.Index().Len() != 2 {
		t.Fatalf("stats %+v len %d", s, r.Index().Len())
	}
	// A removed parent is unknown: its child cannot be placed.
	a.ApplyEvents(0, []kv.Event{stored([]uint64{5}, ptr(4), tokens(16, 0), kv.TierDevice)})
	if s := a.Stats(); s.OrphanBlocks != 1 || r.Index().Len() != 2 {
		t.Fatalf("orphan: stats %+v len %d", s, r.Index().Len())
	}
}

// Unknown parent: the event is dropped and the index is untouched.
func TestKVApplyOrphanDropped(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "b"}, r)
	toks := tokens(32, 0)
	a.ApplyEvents(0, []kv.Event{stored([]uint64{7, 8}, ptr(12345), toks, kv.TierDevice)})
	if r.Index().Len() != 0 || a.Stats().OrphanBlocks != 2 {
		t.Fatalf("len %d stats %+v", r.Index().Len(), a.Stats())
	}
	// Its hashes are unknown to later removals too.
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{7}}})
	if a.Stats().UnknownRemovals != 1 {
		t.Fatalf("stats %+v", a.Stats())
	}
}

// A block offloaded to CPU and then evicted from GPU still matches, in host.
func TestKVApplyTiers(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "b"}, r)
	toks := tokens(32, 3)
	a.ApplyEvents(0, []kv.Event{
		stored([]uint64{1, 2}, nil, toks, kv.TierDevice),
		stored([]uint64{1, 2}, nil, toks, kv.TierHost),
		{Kind: kv.BlockRemoved, EngineHashes: []uint64{2}, Tier: kv.TierDevice},
	})
	d, tiers := depth(t, r, "b", toks, 0)
	if d != 2 || tiers[kv.TierDevice] != 1 || tiers[kv.TierHost] != 1 {
		t.Fatalf("depth %d tiers %v", d, tiers)
	}
	if s := a.Stats(); s.Blocks[kv.TierDevice] != 1 || s.Blocks[kv.TierHost] != 2 {
		t.Fatalf("stats %+v", s)
	}
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{2}, Tier: kv.TierHost}})
	if d, _ := depth(t, r, "b", toks, 0); d != 1 {
		t.Fatalf("depth after host removal %d", d)
	}
	// A shared cache layer indexes everything in tier shared.
	s := NewKVApplier(KVApplierConfig{Backend: "lmcache", Shared: true}, r)
	s.ApplyEvents(0, []kv.Event{stored([]uint64{1}, nil, toks[:16], kv.TierHost)})
	if _, tiers := depth(t, r, "lmcache", toks, 0); tiers[kv.TierShared] != 1 {
		t.Fatalf("shared tiers %v", tiers)
	}
}

func TestKVApplyLoRANamespace(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "b"}, r)
	toks := tokens(32, 0)
	ev := stored([]uint64{1, 2}, nil, toks, kv.TierDevice)
	ev.LoRAName = "sql"
	a.ApplyEvents(0, []kv.Event{ev})
	if d, _ := depth(t, r, "b", toks, kv.RequestNamespace("", "sql")); d != 2 {
		t.Fatalf("lora depth %d", d)
	}
	if d, _ := depth(t, r, "b", toks, kv.NewNamespace("sql")); d != 0 {
		t.Fatalf("a cache salt named like the adapter must not match its blocks, depth %d", d)
	}
	if d, _ := depth(t, r, "b", toks, 0); d != 0 {
		t.Fatalf("base model must not match LoRA blocks, depth %d", d)
	}
}

func TestKVApplyRanksClearsAndBlockSize(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "b"}, r)
	toks := tokens(32, 0)
	a.ApplyEvents(0, []kv.Event{stored([]uint64{1, 2}, nil, toks, kv.TierDevice)})
	a.ApplyEvents(1, []kv.Event{stored([]uint64{1}, nil, toks[:16], kv.TierDevice)})
	if d, _ := depth(t, r, "b#1", toks, 0); d != 1 {
		t.Fatalf("rank 1 depth %d", d)
	}
	if d, _ := depth(t, r, "b", toks, 0); d != 2 {
		t.Fatalf("rank 0 depth %d", d)
	}
	if len(a.WorkerIDs()) != 2 {
		t.Fatal("two workers expected")
	}
	// AllBlocksCleared clears only its rank.
	a.ApplyEvents(1, []kv.Event{{Kind: kv.AllBlocksCleared}})
	if d, _ := depth(t, r, "b#1", toks, 0); d != 0 {
		t.Fatalf("rank 1 after clear %d", d)
	}
	if d, _ := depth(t, r, "b", toks, 0); d != 2 {
		t.Fatalf("rank 0 after rank 1 clear %d", d)
	}
	// ClearRanks clears the ranks named (one feed per rank in vLLM).
	a.ApplyEvents(1, []kv.Event{stored([]uint64{1}, nil, toks[:16], kv.TierDevice)})
	a.ClearRanks([]int{1, 7})
	if d, _ := depth(t, r, "b#1", toks, 0); d != 0 {
		t.Fatalf("rank 1 after ClearRanks %d", d)
	}
	if d, _ := depth(t, r, "b", toks, 0); d != 2 {
		t.Fatalf("rank 0 after ClearRanks([1]) %d", d)
	}
	// Clear (backend removed) clears every rank.
	a.ApplyEvents(1, []kv.Event{stored([]uint64{1}, nil, toks[:16], kv.TierDevice)})
	a.Clear()
	if r.Index().Len() != 0 {
		t.Fatalf("index holds %d entries after Clear", r.Index().Len())
	}
	if s := a.Stats(); s.Blocks != [kv.NumTiers]int64{} || s.Clears != 4 {
		t.Fatalf("stats %+v", s)
	}
	// A block size the router does not use cannot be re-hashed.
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockStored, EngineHashes: []uint64{1}, Tokens: toks, BlockSize: 32}})
	a.ApplyEvents(MaxDPRank+1, []kv.Event{stored([]uint64{1}, nil, toks[:16], kv.TierDevice)})
	if s := a.Stats(); s.BlockSizeMismatch != 1 || s.BadRank != 1 || r.Index().Len() != 0 {
		t.Fatalf("stats %+v", s)
	}
}

// End to end over real sockets: an engine publishes vLLM events, the
// subscriber decodes them, the applier indexes them; a restart empties the
// worker's entries.
func TestKVEventsEndToEnd(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "e2e"}, r)
	eng := newTestEngine(t, 1000)
	f := startSubSink(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()}, a)
	f.warmUp() // removals of unknown blocks: no effect
	toks := tokens(64, 11)
	eng.publish(0, stored([]uint64{1, 2}, nil, toks[:32], kv.TierDevice))
	eng.publish(0, stored([]uint64{3, 4}, ptr(2), toks[32:], kv.TierDevice))
	last := int64(eng.next - 1)
	f.wait("stored", func(s ZMQStats) bool { return s.LastSeq == last })
	if d, _ := depth(t, r, "e2e", toks, 0); d != 4 {
		t.Fatalf("depth %d", d)
	}
	eng.restart()
	eng.publish(0, removed(1))
	f.wait("restart", func(s ZMQStats) bool { return s.Clears == 1 && s.LastSeq == 0 })
	if d, _ := depth(t, r, "e2e", toks, 0); d != 0 || r.Index().Len() != 0 {
		t.Fatalf("after restart: depth %d len %d", d, r.Index().Len())
	}
}

// BenchmarkKVApply measures block events applied per second on one core:
// each op applies one batch of 8 events of 4 blocks (32 block events) —
// stores of fresh chains, and the removal of the chain stored 64 batches
// earlier, so the index stays at a steady size. Re-hashing and the router's
// in-memory index are included.
func BenchmarkKVApply(b *testing.B) {
	r := newRouter(b)
	a := NewKVApplier(KVApplierConfig{Backend: "bench"}, r)
	const ring = 64
	type batch struct{ store, remove []kv.Event }
	batches := make([]batch, ring)
	for i := range batches {
		var st, rm []kv.Event
		for e := 0; e < 4; e++ {
			base := uint64(i*1000 + e*10)
			hs := []uint64{base, base + 1, base + 2, base + 3}
			st = append(st, kv.Event{Kind: kv.BlockStored, EngineHashes: hs, Tokens: tokens(64, uint32(base)), BlockSize: 16})
			rm = append(rm, kv.Event{Kind: kv.BlockRemoved, EngineHashes: hs})
		}
		batches[i] = batch{st, rm}
	}
	for i := range batches { // steady state: every chain resident once
		a.ApplyEvents(0, batches[i].store)
	}
	evs := make([]kv.Event, 0, 8)
	b.ReportAllocs()
	cpu0 := cpuTime()
	for i := 0; b.Loop(); i++ {
		bt := &batches[i%ring]
		evs = append(append(evs[:0], bt.remove...), bt.store...)
		a.ApplyEvents(0, evs)
	}
	b.ReportMetric(float64(b.N)*32/b.Elapsed().Seconds(), "blockevents/s")
	// On a shared, loaded machine wall time overstates the cost; CPU time
	// consumed by the process is the fairer per-core figure.
	b.ReportMetric(float64(b.N)*32/(cpuTime()-cpu0).Seconds(), "blockevents/cpu-s")
}

// BenchmarkKVApplyMemory reports heap bytes per resident block in event
// mode: the router's index entry plus the applier's engine-hash map, for
// 2^18 blocks (one worker), measured after GC.
func BenchmarkKVApplyMemory(b *testing.B) {
	const blocks = 1 << 18
	var evs []kv.Event
	for i := 0; i < blocks/16; i++ {
		hs := make([]uint64, 16)
		for j := range hs {
			hs[j] = uint64(i*16 + j)
		}
		evs = append(evs, kv.Event{Kind: kv.BlockStored, EngineHashes: hs, Tokens: tokens(256, uint32(i)*1000), BlockSize: 16})
	}
	b.ReportAllocs()
	var perBlock float64
	for i := 0; i < b.N; i++ {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		r := newRouter(b)
		a := NewKVApplier(KVApplierConfig{Backend: "mem"}, r)
		a.ApplyEvents(0, evs)
		runtime.GC()
		runtime.ReadMemStats(&after)
		if r.Index().Len() != blocks {
			b.Fatalf("index holds %d", r.Index().Len())
		}
		perBlock = float64(after.HeapAlloc-before.HeapAlloc) / blocks
		runtime.KeepAlive(a)
	}
	b.ReportMetric(perBlock, "bytes/block")
}

// BenchmarkDecodeAndApply is the subscriber's per-batch work minus the
// socket: decode a vLLM msgpack payload (array encoding) and apply it. Each
// payload holds 4 BlockRemoved and 4 BlockStored events of 4 blocks (16
// tokens each): 32 block events.
func BenchmarkDecodeAndApply(b *testing.B) {
	r := newRouter(b)
	a := NewKVApplier(KVApplierConfig{Backend: "bench"}, r)
	const ring = 64
	payloads := make([][]byte, ring)
	var first []kv.Event
	for i := range payloads {
		var evs []kv.Event
		for e := 0; e < 4; e++ {
			base := uint64(i*1000 + e*10)
			hs := []uint64{base, base + 1, base + 2, base + 3}
			evs = append(evs, kv.Event{Kind: kv.BlockRemoved, EngineHashes: hs})
			first = append(first, kv.Event{Kind: kv.BlockStored, EngineHashes: hs, Tokens: tokens(64, uint32(base)), BlockSize: 16})
		}
		evs = append(evs, first[len(first)-4:]...)
		payloads[i] = kv.AppendVLLMBatch(nil, 1, evs, 0, kv.VLLMArrays)
	}
	a.ApplyEvents(0, first)
	var dec kv.VLLMDecoder
	b.ReportAllocs()
	cpu0 := cpuTime()
	for i := 0; b.Loop(); i++ {
		_, evs, rank, err := dec.Decode(payloads[i%ring])
		if err != nil {
			b.Fatal(err)
		}
		a.ApplyEvents(rank, evs)
	}
	b.ReportMetric(float64(b.N)*32/b.Elapsed().Seconds(), "blockevents/s")
	b.ReportMetric(float64(b.N)*32/(cpuTime()-cpu0).Seconds(), "blockevents/cpu-s")
}

// Random stores (known, unknown and re-used parents; several tiers),
// removals and clears keep the applier's books and the index in agreement:
// every tracked block is indexed at exactly its tiers, nothing else is.
func TestKVApplyRandomConsistency(t *testing.T) {
	t.Run("RouterSizedBlocks", func(t *testing.T) { randomConsistency(t, false) })
	t.Run("MixedSmallBlocks", func(t *testing.T) { randomConsistency(t, true) })
}

func randomConsistency(t *testing.T, small bool) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "rnd"}, r)
	id, _ := r.WorkerByName("rnd")
	rng := uint64(42)
	next := func(n int) int {
		rng ^= rng << 13
		rng ^= rng >> 7
		rng ^= rng << 17
		return int(rng % uint64(n))
	}
	blockToks := func(h uint64, size int) []uint32 { return tokens(size, uint32(h)*131) }
	sizes := []int{16}
	if small {
		sizes = []int{16, 8, 4, 1}
	}
	for step := 0; step < 5000; step++ {
		tier := kv.Tier(next(3))
		switch op := next(20); {
		case op < 12: // store a chain of 1-3 blocks
			n := 1 + next(3)
			size := sizes[next(len(sizes))]
			hs := make([]uint64, n)
			var toks []uint32
			for i := range hs {
				hs[i] = uint64(next(200))
				toks = append(toks, blockToks(hs[i], size)...)
			}
			ev := kv.Event{Kind: kv.BlockStored, EngineHashes: hs, Tokens: toks, BlockSize: size, Tier: tier}
			if next(2) == 0 {
				ev.HasParent, ev.EngineParent = true, uint64(next(220))
			}
			a.ApplyEvents(0, []kv.Event{ev})
		case op < 19:
			hs := []uint64{uint64(next(200)), uint64(next(200))}
			a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: hs, Tier: tier}})
		default:
			if next(10) == 0 {
				a.ApplyEvents(0, []kv.Event{{Kind: kv.AllBlocksCleared}})
			}
		}
		if step%25 != 0 {
			continue
		}
		a.mu.Lock()
		rk := a.ranks[0]
		var perT [kv.NumTiers]int64
		owners := map[kv.BlockHash]uint8{}
		for _, b := range rk.blocks {
			if b.fill != 16 {
				continue // a partial engine block: nothing indexed
			}
			for tt := range perT {
				if b.tiers&(1<<tt) != 0 {
					perT[tt]++
				}
			}
			owners[b.own] |= b.tiers
		}
		if perT != rk.perT {
			t.Fatalf("step %d: per-tier counts %v, books say %v", step, perT, rk.perT)
		}
		a.mu.Unlock()
		if got := r.Index().WorkerBlocks(id); got != len(owners) {
			t.Fatalf("step %d: index holds %d, applier tracks %d", step, got, len(owners))
		}
		for own, tiers := range owners {
			best := kv.Tier(bits.TrailingZeros8(tiers))
			ov := r.Index().Match([]kv.BlockHash{own}, nil)
			if len(ov) != 1 || ov[0].Tiers[best] != 1 {
				t.Fatalf("step %d: block %x (tiers %b) matches %+v", step, own, tiers, ov)
			}
		}
	}
	if s := a.Stats(); s.OrphanBlocks == 0 || s.RemovedBlocks == 0 || s.UnknownRemovals == 0 {
		t.Fatalf("the walk missed cases: %+v", s)
	}
}

// pages splits toks into one BlockStored per page of size ps, chained by
// parent, with engine hashes base, base+1, ...; the first page's parent is
// parent (if non-nil).
func pages(toks []uint32, ps int, base uint64, parent *uint64) []kv.Event {
	var evs []kv.Event
	for i := 0; i*ps < len(toks); i++ {
		ev := kv.Event{Kind: kv.BlockStored, EngineHashes: []uint64{base + uint64(i)}, Tokens: toks[i*ps : (i+1)*ps], BlockSize: ps}
		switch {
		case i > 0:
			ev.HasParent, ev.EngineParent = true, base+uint64(i-1)
		case parent != nil:
			ev.HasParent, ev.EngineParent = true, *parent
		}
		evs = append(evs, ev)
	}
	return evs
}

// SGLang publishes one BlockStored per page, pages usually smaller than the
// router's blocks (page size 1 by default): pages are gathered along their
// parent chain into router blocks.
func TestKVApplySmallPages(t *testing.T) {
	toks := tokens(64, 9)
	for _, ps := range []int{1, 4, 8} {
		r := newRouter(t)
		a := NewKVApplier(KVApplierConfig{Backend: "sg"}, r)
		evs := pages(toks, ps, 1000, nil)
		per := 16 / ps
		a.ApplyEvents(0, evs[:per+per/2]) // one and a half router blocks
		if d, _ := depth(t, r, "sg", toks, 0); d != 1 {
			t.Fatalf("page %d: depth %d after 1.5 blocks", ps, d)
		}
		a.ApplyEvents(0, evs[per+per/2:])
		if d, _ := depth(t, r, "sg", toks, 0); d != 4 || r.Index().Len() != 4 {
			t.Fatalf("page %d: depth %d len %d", ps, d, r.Index().Len())
		}
		// Evicting the last page of router block 3 un-indexes it; a partial
		// page removes nothing.
		a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{1000 + uint64(4*per-1)}}})
		if d, _ := depth(t, r, "sg", toks, 0); d != 3 {
			t.Fatalf("page %d: depth %d after evicting the tail", ps, d)
		}
		if per > 1 {
			a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{1000 + uint64(4*per-2)}}})
			if r.Index().Len() != 3 {
				t.Fatalf("page %d: removing a partial page changed the index", ps)
			}
		}
		if s := a.Stats(); s.Blocks[kv.TierDevice] != 3 || s.OrphanBlocks != 0 || s.BlockSizeMismatch != 0 {
			t.Fatalf("page %d: stats %+v", ps, s)
		}
	}
}

// Pages continue a router-sized block, with a LoRA namespace; a page whose
// partial ancestor is gone is an orphan; a chain off the block grid is
// dropped.
func TestKVApplySmallPagesEdges(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "sg"}, r)
	toks := tokens(48, 3)
	head := stored([]uint64{1}, nil, toks[:16], kv.TierDevice)
	head.LoRAName = "ad"
	tail := pages(toks[16:], 4, 100, ptr(1))
	for i := range tail {
		tail[i].LoRAName = "ad"
	}
	a.ApplyEvents(0, append([]kv.Event{head}, tail...))
	if d, _ := depth(t, r, "sg", toks, kv.RequestNamespace("", "ad")); d != 3 {
		t.Fatalf("depth %d", d)
	}
	// A partial first router block carries the namespace too.
	first := pages(toks[:16], 8, 200, nil)
	for i := range first {
		first[i].LoRAName = "other"
	}
	a.ApplyEvents(0, first)
	if d, _ := depth(t, r, "sg", toks, kv.RequestNamespace("", "other")); d != 1 {
		t.Fatalf("namespaced first block depth %d", d)
	}
	// Page 101 (mid router block 2) evicted, then a page continuing 102:
	// the block cannot be assembled.
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{101, 103}}})
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockStored, EngineHashes: []uint64{104}, HasParent: true, EngineParent: 102, Tokens: toks[28:32], BlockSize: 4}})
	if s := a.Stats(); s.OrphanBlocks != 1 {
		t.Fatalf("stats %+v", s)
	}
	// A router-sized block hung off a partial page is off the grid.
	a.ApplyEvents(0, []kv.Event{stored([]uint64{300}, ptr(100), tokens(16, 0), kv.TierDevice)})
	if s := a.Stats(); s.BlockSizeMismatch != 1 {
		t.Fatalf("stats %+v", s)
	}
}

// BenchmarkKVApplyPages1 is SGLang's default: one BlockStored per token
// (page size 1), chained by parent. Each op stores a 64-token chain (4 router
// blocks) page by page and evicts the chain stored 16 ops earlier.
func BenchmarkKVApplyPages1(b *testing.B) {
	r := newRouter(b)
	a := NewKVApplier(KVApplierConfig{Backend: "bench"}, r)
	const ring = 16
	type chain struct{ store, remove []kv.Event }
	chains := make([]chain, ring)
	for i := range chains {
		base := uint64(i * 1000)
		st := pages(tokens(64, uint32(base)), 1, base, nil)
		hs := make([]uint64, 64)
		for j := range hs {
			hs[j] = base + uint64(63-j) // leaves first
		}
		chains[i] = chain{st, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: hs}}}
		a.ApplyEvents(0, st)
	}
	b.ReportAllocs()
	cpu0 := cpuTime()
	for i := 0; b.Loop(); i++ {
		c := &chains[i%ring]
		a.ApplyEvents(0, c.remove)
		a.ApplyEvents(0, c.store)
	}
	b.ReportMetric(float64(b.N)*128/b.Elapsed().Seconds(), "blockevents/s")
	b.ReportMetric(float64(b.N)*128/(cpuTime()-cpu0).Seconds(), "blockevents/cpu-s")
}

// A tenant's cache salt seeds block 0 of its sequences, as the proxy seeds
// the tenant's requests (kv.NewNamespace(salt)); children follow by chaining.
func TestKVApplySaltedNamespace(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "b"}, r)
	toks := tokens(48, 5)
	salt := func(int) string { return "tenant-salt" }
	a.ApplySalted(0, []kv.Event{stored([]uint64{1, 2}, nil, toks[:32], kv.TierDevice)}, salt)
	a.ApplySalted(0, []kv.Event{stored([]uint64{3}, ptr(2), toks[32:], kv.TierDevice)}, salt)
	if d, _ := depth(t, r, "b", toks, kv.NewNamespace("tenant-salt")); d != 3 {
		t.Fatalf("salted depth %d", d)
	}
	if d, _ := depth(t, r, "b", toks, 0); d != 0 {
		t.Fatalf("unsalted requests must not match a tenant's blocks, depth %d", d)
	}
}

// The engine blocks an applier tracks are bounded (MaxBlocks): past it a
// stored event is dropped, counted and reported once, so an HTTP pusher
// that stores and never removes cannot grow kvproxy without end (the
// memory audit: 9M pushed blocks, 446 MB of live heap). Removals make room
// again.
func TestKVApplyMaxBlocks(t *testing.T) {
	r := newRouter(t)
	var problems []string
	a := NewKVApplier(KVApplierConfig{Backend: "b", MaxBlocks: 10, OnProblem: func(p string) { problems = append(problems, p) }}, r)
	for i := range uint64(20) {
		a.ApplyEvents(0, []kv.Event{stored([]uint64{100 + i}, nil, tokens(16, uint32(i)*1000), kv.TierDevice)})
	}
	if s := a.Stats(); s.Blocks[kv.TierDevice] != 10 || s.OverCapacity != 10 || r.Index().Len() != 10 {
		t.Fatalf("stats %+v, index %d", s, r.Index().Len())
	}
	if len(problems) != 1 || !strings.Contains(problems[0], "over_capacity_blocks") {
		t.Fatalf("problems %q", problems)
	}
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{100, 101}}})
	a.ApplyEvents(0, []kv.Event{stored([]uint64{200, 201}, nil, tokens(32, 77), kv.TierDevice)})
	if s := a.Stats(); s.Blocks[kv.TierDevice] != 10 || s.OverCapacity != 10 {
		t.Fatalf("after removals: stats %+v", s)
	}
	if d, _ := depth(t, r, "b", tokens(32, 77), 0); d != 2 {
		t.Fatalf("the blocks stored after removals: depth %d", d)
	}
}

// An event that names one engine hash for several of its blocks leaves the
// hash to the last of them, the others out of the index, and takes time
// linear in its length: it took n² lookups under the applier's lock (the
// twenty-ninth session's review: 16k blocks held it 0.8 s, so 65k about 13 s
// and a million about 50 minutes; linear, 65k take milliseconds).
func TestKVApplyEventRepeatingAHash(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "b"}, r)
	toks := tokens(48, 1)
	a.ApplyEvents(0, []kv.Event{stored([]uint64{5, 6, 5}, nil, toks, kv.TierDevice)})
	if s := a.Stats(); s.Blocks[kv.TierDevice] != 2 || r.Index().Len() != 2 {
		t.Fatalf("stats %+v, index %d: want blocks 1 and 2 indexed", s, r.Index().Len())
	}
	if d, _ := depth(t, r, "b", toks, 0); d != 0 {
		t.Fatalf("depth %d: block 0, its hash taken by block 2, should be gone", d)
	}

	const n = 1 << 16
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.ApplyEvents(0, []kv.Event{stored(make([]uint64, n), nil, tokens(n*16, 3), kv.TierDevice)})
	}()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("an event of %d blocks under one hash still holds the applier after a minute", n)
	}
	if s := a.Stats(); s.Blocks[kv.TierDevice] != 3 || r.Index().Len() != 3 {
		t.Fatalf("stats %+v, index %d: want the two blocks before and the event's last", s, r.Index().Len())
	}
}
