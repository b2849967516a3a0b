package router

import (
	"math/bits"
	"sync"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

var _ Index = (*MemIndex)(nil)

// MemIndexConfig configures a MemIndex.
type MemIndexConfig struct {
	// MaxEntries bounds resident (block, worker) entries; the least recently
	// stored are pruned first. 0 means unbounded.
	MaxEntries int
	// Now is the clock used for TTLs (nil: time.Now). Tests inject a fake.
	Now func() time.Time
}

// MemIndex is the in-memory Index: a hash map from block hash to a short
// linked list of (worker, tiers, expiry) entries kept in one slab, with a
// global LRU list for the size bound. Expiry has one-second granularity; an
// entry may outlive its TTL by less than a second. Expired entries stop
// matching at once and are swept incrementally by Store (or by Sweep).
//
// Memory: one 32-byte entry per (block, worker) plus one map slot per
// distinct block.
type MemIndex struct {
	mu      sync.RWMutex
	max     int
	now     func() time.Time
	base    time.Time
	blocks  map[kv.BlockHash]uint32 // head entry of the block's worker list
	ents    []entry                 // ents[0] is the LRU sentinel
	free    uint32                  // free list through entry.next
	n       int                     // resident entries
	perW    []int32                 // resident entries per worker
	sweepAt uint32                  // incremental sweep cursor into ents
	scratch sync.Pool               // *[]int32: worker → position in Match result
}

// entry is one (block, worker) pair. 32 bytes.
type entry struct {
	hash    kv.BlockHash
	worker  WorkerID
	next    uint32 // next entry of the same block; 0 ends
	prev    uint32 // LRU neighbours (sentinel 0)
	lnext   uint32
	expires uint32 // tick after which the entry is dead; 0 = never
	tiers   uint8  // bit t set: held in tier t; 0 = free slot
}

// NewMemIndex returns an empty in-memory index.
func NewMemIndex(cfg MemIndexConfig) *MemIndex {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	x := &MemIndex{max: cfg.MaxEntries, now: cfg.Now, blocks: make(map[kv.BlockHash]uint32)}
	x.base = x.now()
	x.ents = make([]entry, 1, 1024)
	x.scratch.New = func() any { s := make([]int32, 0, 64); return &s }
	return x
}

// tick is the current time in whole seconds since base, plus one.
func (x *MemIndex) tick() uint32 {
	d := x.now().Sub(x.base)
	if d < 0 {
		return 1
	}
	return uint32(d/time.Second) + 1
}

func (x *MemIndex) expiry(ttl time.Duration) uint32 {
	if ttl <= 0 {
		return 0
	}
	d := x.now().Sub(x.base) + ttl
	if d < 0 {
		d = 0
	}
	return uint32((d+time.Second-1)/time.Second) + 1
}

func (e *entry) dead(now uint32) bool { return e.expires != 0 && now >= e.expires }

// Store implements Index.
func (x *MemIndex) Store(w WorkerID, hashes []kv.BlockHash, tier kv.Tier, ttl time.Duration) {
	if len(hashes) == 0 || tier >= kv.NumTiers {
		return
	}
	bit := uint8(1) << tier
	x.mu.Lock()
	exp, now := x.expiry(ttl), x.tick()
	for _, h := range hashes {
		head := x.blocks[h]
		i := head
		for i != 0 && x.ents[i].worker != w {
			i = x.ents[i].next
		}
		if i != 0 {
			e := &x.ents[i]
			switch {
			case e.dead(now): // a leftover: start afresh
				e.tiers, e.expires = bit, exp
			case exp == 0 || (e.expires != 0 && exp > e.expires):
				e.tiers |= bit
				e.expires = exp
			default:
				e.tiers |= bit
			}
			x.lruUnlink(i)
			x.lruPushFront(i)
			continue
		}
		i = x.alloc()
		x.ents[i] = entry{hash: h, worker: w, next: head, expires: exp, tiers: bit}
		x.blocks[h] = i
		x.lruPushFront(i)
		x.n++
		x.growW(w)
		x.perW[w]++
	}
	x.sweepSome(2*len(hashes) + 8)
	for x.max > 0 && x.n > x.max {
		x.drop(x.ents[0].prev) // least recently stored
	}
	x.mu.Unlock()
}

// Remove implements Index.
func (x *MemIndex) Remove(w WorkerID, hashes []kv.BlockHash, tier kv.Tier) {
	mask := uint8(0xff)
	if tier < kv.NumTiers {
		mask = uint8(1) << tier
	}
	x.mu.Lock()
	for _, h := range hashes {
		i := x.blocks[h]
		for i != 0 && x.ents[i].worker != w {
			i = x.ents[i].next
		}
		if i == 0 {
			continue
		}
		x.ents[i].tiers &^= mask
		if x.ents[i].tiers == 0 {
			x.drop(i)
		}
	}
	x.mu.Unlock()
}

// ClearWorker implements Index. It scans every entry; engine restarts and
// worker removals are rare.
func (x *MemIndex) ClearWorker(w WorkerID) {
	x.mu.Lock()
	if int(w) < len(x.perW) && x.perW[w] > 0 {
		for i := 1; i < len(x.ents); i++ {
			if x.ents[i].tiers != 0 && x.ents[i].worker == w {
				x.drop(uint32(i))
			}
		}
	}
	x.mu.Unlock()
}

// Sweep drops every expired entry now and returns how many it dropped.
func (x *MemIndex) Sweep() int {
	x.mu.Lock()
	before := x.n
	now := x.tick()
	for i := 1; i < len(x.ents); i++ {
		if x.ents[i].tiers != 0 && x.ents[i].dead(now) {
			x.drop(uint32(i))
		}
	}
	n := before - x.n
	x.mu.Unlock()
	return n
}

// Len implements Index.
func (x *MemIndex) Len() int {
	x.mu.RLock()
	n := x.n
	x.mu.RUnlock()
	return n
}

// WorkerBlocks implements Index.
func (x *MemIndex) WorkerBlocks(w WorkerID) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if int(w) >= len(x.perW) {
		return 0
	}
	return int(x.perW[w])
}

// Match implements Index. It walks the hashes in order and stops as soon as
// no worker still holds the whole prefix.
func (x *MemIndex) Match(hashes []kv.BlockHash, dst []Overlap) []Overlap {
	dst = dst[:0]
	if len(hashes) == 0 {
		return dst
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	now := x.tick()
	i := x.blocks[hashes[0]]
	if i == 0 {
		return dst
	}
	ps := x.scratch.Get().(*[]int32)
	pos := *ps
	if n := len(x.perW); len(pos) < n {
		pos = append(pos[:0], make([]int32, n)...)
		for k := range pos {
			pos[k] = -1
		}
	}
	for ; i != 0; i = x.ents[i].next {
		e := &x.ents[i]
		if e.dead(now) {
			continue
		}
		var o Overlap
		o.Worker, o.Depth = e.worker, 1
		o.Tiers[bits.TrailingZeros8(e.tiers)] = 1
		pos[e.worker] = int32(len(dst))
		dst = append(dst, o)
	}
	alive := len(dst)
	for d := int32(1); alive > 0 && int(d) < len(hashes); d++ {
		alive = 0
		for i = x.blocks[hashes[d]]; i != 0; i = x.ents[i].next {
			e := &x.ents[i]
			p := pos[e.worker]
			if p < 0 || dst[p].Depth != d || e.dead(now) {
				continue
			}
			dst[p].Depth++
			dst[p].Tiers[bits.TrailingZeros8(e.tiers)]++
			alive++
		}
	}
	for k := range dst {
		pos[dst[k].Worker] = -1
	}
	*ps = pos
	x.scratch.Put(ps)
	return dst
}

func (x *MemIndex) growW(w WorkerID) {
	for int(w) >= len(x.perW) {
		x.perW = append(x.perW, 0)
	}
}

func (x *MemIndex) alloc() uint32 {
	if x.free != 0 {
		i := x.free
		x.free = x.ents[i].next
		return i
	}
	x.ents = append(x.ents, entry{})
	return uint32(len(x.ents) - 1)
}

// drop unlinks entry i from its block list and the LRU and frees it.
func (x *MemIndex) drop(i uint32) {
	e := &x.ents[i]
	h := e.hash
	head := x.blocks[h]
	if head == i {
		if e.next == 0 {
			delete(x.blocks, h)
		} else {
			x.blocks[h] = e.next
		}
	} else {
		p := head
		for x.ents[p].next != i {
			p = x.ents[p].next
		}
		x.ents[p].next = e.next
	}
	x.lruUnlink(i)
	x.perW[e.worker]--
	x.n--
	*e = entry{next: x.free}
	x.free = i
}

func (x *MemIndex) lruUnlink(i uint32) {
	e := &x.ents[i]
	x.ents[e.prev].lnext = e.lnext
	x.ents[e.lnext].prev = e.prev
}

func (x *MemIndex) lruPushFront(i uint32) {
	s := &x.ents[0]
	first := s.lnext
	x.ents[i].prev = 0
	x.ents[i].lnext = first
	x.ents[first].prev = i
	x.ents[0].lnext = i
}

// sweepSome visits up to n slab slots from the sweep cursor, dropping
// expired entries, so that memory of expired entries is reclaimed in
// proportion to the store rate.
func (x *MemIndex) sweepSome(n int) {
	if len(x.ents) <= 1 {
		return
	}
	now := x.tick()
	for ; n > 0; n-- {
		x.sweepAt++
		if int(x.sweepAt) >= len(x.ents) {
			x.sweepAt = 1
		}
		if e := &x.ents[x.sweepAt]; e.tiers != 0 && e.dead(now) {
			x.drop(x.sweepAt)
		}
	}
}
