package mockengine

import "github.com/kvproxy/kvproxy/kv"

// hostEntry is one block in the host (CPU) tier.
type hostEntry struct {
	hash, rhash, parent kv.BlockHash
	hasParent           bool
	prev, next          int32
}

// hostCache is the host tier: blocks evicted from the device land here, in
// an LRU of its own capacity, and a prefix hit here is loaded back to the
// device for a transfer time instead of being recomputed. Entries are never
// referenced (a load copies), so every entry is evictable.
type hostCache struct {
	entries    []hostEntry
	tokens     []uint32 // BlockSize tokens per entry, for events
	bs         int
	index      blockIndex
	head, tail int32 // head is evicted first
	n          int   // entries in use (slots n.. are unused)
}

func newHostCache(n, bs int) *hostCache {
	return &hostCache{
		entries: make([]hostEntry, n),
		tokens:  make([]uint32, n*bs),
		bs:      bs,
		index:   newBlockIndex(n),
		head:    noBlock,
		tail:    noBlock,
	}
}

func (h *hostCache) blockTokens(i int32) []uint32 {
	return h.tokens[int(i)*h.bs : int(i+1)*h.bs]
}

func (h *hostCache) unlink(i int32) {
	e := &h.entries[i]
	if e.prev != noBlock {
		h.entries[e.prev].next = e.next
	} else {
		h.head = e.next
	}
	if e.next != noBlock {
		h.entries[e.next].prev = e.prev
	} else {
		h.tail = e.prev
	}
}

func (h *hostCache) pushTail(i int32) {
	e := &h.entries[i]
	e.prev, e.next = h.tail, noBlock
	if h.tail != noBlock {
		h.entries[h.tail].next = i
	} else {
		h.head = i
	}
	h.tail = i
}

// touch marks an entry most recently used.
func (h *hostCache) touch(i int32) {
	if h.tail != i {
		h.unlink(i)
		h.pushTail(i)
	}
}

// put stores a block (or refreshes it if present). It reports the hash of
// the entry it had to evict, if any, and whether the block is new here.
func (h *hostCache) put(hash, rhash, parent kv.BlockHash, hasParent bool, toks []uint32) (evicted kv.BlockHash, didEvict, added bool) {
	if i, ok := h.index.get(hash); ok {
		h.touch(i)
		return 0, false, false
	}
	var i int32
	if h.n < len(h.entries) {
		i = int32(h.n)
		h.n++
	} else {
		i = h.head
		h.unlink(i)
		evicted, didEvict = h.entries[i].hash, true
		h.index.remove(evicted)
	}
	h.entries[i] = hostEntry{hash: hash, rhash: rhash, parent: parent, hasParent: hasParent}
	h.pushTail(i)
	h.index.insert(hash, i)
	copy(h.blockTokens(i), toks)
	return evicted, didEvict, true
}
