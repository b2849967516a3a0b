package router

import (
	"math"
	"math/bits"
	"sync"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

var _ Index = (*MemIndex)(nil)

// MemIndexConfig configures a MemIndex.
type MemIndexConfig struct {
	// MaxEntries bounds resident (block, worker) entries; the least recently
	// stored are pruned first (approximately). 0 means unbounded.
	MaxEntries int
	// Now is the clock used for TTLs (nil: time.Now). Tests inject a fake.
	Now func() time.Time
}

// MemIndex is the in-memory Index: one open-addressed table (linear probing,
// backward-shift deletion) of (block, worker) entries, so the workers of a
// block sit side by side and a lookup costs about one cache miss.
//
// The size bound is kept by a clock hand that drops entries not stored for
// longer than an adaptive age, counted in stored blocks (an approximate LRU;
// Store stamps a prompt's blocks last to first, so a chain loses its tail
// before its head). Expiry has one-second granularity; an entry may outlive
// its TTL by less than a second. Expired entries stop matching at once and
// are swept incrementally by Store (or at once by Sweep).
//
// Memory: 24 bytes per slot at a load factor kept between 1/8 and 3/4 (the
// table halves once deletions leave it under 1/8 full), so 32 to 192 bytes
// per resident entry.
type MemIndex struct {
	mu      sync.RWMutex
	max     int
	now     func() time.Time
	base    time.Time
	slots   []slot
	mask    uint64
	shift   uint8
	n       int     // resident entries
	perW    []int32 // resident entries per worker
	clock   uint32  // LRU clock: advances per stored block
	hand    uint64  // eviction hand
	ageMin  uint32  // adaptive eviction age
	sweepAt uint64  // expiry sweep cursor
	scratch sync.Pool
}

// slot is one (block, worker) entry; tiers == 0 marks an empty slot.
type slot struct {
	hash    kv.BlockHash
	worker  WorkerID
	expires uint32 // tick after which the entry is dead; 0 = never
	stamp   uint32 // clock at the last Store
	tiers   uint8  // bit t set: held in tier t
}

const minSlots = 1024

// NewMemIndex returns an empty in-memory index.
func NewMemIndex(cfg MemIndexConfig) *MemIndex {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	x := &MemIndex{max: cfg.MaxEntries, now: cfg.Now}
	x.base = x.now()
	x.resize(minSlots)
	x.ageMin = uint32(max(cfg.MaxEntries, 1))
	x.scratch.New = func() any { s := make([]int32, 0, 64); return &s }
	return x
}

func (x *MemIndex) resize(n int) {
	old := x.slots
	x.slots = make([]slot, n)
	x.mask = uint64(n - 1)
	x.shift = uint8(64 - bits.TrailingZeros(uint(n)))
	for i := range old {
		if s := &old[i]; s.tiers != 0 {
			j := x.home(s.hash)
			for x.slots[j].tiers != 0 {
				j = (j + 1) & x.mask
			}
			x.slots[j] = *s
		}
	}
}

// shrink halves the table while it is under 1/8 full: after an engine's
// entries are cleared, or approximate entries expire, a table sized for the
// peak would otherwise stay so for good.
func (x *MemIndex) shrink() {
	n := len(x.slots)
	for n > minSlots && x.n*8 < n {
		n /= 2
	}
	if n < len(x.slots) {
		x.resize(n)
		x.hand &= x.mask
		x.sweepAt &= x.mask
	}
}

// home is the first probe position of h (Fibonacci hashing).
func (x *MemIndex) home(h kv.BlockHash) uint64 {
	return (uint64(h) * 0x9e3779b97f4a7c15) >> x.shift
}

// find returns the slot of (h, w), or the empty slot ending its probe run.
func (x *MemIndex) find(h kv.BlockHash, w WorkerID) (uint64, bool) {
	i := x.home(h)
	for {
		s := &x.slots[i]
		if s.tiers == 0 {
			return i, false
		}
		if s.hash == h && s.worker == w {
			return i, true
		}
		i = (i + 1) & x.mask
	}
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
	el := x.now().Sub(x.base)
	if el < 0 {
		el = 0
	}
	// In unsigned nanoseconds: el + ttl cannot overflow, and a TTL beyond
	// the 32-bit ticks saturates (never wraps to an earlier tick).
	const sec = uint64(time.Second)
	t := (uint64(el)+uint64(ttl)+sec-1)/sec + 1
	return uint32(min(t, math.MaxUint32))
}

func (s *slot) dead(now uint32) bool { return s.expires != 0 && now >= s.expires }

// lockedHashes bounds the hashes one hold of the write lock stores or
// removes, so lookups wait for no more than that: an engine event of 2M
// blocks held it 287 ms in one go, and every routing decision with it (the
// twenty-ninth session's review). A Match between two holds sees part of
// the prefix stored, the tail first: it under-reports for that moment.
const lockedHashes = 4096

// Store implements Index.
func (x *MemIndex) Store(w WorkerID, hashes []kv.BlockHash, tier kv.Tier, ttl time.Duration) {
	if tier >= kv.NumTiers {
		return
	}
	for len(hashes) > 0 {
		n := max(0, len(hashes)-lockedHashes)
		x.store(w, hashes[n:], tier, ttl)
		hashes = hashes[:n]
	}
}

func (x *MemIndex) store(w WorkerID, hashes []kv.BlockHash, tier kv.Tier, ttl time.Duration) {
	bit := uint8(1) << tier
	x.mu.Lock()
	exp, now := x.expiry(ttl), x.tick()
	for k := len(hashes) - 1; k >= 0; k-- { // last to first: the head is the most recent
		h := hashes[k]
		x.clock++
		i, ok := x.find(h, w)
		if ok {
			s := &x.slots[i]
			switch {
			case s.dead(now): // a leftover: start afresh
				s.tiers, s.expires = bit, exp
			case exp == 0 || (s.expires != 0 && exp > s.expires):
				s.tiers |= bit
				s.expires = exp
			default:
				s.tiers |= bit
			}
			s.stamp = x.clock
			continue
		}
		if (x.n+1)*4 > len(x.slots)*3 {
			x.resize(len(x.slots) * 2)
			i, _ = x.find(h, w)
		}
		x.slots[i] = slot{hash: h, worker: w, expires: exp, stamp: x.clock, tiers: bit}
		x.n++
		x.growW(w)
		x.perW[w]++
	}
	x.sweepSome(2*len(hashes)+8, now)
	for x.max > 0 && x.n > x.max {
		x.evictOne(now)
	}
	x.shrink()
	x.mu.Unlock()
}

// Touch marks w's entries of hashes as recently used, so that the size
// bound prunes them last, without storing any that are absent or changing
// tiers and expiry. Event-mode entries are stored once, by the engine's
// event, while every cache hit keeps them hot in the engine: the router
// touches the prefix a request hits, or the bound would prune the hottest
// prefixes (a system prompt) first.
func (x *MemIndex) Touch(w WorkerID, hashes []kv.BlockHash) {
	if len(hashes) == 0 || x.max <= 0 { // unbounded: stamps are unused
		return
	}
	x.mu.Lock()
	for _, h := range hashes {
		if i, ok := x.find(h, w); ok {
			x.slots[i].stamp = x.clock
		}
	}
	x.mu.Unlock()
}

// Remove implements Index.
func (x *MemIndex) Remove(w WorkerID, hashes []kv.BlockHash, tier kv.Tier) {
	for len(hashes) > 0 {
		n := min(len(hashes), lockedHashes)
		x.remove(w, hashes[:n], tier)
		hashes = hashes[n:]
	}
}

func (x *MemIndex) remove(w WorkerID, hashes []kv.BlockHash, tier kv.Tier) {
	mask := uint8(0xff)
	if tier < kv.NumTiers {
		mask = uint8(1) << tier
	}
	x.mu.Lock()
	for _, h := range hashes {
		if i, ok := x.find(h, w); ok {
			x.slots[i].tiers &^= mask
			if x.slots[i].tiers == 0 {
				x.delete(i)
			}
		}
	}
	x.shrink()
	x.mu.Unlock()
}

// ClearWorker implements Index. It scans the table; engine restarts and
// worker removals are rare.
func (x *MemIndex) ClearWorker(w WorkerID) {
	x.mu.Lock()
	if int(w) < len(x.perW) && x.perW[w] > 0 {
		x.deleteWhere(func(s *slot) bool { return s.worker == w })
		x.shrink()
	}
	x.mu.Unlock()
}

// Sweep drops every expired entry now and returns how many it dropped.
func (x *MemIndex) Sweep() int {
	x.mu.Lock()
	before := x.n
	now := x.tick()
	x.deleteWhere(func(s *slot) bool { return s.dead(now) })
	x.shrink()
	n := before - x.n
	x.mu.Unlock()
	return n
}

// deleteWhere deletes every entry matching f in one pass. Backward shifts
// only move entries into the hole at the cursor or after it, so the slot at
// the cursor is examined again after a deletion.
func (x *MemIndex) deleteWhere(f func(*slot) bool) {
	for i := uint64(0); i < uint64(len(x.slots)); {
		if s := &x.slots[i]; s.tiers != 0 && f(s) {
			x.delete(i)
			continue
		}
		i++
	}
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
	ps := x.scratch.Get().(*[]int32)
	pos := *ps
	if n := len(x.perW); len(pos) < n {
		pos = append(pos, make([]int32, n-len(pos))...)
		for k := range pos {
			pos[k] = -1
		}
	}
	slots, mask := x.slots, x.mask
	h := hashes[0]
	for i := x.home(h); slots[i].tiers != 0; i = (i + 1) & mask {
		s := &slots[i]
		if s.hash != h || s.dead(now) {
			continue
		}
		var o Overlap
		o.Worker, o.Depth = s.worker, 1
		o.Tiers[bits.TrailingZeros8(s.tiers)] = 1
		pos[s.worker] = int32(len(dst))
		dst = append(dst, o)
	}
	alive := len(dst) // workers holding the whole prefix so far
	for d := int32(1); alive > 0 && int(d) < len(hashes); d++ {
		prev := alive
		alive = 0
		h = hashes[d]
		// Stop at the end of the probe run, or once every worker still in
		// the running is found.
		for i := x.home(h); alive < prev && slots[i].tiers != 0; i = (i + 1) & mask {
			s := &slots[i]
			if s.hash != h {
				continue
			}
			p := pos[s.worker]
			if p < 0 || dst[p].Depth != d || s.dead(now) {
				continue
			}
			dst[p].Depth++
			dst[p].Tiers[bits.TrailingZeros8(s.tiers)]++
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

// delete empties slot i and shifts the rest of its probe run back.
func (x *MemIndex) delete(i uint64) {
	x.perW[x.slots[i].worker]--
	x.n--
	for j := (i + 1) & x.mask; ; j = (j + 1) & x.mask {
		s := &x.slots[j]
		if s.tiers == 0 {
			break
		}
		// s may fill the hole at i if its home is not cyclically in (i, j].
		if (j-x.home(s.hash))&x.mask >= (j-i)&x.mask {
			x.slots[i] = *s
			i = j
		}
	}
	x.slots[i] = slot{}
}

// evictOne advances the clock hand to the next entry that is expired or has
// not been stored for ageMin blocks, and drops it. ageMin falls when such
// entries are scarce and rises slowly after each eviction, so the hand
// keeps taking roughly the oldest entries.
func (x *MemIndex) evictOne(now uint32) {
	for scanned := 1; ; scanned++ {
		x.hand = (x.hand + 1) & x.mask
		s := &x.slots[x.hand]
		if s.tiers != 0 && (s.dead(now) || x.clock-s.stamp >= x.ageMin) {
			x.delete(x.hand)
			x.ageMin += x.ageMin>>5 + 1
			return
		}
		if scanned%32 == 0 && x.ageMin > 0 {
			x.ageMin -= x.ageMin>>3 + 1 // at 0 every entry qualifies
		}
	}
}

// sweepSome visits n slots from the sweep cursor, dropping expired entries,
// so that memory of expired entries is reclaimed in proportion to the store
// rate.
func (x *MemIndex) sweepSome(n int, now uint32) {
	for ; n > 0; n-- {
		x.sweepAt = (x.sweepAt + 1) & x.mask
		if s := &x.slots[x.sweepAt]; s.tiers != 0 && s.dead(now) {
			x.delete(x.sweepAt)
		}
	}
}
