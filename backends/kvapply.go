package backends

import (
	"slices"
	"strconv"
	"sync"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

// Workers is the part of *router.Router a KVApplier needs.
type Workers interface {
	AddWorker(name string) router.WorkerID
	SetApproximate(id router.WorkerID, approx bool)
	Index() router.Index
}

var _ Workers = (*router.Router)(nil)

// KVApplierConfig configures the event applier of one backend.
type KVApplierConfig struct {
	// Backend is the backend id. Data-parallel rank 0 is the worker of that
	// name; rank r > 0 is the worker "<Backend>#<r>" (WorkerName).
	Backend string
	// BlockSize is the router's block size. Stored events with another block
	// size cannot be re-hashed into the router's blocks and are dropped
	// (counted in BlockSizeMismatch). 0 means kv.DefaultBlockSize.
	BlockSize int
	// Shared marks a pool-wide cache layer: its blocks are indexed in tier
	// shared whatever medium the events name.
	Shared bool
}

// MaxDPRank bounds the data-parallel ranks of one backend; batches from a
// higher rank are dropped (counted in BadRank).
const MaxDPRank = 1023

// KVApplyStats counts what an applier did, for /admin/backends.
type KVApplyStats struct {
	Workers int
	// Blocks is the number of engine blocks currently indexed, per tier.
	Blocks            [kv.NumTiers]int64
	StoredBlocks      uint64 // blocks of applied BlockStored events
	RemovedBlocks     uint64 // blocks of applied BlockRemoved events
	OrphanBlocks      uint64 // stored blocks dropped: their parent block was unknown
	UnknownRemovals   uint64 // removed blocks that were not indexed (in that tier)
	BlockSizeMismatch uint64 // stored blocks dropped: block size differs from the router's
	BadRank           uint64 // batches dropped: rank above MaxDPRank
	Clears            uint64 // all-blocks clears (events, feed resets, Clear)
}

// KVApplier applies one backend's KV events to the router index. The router
// never trusts engine hashes: it recomputes its own block hashes from the
// events' token ids (kv.ContinueHashes, block 0 seeded by kv.NewNamespace of
// the LoRA name) and keeps, per worker, engine hash → own hash, so later
// BlockRemoved events and child blocks (which name their parent by engine
// hash) find them again.
//
// A BlockStored whose parent engine hash is unknown (its prefix was stored
// before we subscribed, or its announcement was lost) cannot be re-hashed:
// the router's hash of a block depends on every token before it. Such
// events are dropped and counted (OrphanBlocks); the index is never given a
// hash it cannot vouch for.
//
// Two engine blocks that differ only in what the router does not hash (e.g. a
// cache_salt in vLLM's extra_keys) share one own hash; removing either
// removes the index entry. That under-reports, never over-reports.
//
// Safe for concurrent use (the ZMQ feed and HTTP pushes may both deliver).
type KVApplier struct {
	cfg     KVApplierConfig
	workers Workers
	idx     router.Index

	mu     sync.Mutex
	ranks  []*rankKV // by data-parallel rank; nil until the rank is seen
	own    []kv.BlockHash
	stale  []kv.BlockHash
	stats  KVApplyStats
	lora   string
	loraNS kv.Namespace
}

type rankKV struct {
	id     router.WorkerID
	blocks map[uint64]ownBlock // engine hash → own hash and tiers held
	perT   [kv.NumTiers]int64
}

type ownBlock struct {
	own   kv.BlockHash
	tiers uint8 // bit t: held in tier t
}

var _ EventSink = (*KVApplier)(nil)

// NewKVApplier returns the applier of one backend. The worker of rank 0 is
// registered at once and put in event mode; other ranks when first seen.
func NewKVApplier(cfg KVApplierConfig, workers Workers) *KVApplier {
	if cfg.BlockSize <= 0 {
		cfg.BlockSize = kv.DefaultBlockSize
	}
	a := &KVApplier{cfg: cfg, workers: workers, idx: workers.Index()}
	a.rank(0)
	return a
}

// WorkerName is the router worker name of a backend's data-parallel rank.
func WorkerName(backend string, dpRank int) string {
	if dpRank == 0 {
		return backend
	}
	return backend + "#" + strconv.Itoa(dpRank)
}

// WorkerIDs lists the router workers this applier feeds (one per rank seen),
// so a removed backend's workers can be removed from the router too.
func (a *KVApplier) WorkerIDs() []router.WorkerID {
	a.mu.Lock()
	defer a.mu.Unlock()
	var ids []router.WorkerID
	for _, r := range a.ranks {
		if r != nil {
			ids = append(ids, r.id)
		}
	}
	return ids
}

// Stats returns the applier's counters.
func (a *KVApplier) Stats() KVApplyStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.stats
	for _, r := range a.ranks {
		if r == nil {
			continue
		}
		s.Workers++
		for t := range s.Blocks {
			s.Blocks[t] += r.perT[t]
		}
	}
	return s
}

func (a *KVApplier) rank(r int) *rankKV {
	for len(a.ranks) <= r {
		a.ranks = append(a.ranks, nil)
	}
	if a.ranks[r] == nil {
		id := a.workers.AddWorker(WorkerName(a.cfg.Backend, r))
		a.workers.SetApproximate(id, false)
		a.ranks[r] = &rankKV{id: id, blocks: make(map[uint64]ownBlock)}
	}
	return a.ranks[r]
}

// ApplyEvents applies the events of one batch of rank dpRank, in order.
func (a *KVApplier) ApplyEvents(dpRank int, events []kv.Event) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if dpRank < 0 || dpRank > MaxDPRank {
		a.stats.BadRank++
		return
	}
	r := a.rank(dpRank)
	for i := range events {
		ev := &events[i]
		switch ev.Kind {
		case kv.BlockStored:
			a.stored(r, ev)
		case kv.BlockRemoved:
			a.removed(r, ev)
		case kv.AllBlocksCleared:
			a.clearRank(r)
		}
	}
}

// ClearRanks drops every block of the given ranks (engine restart, feed
// reset). Implements EventSink.
func (a *KVApplier) ClearRanks(ranks []int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, r := range ranks {
		if r >= 0 && r < len(a.ranks) && a.ranks[r] != nil {
			a.clearRank(a.ranks[r])
		}
	}
}

// Clear drops every block of every rank (backend removed, HTTP feed reset).
func (a *KVApplier) Clear() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, r := range a.ranks {
		if r != nil {
			a.clearRank(r)
		}
	}
}

func (a *KVApplier) clearRank(r *rankKV) {
	a.idx.ClearWorker(r.id)
	clear(r.blocks)
	r.perT = [kv.NumTiers]int64{}
	a.stats.Clears++
}

func (a *KVApplier) tier(t kv.Tier) kv.Tier {
	if a.cfg.Shared {
		return kv.TierShared
	}
	return t
}

func (a *KVApplier) namespace(lora string) kv.Namespace {
	if lora != a.lora {
		a.lora, a.loraNS = lora, kv.NewNamespace(lora)
	}
	return a.loraNS
}

func (a *KVApplier) stored(r *rankKV, ev *kv.Event) {
	n := len(ev.EngineHashes)
	if n == 0 {
		return
	}
	if ev.BlockSize != a.cfg.BlockSize || len(ev.Tokens) != n*ev.BlockSize {
		a.stats.BlockSizeMismatch += uint64(n)
		return
	}
	var parent kv.BlockHash
	if ev.HasParent {
		p, ok := r.blocks[ev.EngineParent]
		if !ok {
			a.stats.OrphanBlocks += uint64(n)
			return
		}
		parent = p.own
	}
	a.own = kv.ContinueHashes(a.own[:0], parent, !ev.HasParent, ev.Tokens, ev.BlockSize, a.namespace(ev.LoRAName))
	t := a.tier(ev.Tier)
	bit := uint8(1) << t
	for i, eh := range ev.EngineHashes {
		b := r.blocks[eh]
		if b.tiers != 0 && b.own != a.own[i] {
			// The engine reuses a hash for other content: forget the old
			// (after the Store below, unless this event stores it again).
			a.stale = append(a.stale, b.own)
			for tt := range r.perT {
				if b.tiers&(1<<tt) != 0 {
					r.perT[tt]--
				}
			}
			b.tiers = 0
		}
		if b.tiers&bit == 0 {
			r.perT[t]++
		}
		b.own = a.own[i]
		b.tiers |= bit
		r.blocks[eh] = b
	}
	a.idx.Store(r.id, a.own, t, 0)
	a.stats.StoredBlocks += uint64(n)
	if len(a.stale) > 0 {
		// Keep an old own hash that a block of this event now maps to.
		a.stale = slices.DeleteFunc(a.stale, func(h kv.BlockHash) bool {
			for _, eh := range ev.EngineHashes {
				if r.blocks[eh].own == h {
					return true
				}
			}
			return false
		})
		a.idx.Remove(r.id, a.stale, router.AllTiers)
		a.stale = a.stale[:0]
	}
}

func (a *KVApplier) removed(r *rankKV, ev *kv.Event) {
	t := a.tier(ev.Tier)
	bit := uint8(1) << t
	a.own = a.own[:0]
	for _, eh := range ev.EngineHashes {
		b, ok := r.blocks[eh]
		if !ok || b.tiers&bit == 0 {
			a.stats.UnknownRemovals++
			continue
		}
		b.tiers &^= bit
		r.perT[t]--
		if b.tiers == 0 {
			delete(r.blocks, eh)
		} else {
			r.blocks[eh] = b
		}
		a.own = append(a.own, b.own)
	}
	if len(a.own) > 0 {
		a.idx.Remove(r.id, a.own, t)
		a.stats.RemovedBlocks += uint64(len(a.own))
	}
}
