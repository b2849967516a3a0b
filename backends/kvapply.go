package backends

import (
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

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
	// BlockSize is the router's block size. Engine blocks of that size are
	// re-hashed one for one; smaller ones (SGLang pages) are gathered along
	// their chain into router blocks; larger ones, and chains that do not
	// land on router block boundaries, are dropped (BlockSizeMismatch).
	// 0 means kv.DefaultBlockSize.
	BlockSize int
	// Shared marks a pool-wide cache layer: its blocks are indexed in tier
	// shared whatever medium the events name.
	Shared bool
	// Namespace seeds block 0 of a stored sequence from its LoRA name and
	// cache salt; it must agree with how the proxy hashes requests. nil means
	// kv.RequestNamespace(salt, lora).
	Namespace func(lora, salt string) kv.Namespace
	// MaxBlocks bounds the engine blocks tracked per data-parallel rank:
	// a BlockStored that would pass it is dropped (OverCapacity), so that
	// an HTTP pusher that never removes what it stores cannot grow kvproxy
	// without end. 0: DefaultMaxBlocks.
	MaxBlocks int
	// OnProblem, when set, hears of the first block size mismatch (the
	// engine's block size against BlockSize) and of the first event over
	// MaxBlocks, once each per applier, outside its lock.
	OnProblem func(problem string)
}

// DefaultMaxBlocks is KVApplierConfig.MaxBlocks' default: the router
// index's default bound (router.DefaultConfig().MaxIndexBlocks), which no
// engine's device and host tiers come near (30,000 blocks of 16 tokens for
// Llama-3.1-8B on an H100). It counts engine blocks: about 55 bytes each,
// 170 for blocks smaller than the router's (SGLang's pages of one token,
// of which 4M are 250,000 router blocks).
const DefaultMaxBlocks = 4_000_000

// MaxDPRank bounds the data-parallel ranks of one backend; batches from a
// higher rank are dropped (counted in BadRank).
const MaxDPRank = 1023

// KVApplyStats counts what an applier did, for /admin/backends.
type KVApplyStats struct {
	Workers int
	// Blocks is the number of router blocks currently indexed, per tier.
	Blocks            [kv.NumTiers]int64
	StoredBlocks      uint64 // engine blocks of applied BlockStored events
	RemovedBlocks     uint64 // engine blocks of applied BlockRemoved events
	OrphanBlocks      uint64 // stored blocks dropped: their parent block was unknown
	UnknownRemovals   uint64 // removed blocks that were not indexed (in that tier)
	BlockSizeMismatch uint64 // stored blocks dropped: larger than the router's blocks, or off their grid
	UnknownCopies     uint64 // copied blocks (a BlockStored without tokens) that were not indexed: skipped
	OverCapacity      uint64 // stored blocks dropped: the rank tracked MaxBlocks already
	BadRank           uint64 // batches dropped: rank above MaxDPRank
	Clears            uint64 // rank clears (AllBlocksCleared, feed resets, Clear)
}

// KVApplier applies one backend's KV events to the router index. The router
// never trusts engine hashes: it recomputes its own block hashes from the
// events' token ids (kv.ContinueHashes, block 0 seeded by Config.Namespace
// of the LoRA name and cache salt) and keeps, per worker, engine hash → own hash, so later
// BlockRemoved events and child blocks (which name their parent by engine
// hash) find them again.
//
// A BlockStored whose parent engine hash is unknown (its prefix was stored
// before we subscribed, or its announcement was lost) cannot be re-hashed:
// the router's hash of a block depends on every token before it. Such
// events are dropped and counted (OrphanBlocks); the index is never given a
// hash it cannot vouch for.
//
// Two engine blocks that differ only in what the router does not hash (e.g.
// multimodal keys in vLLM's extra_keys) share one own hash; removing either
// removes the index entry. That under-reports, never over-reports.
//
// Safe for concurrent use (the ZMQ feed and HTTP pushes may both deliver).
type KVApplier struct {
	cfg     KVApplierConfig
	workers Workers
	idx     router.Index

	multiRank atomic.Bool // a rank above 0 has been seen (read without mu)

	mu     sync.Mutex
	closed bool      // Close was called: events are ignored
	ranks  []*rankKV // by data-parallel rank; nil until the rank is seen
	own    []kv.BlockHash
	stale  []kv.BlockHash
	gather []uint32 // one router block of tokens, assembled from partial engine blocks
	one    []kv.BlockHash
	stats  KVApplyStats
	lora   string
	salt   string
	nsSet  bool
	loraNS kv.Namespace
	// sizeWarned, capWarned: OnProblem has heard of a block size
	// mismatch, of an event over MaxBlocks; problem is such a report
	// while a.mu is held.
	sizeWarned, capWarned bool
	problem               string
}

type rankKV struct {
	id     router.WorkerID
	blocks map[uint64]ownBlock // engine hash → own hash and tiers held
	// partial holds, for engine blocks that do not end a router block, what
	// completing that router block later needs: their tokens and parent.
	// Allocated at the first such block (engines whose blocks are smaller
	// than the router's, e.g. SGLang with page size 1).
	partial map[uint64]partialBlock
	perT    [kv.NumTiers]int64 // router blocks indexed, per tier
}

// ownBlock is what the applier knows of one engine block.
type ownBlock struct {
	// own is, for a block that ends a router block (fill == block size),
	// that router block's hash; for a partial one, the hash of the router
	// block before it (unless flags&noBase).
	own   kv.BlockHash
	fill  uint32 // tokens of its router block up to and including this engine block
	tiers uint8  // bit t: held in tier t
	flags uint8
}

// noBase marks a partial engine block of a sequence's first router block.
const noBase = 1

// partialBlock keeps a copy of a partial engine block's tokens (the event's
// own slices die with the call): one small allocation per such block.
type partialBlock struct {
	parent    uint64
	hasParent bool
	tokens    []uint32
}

var _ SaltedSink = (*KVApplier)(nil)

// NewKVApplier returns the applier of one backend. The worker of rank 0 is
// registered at once and put in event mode; other ranks when first seen
// (or AddRanks).
func NewKVApplier(cfg KVApplierConfig, workers Workers) *KVApplier {
	if cfg.BlockSize <= 0 {
		cfg.BlockSize = kv.DefaultBlockSize
	}
	if cfg.MaxBlocks <= 0 {
		cfg.MaxBlocks = DefaultMaxBlocks
	}
	if cfg.Namespace == nil {
		cfg.Namespace = func(lora, salt string) kv.Namespace { return kv.RequestNamespace(salt, lora) }
	}
	a := &KVApplier{cfg: cfg, workers: workers, idx: workers.Index()}
	a.rank(0)
	return a
}

// AddRanks registers the workers of ranks 1 to n-1 now, not when their
// first event comes: a rank gets requests only once it has a worker, and
// stores blocks (sends events) only once it gets requests.
func (a *KVApplier) AddRanks(n int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for r := 1; r < n && r <= MaxDPRank; r++ {
		a.rank(r)
	}
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

// MultiRank reports whether the engine has shown a data-parallel rank
// other than 0. It is asked for every request: no lock.
func (a *KVApplier) MultiRank() bool { return a.multiRank.Load() }

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
		if r > 0 {
			a.multiRank.Store(true)
		}
	}
	return a.ranks[r]
}

// ApplyEvents applies the events of one batch of rank dpRank, in order,
// with no cache salts.
func (a *KVApplier) ApplyEvents(dpRank int, events []kv.Event) {
	a.ApplySalted(dpRank, events, nil)
}

// ApplySalted is ApplyEvents where salt(i), if salt is not nil, is the cache
// salt the engine hashed into event i (vLLM: a BlockStored that starts a
// sequence, see kv.VLLMDecoder.CacheSalt; HTTP: the pushing tenant's). Block 0
// of a sequence is then seeded with Namespace(lora name, salt), so tenant-
// salted blocks match the tenant's requests. Implements SaltedSink.
func (a *KVApplier) ApplySalted(dpRank int, events []kv.Event, salt func(i int) string) {
	a.mu.Lock()
	a.apply(dpRank, events, salt)
	warning := a.problem
	a.problem = ""
	a.mu.Unlock()
	if warning != "" && a.cfg.OnProblem != nil {
		a.cfg.OnProblem(warning)
	}
}

func (a *KVApplier) apply(dpRank int, events []kv.Event, salt func(i int) string) {
	if a.closed {
		return
	}
	if dpRank < 0 || dpRank > MaxDPRank {
		a.stats.BadRank++
		return
	}
	r := a.rank(dpRank)
	for i := range events {
		ev := &events[i]
		switch ev.Kind {
		case kv.BlockStored:
			if len(ev.Tokens) == 0 {
				a.copied(r, ev)
				continue
			}
			cs := ""
			if salt != nil && !ev.HasParent {
				cs = salt(i)
			}
			a.stored(r, ev, cs)
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

// FeedDown drops every block of the rank and routes it on the router's own
// records (approximate mode) until FeedUp: its feed has been down too long
// to vouch for what the engine caches. Implements StaleSink.
func (a *KVApplier) FeedDown(dpRank int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || dpRank < 0 || dpRank > MaxDPRank {
		return
	}
	r := a.rank(dpRank)
	a.clearRank(r)
	a.workers.SetApproximate(r.id, true)
}

// FeedUp puts the rank back in event mode: its feed is back. What the
// router recorded meanwhile expires with its TTL. Implements StaleSink.
func (a *KVApplier) FeedUp(dpRank int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || dpRank < 0 || dpRank > MaxDPRank {
		return
	}
	a.workers.SetApproximate(a.rank(dpRank).id, false)
}

// Clear drops every block of every rank (an HTTP feed reset, a backend
// away too long). After Close it does nothing: the workers may belong to a
// newer applier of the same backend by then.
func (a *KVApplier) Clear() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.closed {
		a.clearAll()
	}
}

// Close drops every block of every rank and ignores events from then on
// (backend removed from configuration: a late push must not bring its
// blocks back). Only the first call clears: by a later one, the same
// workers may belong to a newer applier of the same backend.
func (a *KVApplier) Close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return
	}
	a.clearAll()
	a.closed = true
}

func (a *KVApplier) clearAll() {
	for _, r := range a.ranks {
		if r != nil {
			a.clearRank(r)
		}
	}
}

func (a *KVApplier) clearRank(r *rankKV) {
	a.idx.ClearWorker(r.id)
	clear(r.blocks)
	clear(r.partial)
	r.perT = [kv.NumTiers]int64{}
	a.stats.Clears++
}

func (a *KVApplier) tier(t kv.Tier) kv.Tier {
	if a.cfg.Shared {
		return kv.TierShared
	}
	return t
}

// namespace is Config.Namespace(lora, salt), remembered for the last pair
// (they repeat from event to event).
func (a *KVApplier) namespace(lora, salt string) kv.Namespace {
	if lora != a.lora || salt != a.salt || !a.nsSet {
		a.lora, a.salt, a.nsSet = lora, salt, true
		a.loraNS = a.cfg.Namespace(lora, salt)
	}
	return a.loraNS
}

// stored applies a BlockStored. Engine blocks of the router's block size
// (vLLM's usual case) are re-hashed in one go. Smaller engine blocks (SGLang
// pages) are gathered along their parent chain until they fill a router
// block, whose hash is then indexed; a chain that does not land exactly on
// router block boundaries is dropped (BlockSizeMismatch).
func (a *KVApplier) stored(r *rankKV, ev *kv.Event, salt string) {
	n := len(ev.EngineHashes)
	if n == 0 {
		return
	}
	bs := a.cfg.BlockSize
	if ev.BlockSize <= 0 || ev.BlockSize > bs || len(ev.Tokens) != n*ev.BlockSize {
		a.sizeMismatch(n, ev.BlockSize)
		return
	}
	if len(r.blocks)+n > a.cfg.MaxBlocks {
		a.stats.OverCapacity += uint64(n)
		if !a.capWarned {
			a.capWarned = true
			a.problem = fmt.Sprintf("over capacity: the engine's events hold more than %d blocks (router.max_index_blocks; or they store blocks and never remove them): the blocks they store past that are not indexed (counted in over_capacity_blocks)", a.cfg.MaxBlocks)
		}
		return
	}
	var prev ownBlock
	if ev.HasParent {
		p, ok := r.blocks[ev.EngineParent]
		if !ok {
			a.stats.OrphanBlocks += uint64(n)
			return
		}
		prev = p
	}
	ns := a.namespace(ev.LoRAName, salt)
	t := a.tier(ev.Tier)
	a.own = a.own[:0]
	applied := n
	if ev.BlockSize == bs && (!ev.HasParent || int(prev.fill) == bs) {
		a.own = kv.ContinueHashes(a.own, prev.own, !ev.HasParent, ev.Tokens, bs, ns)
		for i, eh := range ev.EngineHashes {
			a.put(r, eh, ownBlock{own: a.own[i], fill: uint32(bs)}, t, nil)
		}
	} else {
		applied = a.storedSmall(r, ev, prev, ns, t)
	}
	if len(a.own) > 0 {
		a.idx.Store(r.id, a.own, t, 0)
	}
	a.stats.StoredBlocks += uint64(applied)
	if len(a.stale) > 0 {
		// Keep an old own hash that a block of this event now ends. One
		// pass over the event: an event naming one engine hash n times
		// queued n stale hashes, and a scan of the event for each held
		// the lock for n² lookups (16k blocks: 0.8 s; the review).
		kept := make(map[kv.BlockHash]bool, len(a.stale))
		for _, h := range a.stale {
			kept[h] = false
		}
		for _, eh := range ev.EngineHashes {
			if b := r.blocks[eh]; int(b.fill) == bs {
				if _, ok := kept[b.own]; ok {
					kept[b.own] = true
				}
			}
		}
		a.stale = slices.DeleteFunc(a.stale, func(h kv.BlockHash) bool { return kept[h] })
		a.idx.Remove(r.id, a.stale, router.AllTiers)
		a.stale = a.stale[:0]
	}
}

// copied applies a BlockStored without tokens: the engine now also holds,
// in the event's tier, blocks it announced before (vLLM's offloading
// connector copying them to CPU memory). Known blocks gain that tier; the
// router block a block ends is indexed there. Unknown ones cannot be
// re-hashed and are skipped (UnknownCopies).
func (a *KVApplier) copied(r *rankKV, ev *kv.Event) {
	t := a.tier(ev.Tier)
	a.own = a.own[:0]
	for _, eh := range ev.EngineHashes {
		b, ok := r.blocks[eh]
		if !ok {
			a.stats.UnknownCopies++
			continue
		}
		if b.tiers&(1<<t) == 0 && int(b.fill) == a.cfg.BlockSize {
			r.perT[t]++
			a.own = append(a.own, b.own)
		}
		b.tiers |= 1 << t
		r.blocks[eh] = b
		a.stats.StoredBlocks++
	}
	if len(a.own) > 0 {
		a.idx.Store(r.id, a.own, t, 0)
	}
}

// storedSmall applies engine blocks smaller than the router's, one at a
// time, appending the router blocks they complete to a.own, and returns how
// many it applied. It stops (and counts the rest) where the chain leaves the
// router's block grid or a partial ancestor is gone.
func (a *KVApplier) storedSmall(r *rankKV, ev *kv.Event, prev ownBlock, ns kv.Namespace, t kv.Tier) int {
	bs, e := a.cfg.BlockSize, ev.BlockSize
	hasPrev, prevHash := ev.HasParent, ev.EngineParent
	for i, eh := range ev.EngineHashes {
		toks := ev.Tokens[i*e : (i+1)*e]
		rec := ownBlock{fill: uint32(e), flags: noBase}
		if hasPrev {
			rec.own = prev.own
			if int(prev.fill) == bs {
				rec.flags = 0
			} else {
				rec.fill = prev.fill + uint32(e)
				rec.flags = prev.flags & noBase
			}
		}
		if int(rec.fill) > bs {
			a.sizeMismatch(len(ev.EngineHashes)-i, e)
			return i
		}
		var pb *partialBlock
		if int(rec.fill) == bs {
			full := a.gatherBlock(r, toks, hasPrev && int(prev.fill) < bs, prevHash)
			if full == nil {
				a.stats.OrphanBlocks += uint64(len(ev.EngineHashes) - i)
				return i
			}
			a.one = kv.ContinueHashes(a.one[:0], rec.own, rec.flags&noBase != 0, full, bs, ns)
			rec = ownBlock{own: a.one[0], fill: uint32(bs)}
			a.own = append(a.own, rec.own)
		} else {
			pb = &partialBlock{parent: prevHash, hasParent: hasPrev, tokens: slices.Clone(toks)}
		}
		rec = a.put(r, eh, rec, t, pb)
		prev, hasPrev, prevHash = rec, true, eh
	}
	return len(ev.EngineHashes)
}

// sizeMismatch drops n engine blocks of engineBS tokens that do not fit the
// router's blocks, and words the warning of the first such drop.
func (a *KVApplier) sizeMismatch(n, engineBS int) {
	a.stats.BlockSizeMismatch += uint64(n)
	if a.sizeWarned {
		return
	}
	a.sizeWarned = true
	bs := a.cfg.BlockSize
	why := fmt.Sprintf("the engine's KV blocks of %d tokens are larger than the configured block_size %d", engineBS, bs)
	if engineBS <= bs {
		why = fmt.Sprintf("the engine's KV blocks of %d tokens do not divide the configured block_size %d", engineBS, bs)
	}
	a.problem = "block size mismatch: " + why + " (models[].block_size): the blocks the engine stores are not indexed (counted in block_size_mismatch)"
}

// gatherBlock assembles the router block ended by an engine block with
// tokens last: the tokens of its partial ancestors (walked from parent while
// more are needed) then last. It returns nil if an ancestor is unknown.
func (a *KVApplier) gatherBlock(r *rankKV, last []uint32, walk bool, parent uint64) []uint32 {
	bs := a.cfg.BlockSize
	if cap(a.gather) < bs {
		a.gather = make([]uint32, bs)
	}
	buf := a.gather[:bs]
	end := bs - len(last)
	copy(buf[end:], last)
	for end > 0 {
		if !walk {
			return nil
		}
		p, ok := r.partial[parent]
		if !ok || len(p.tokens) > end {
			return nil
		}
		end -= len(p.tokens)
		copy(buf[end:], p.tokens)
		walk, parent = p.hasParent, p.parent
	}
	return buf
}

// put records that engine block eh (now rec) is held in tier t and returns
// the record (the caller queues a router block it ends in a.own for
// indexing). If the engine had the hash for other content, the old router
// block is queued in a.stale for removal.
func (a *KVApplier) put(r *rankKV, eh uint64, rec ownBlock, t kv.Tier, pb *partialBlock) ownBlock {
	bs := uint32(a.cfg.BlockSize)
	bit := uint8(1) << t
	old := r.blocks[eh]
	if old.tiers != 0 && (old.own != rec.own || old.fill != rec.fill || old.flags != rec.flags) {
		if old.fill == bs {
			a.stale = append(a.stale, old.own)
			for tt := range r.perT {
				if old.tiers&(1<<tt) != 0 {
					r.perT[tt]--
				}
			}
		}
		old.tiers = 0
	}
	if rec.fill == bs {
		if old.tiers&bit == 0 {
			r.perT[t]++
		}
	}
	rec.tiers = old.tiers | bit
	r.blocks[eh] = rec
	if pb != nil {
		if r.partial == nil {
			r.partial = make(map[uint64]partialBlock)
		}
		r.partial[eh] = *pb
	} else if r.partial != nil {
		delete(r.partial, eh)
	}
	return rec
}

// removed applies a BlockRemoved: router blocks ended by the removed engine
// blocks leave the index (in that tier). Removing a partial engine block
// removes nothing from the index: engines evict leaves first, so the block
// that ends its router block has gone before it.
func (a *KVApplier) removed(r *rankKV, ev *kv.Event) {
	bs := uint32(a.cfg.BlockSize)
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
		if b.fill == bs {
			r.perT[t]--
			a.own = append(a.own, b.own)
		}
		if b.tiers == 0 {
			delete(r.blocks, eh)
			if r.partial != nil {
				delete(r.partial, eh)
			}
		} else {
			r.blocks[eh] = b
		}
		a.stats.RemovedBlocks++
	}
	if len(a.own) > 0 {
		a.idx.Remove(r.id, a.own, t)
	}
}
