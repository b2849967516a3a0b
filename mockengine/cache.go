package mockengine

import "github.com/kvproxy/kvproxy/kv"

const noBlock = -1

// block is one KV block slot of the device cache.
type block struct {
	hash   kv.BlockHash // engine hash of the prefix ending here, set once full
	rhash  kv.BlockHash // router-scheme hash of the same prefix (debug view)
	parent kv.BlockHash // engine hash of the block before, if hasParent
	ref    int32        // running sequences holding this block
	prev   int32        // LRU links, valid while ref == 0 and cached
	next   int32
	// cached: registered in the index under hash, so a later prompt can hit it.
	cached    bool
	hasParent bool
}

// blockCache is the device KV cache: a fixed slab of blocks, a hash index of
// the full blocks, and an LRU list of the cached blocks no sequence holds.
// Referenced blocks are never evicted; a block that is neither referenced nor
// cached sits on the free stack.
type blockCache struct {
	blocks     []block
	free       []int32
	index      blockIndex
	head, tail int32 // LRU: head is evicted first
	nLRU       int
	used       int // blocks with ref > 0
}

func newBlockCache(n int) *blockCache {
	c := &blockCache{
		blocks: make([]block, n),
		free:   make([]int32, n),
		index:  newBlockIndex(n),
		head:   noBlock,
		tail:   noBlock,
	}
	for i := range c.free {
		c.free[i] = int32(n - 1 - i) // pop order 0, 1, 2...
	}
	return c
}

// available is how many blocks alloc can hand out now.
func (c *blockCache) available() int { return len(c.free) + c.nLRU }

func (c *blockCache) unlink(b int32) {
	bl := &c.blocks[b]
	if bl.prev != noBlock {
		c.blocks[bl.prev].next = bl.next
	} else {
		c.head = bl.next
	}
	if bl.next != noBlock {
		c.blocks[bl.next].prev = bl.prev
	} else {
		c.tail = bl.prev
	}
	bl.prev, bl.next = noBlock, noBlock
	c.nLRU--
}

func (c *blockCache) pushTail(b int32) {
	bl := &c.blocks[b]
	bl.prev, bl.next = c.tail, noBlock
	if c.tail != noBlock {
		c.blocks[c.tail].next = b
	} else {
		c.head = b
	}
	c.tail = b
	c.nLRU++
}

// alloc hands out a block with ref 1, evicting the least recently used
// cached block when nothing is free; an evicted block keeps its hashes until
// the caller overwrites them. The caller checks available first.
func (c *blockCache) alloc() (b int32, evicted bool) {
	if n := len(c.free); n > 0 {
		b = c.free[n-1]
		c.free = c.free[:n-1]
	} else {
		b = c.head
		c.unlink(b)
		bl := &c.blocks[b]
		c.index.remove(bl.hash)
		bl.cached = false
		evicted = true
	}
	c.blocks[b].ref = 1
	c.used++
	return b, evicted
}

// acquire takes a reference on a cached block found by a prefix hit.
func (c *blockCache) acquire(b int32) {
	bl := &c.blocks[b]
	if bl.ref == 0 {
		c.unlink(b)
		c.used++
	}
	bl.ref++
}

// release drops a reference; an unreferenced block becomes evictable if it is
// cached, free otherwise.
func (c *blockCache) release(b int32) {
	bl := &c.blocks[b]
	bl.ref--
	if bl.ref > 0 {
		return
	}
	c.used--
	if bl.cached {
		c.pushTail(b)
	} else {
		c.free = append(c.free, b)
	}
}

// register makes a full block findable by hash, unless another block already
// holds the same prefix (then this one stays anonymous and is freed on
// release). It reports whether the block was registered.
func (c *blockCache) register(b int32) bool {
	bl := &c.blocks[b]
	if !c.index.insert(bl.hash, b) {
		return false
	}
	bl.cached = true
	return true
}
