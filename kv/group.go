package kv

// GroupFollower chooses which KV cache group of a hybrid model's events is
// followed (see the package comment of VLLMDecoder): group 0 (or events
// without a group) until a BlockStored names its group's kind, then the
// lowest group of full attention, or if none has been seen the lowest of
// the best kind seen. An AllBlocksCleared makes the choice again: the
// engine's cache is empty, and what comes may be of another layout (an
// engine restarted with another model). The zero value follows group 0.
// Not safe for concurrent use.
type GroupFollower struct {
	group int64
	rank  int // groupRank of the group's kind, once set
	set   bool
}

// Follow reports whether an event of kind, group and (for a BlockStored,
// "" when unnamed) group kind is to be followed, changing group first if
// the event names a better one. changed says the group followed changed:
// what was followed until then may be indexed, and has to be cleared
// before this event.
func (f *GroupFollower) Follow(kind EventKind, group int64, groupKind string) (follow, changed bool) {
	if kind == AllBlocksCleared {
		f.Forget()
		return true, false
	}
	if kind == BlockStored && groupKind != "" {
		rank := groupRank(groupKind)
		if f.set && group == f.group && rank != f.rank {
			// The group followed changed kind: the engine restarted with
			// another layout (hybrid allocation turned on or off, another
			// model). The choice is made again (the review).
			f.set = false
		}
		if !f.set || rank > f.rank || rank == f.rank && group < f.group {
			changed = group != f.group
			f.group, f.rank, f.set = group, rank, true
		}
	}
	return group == f.group, changed
}

// Forget makes the choice again from the events that come (group 0 until
// one names its kind), without a clear: for a feed whose ranks were just
// cleared.
func (f *GroupFollower) Forget() { *f = GroupFollower{} }

// groupRank ranks a KV cache group's kind: 2 for full attention, which keeps
// every block of a prefix while it is cached; 0 for a sliding window's, a
// chunked local attention's, Mamba's (one state), an encoder's or cross
// attention's; 1 for "unknown" (vLLM's name for a group of mixed kinds) and
// kinds newer than these lists.
func groupRank(kind string) int {
	switch kind {
	case "full_attention", "mla_attention", "sink_full_attention":
		return 2
	case "sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba", "encoder_only_attention", "cross_attention":
		return 0
	}
	return 1
}
