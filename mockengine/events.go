package mockengine

import "github.com/kvproxy/kvproxy/kv"

// eventLog collects cache events between drains. A stored block whose
// parent is the last block of the previous BlockStored event (same tier)
// extends that event, as vLLM batches a sequence's blocks.
type eventLog struct {
	on     bool
	list   []kv.Event
	hashes []uint64 // backing storage of EngineHashes
	tokens []uint32 // backing storage of Tokens
}

// salt is the sequence's cache_salt, reported with block 0 (vLLM's
// extra_keys); lora its adapter, reported with every block (lora_name).
func (l *eventLog) stored(parent kv.BlockHash, hasParent bool, h kv.BlockHash, toks []uint32, tier kv.Tier, salt, lora string) {
	if !l.on {
		return
	}
	if n := len(l.list); n > 0 && hasParent {
		e := &l.list[n-1]
		if e.Kind == kv.BlockStored && e.Tier == tier && e.LoRAName == lora && e.EngineHashes[len(e.EngineHashes)-1] == uint64(parent) {
			// The event's slices end where the backing storage ends, so
			// appending to storage and re-slicing extends them.
			hs := len(l.hashes) - len(e.EngineHashes)
			ts := len(l.tokens) - len(e.Tokens)
			l.hashes = append(l.hashes, uint64(h))
			l.tokens = append(l.tokens, toks...)
			e.EngineHashes = l.hashes[hs:len(l.hashes):len(l.hashes)]
			e.Tokens = l.tokens[ts:len(l.tokens):len(l.tokens)]
			return
		}
	}
	hs, ts := len(l.hashes), len(l.tokens)
	l.hashes = append(l.hashes, uint64(h))
	l.tokens = append(l.tokens, toks...)
	l.list = append(l.list, kv.Event{
		Kind:         kv.BlockStored,
		EngineHashes: l.hashes[hs:len(l.hashes):len(l.hashes)],
		HasParent:    hasParent,
		EngineParent: uint64(parent),
		Tokens:       l.tokens[ts:len(l.tokens):len(l.tokens)],
		BlockSize:    len(toks),
		Tier:         tier,
		CacheSalt:    salt,
		LoRAName:     lora,
	})
}

func (l *eventLog) removed(h kv.BlockHash, tier kv.Tier) {
	if !l.on {
		return
	}
	n := len(l.list)
	if n > 0 && l.list[n-1].Kind == kv.BlockRemoved && l.list[n-1].Tier == tier {
		e := &l.list[n-1]
		hs := len(l.hashes) - len(e.EngineHashes)
		l.hashes = append(l.hashes, uint64(h))
		e.EngineHashes = l.hashes[hs:len(l.hashes):len(l.hashes)]
		return
	}
	hs := len(l.hashes)
	l.hashes = append(l.hashes, uint64(h))
	l.list = append(l.list, kv.Event{Kind: kv.BlockRemoved, EngineHashes: l.hashes[hs:len(l.hashes):len(l.hashes)], Tier: tier})
}

func (l *eventLog) cleared() {
	if !l.on {
		return
	}
	l.list = append(l.list, kv.Event{Kind: kv.AllBlocksCleared})
}

// DrainEvents appends the cache events recorded since the last drain (when
// recording is on: ModelConfig.RecordEvents, SetRecordEvents) and forgets
// them. The events' slices are never overwritten by the Model, so the
// caller may keep them.
func (m *Model) DrainEvents(dst []kv.Event) []kv.Event {
	l := &m.events
	dst = append(dst, l.list...)
	clear(l.list)
	l.list = l.list[:0]
	// Start fresh storage after what was handed out: later appends either use
	// the unused tail of the arrays or new ones, never the drained part.
	l.hashes = l.hashes[len(l.hashes):]
	l.tokens = l.tokens[len(l.tokens):]
	return dst
}
