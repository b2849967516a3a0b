package mockengine

import (
	"math/bits"

	"github.com/kvproxy/kvproxy/kv"
)

// blockIndex maps block hashes to slots: open addressing with linear probing
// and backward-shift deletion, sized once for at most max entries at load
// ≤ 1/2. The caches insert and delete all the time at a steady size; a
// tombstone-free table keeps lookups of absent hashes (most prefix lookups
// and every registration) short where a Go map slows down.
type blockIndex struct {
	slots []indexSlot
	shift uint8
	n     int
}

// indexSlot keeps a key beside its value: one cache line per probe.
type indexSlot struct {
	key kv.BlockHash
	val int32 // noBlock: empty slot
}

func newBlockIndex(max int) blockIndex {
	size := 8
	for size < 2*max {
		size <<= 1
	}
	ix := blockIndex{
		slots: make([]indexSlot, size),
		shift: uint8(64 - bits.TrailingZeros(uint(size))),
	}
	for i := range ix.slots {
		ix.slots[i].val = noBlock
	}
	return ix
}

// home is the slot a hash probes first (Fibonacci hashing: robust even for
// keys that are not uniformly spread).
func (ix *blockIndex) home(h kv.BlockHash) int {
	return int((uint64(h) * 0x9E3779B97F4A7C15) >> ix.shift)
}

func (ix *blockIndex) len() int { return ix.n }

func (ix *blockIndex) get(h kv.BlockHash) (int32, bool) {
	mask := len(ix.slots) - 1
	for i := ix.home(h); ; i = (i + 1) & mask {
		s := &ix.slots[i]
		if s.val == noBlock {
			return noBlock, false
		}
		if s.key == h {
			return s.val, true
		}
	}
}

// insert adds h → v unless h is present; it reports whether it added. The
// caller never holds more than the max entries the index was sized for.
func (ix *blockIndex) insert(h kv.BlockHash, v int32) bool {
	mask := len(ix.slots) - 1
	for i := ix.home(h); ; i = (i + 1) & mask {
		s := &ix.slots[i]
		if s.val == noBlock {
			*s = indexSlot{h, v}
			ix.n++
			return true
		}
		if s.key == h {
			return false
		}
	}
}

// replace points h, which must be present, at v.
func (ix *blockIndex) replace(h kv.BlockHash, v int32) {
	mask := len(ix.slots) - 1
	for i := ix.home(h); ix.slots[i].val != noBlock; i = (i + 1) & mask {
		if ix.slots[i].key == h {
			ix.slots[i].val = v
			return
		}
	}
}

// remove deletes h if present, shifting later entries of its probe run back
// so no tombstone is left.
func (ix *blockIndex) remove(h kv.BlockHash) {
	mask := len(ix.slots) - 1
	i := ix.home(h)
	for {
		if ix.slots[i].val == noBlock {
			return
		}
		if ix.slots[i].key == h {
			break
		}
		i = (i + 1) & mask
	}
	for j := (i + 1) & mask; ix.slots[j].val != noBlock; j = (j + 1) & mask {
		// The entry at j may fill the hole at i if its home is not in the
		// cyclic range (i, j].
		if (j-ix.home(ix.slots[j].key))&mask >= (j-i)&mask {
			ix.slots[i] = ix.slots[j]
			i = j
		}
	}
	ix.slots[i].val = noBlock
	ix.n--
}

// each calls f for every entry, in slot order.
func (ix *blockIndex) each(f func(h kv.BlockHash, v int32)) {
	for _, s := range ix.slots {
		if s.val != noBlock {
			f(s.key, s.val)
		}
	}
}
