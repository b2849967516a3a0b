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
	// copy: with copies kept, the next cached block of the same hash
	// after this one (noBlock: none); set while cached.
	copy int32
	// cached: findable by hash (in the index, or as a copy of the block
	// there), so a later prompt can hit it.
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
	// copies: a full block whose hash another block already holds is
	// cached too (ModelConfig.DuplicateBlocks); the index holds one of
	// them, the rest hang off it by their copy links.
	copies bool
}

func newBlockCache(n int, copies bool) *blockCache {
	c := &blockCache{
		copies: copies,
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
		c.forget(b)
		c.blocks[b].cached = false
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

// register makes a full block findable by hash. If another block already
// holds the same prefix, this one is kept as a copy of it when the cache
// keeps copies, and otherwise stays anonymous and is freed on release. It
// reports whether the block was cached, and whether as a copy.
func (c *blockCache) register(b int32) (cached, copy bool) {
	bl := &c.blocks[b]
	bl.copy = noBlock
	if !c.index.insert(bl.hash, b) {
		if !c.copies {
			return false, false
		}
		first, _ := c.index.get(bl.hash)
		bl.copy = c.blocks[first].copy
		c.blocks[first].copy = b
		copy = true
	}
	bl.cached = true
	return true, copy
}

// forget makes cached block b unfindable: the index entry goes, or passes
// to its next copy, or b leaves its copy chain.
func (c *blockCache) forget(b int32) {
	bl := &c.blocks[b]
	first, _ := c.index.get(bl.hash)
	switch {
	case first == b && bl.copy == noBlock:
		c.index.remove(bl.hash)
	case first == b:
		c.index.replace(bl.hash, bl.copy)
	default:
		for p := first; p != noBlock; p = c.blocks[p].copy {
			if c.blocks[p].copy == b {
				c.blocks[p].copy = bl.copy
				break
			}
		}
	}
}
