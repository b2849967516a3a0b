package mockengine

import (
	"testing"

	"github.com/kvproxy/kvproxy/kv"
)

// Blocks evicted from the device move to the host tier; a later hit there is
// loaded for a transfer time instead of recomputed, and events say so.
func TestHostTier(t *testing.T) {
	const load = 200_000 // ns per block
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 8, HostCacheBlocks: 8, HostLoadPerBlock: load, RecordEvents: true})
	a := toks(64, 1)
	mustAdd(t, m, &Seq{ID: 1, Prompt: a, MaxTokens: 1})
	run(t, m)
	aHashes := m.DrainEvents(nil)[0].EngineHashes
	// Two other prompts push all of a's blocks off the device.
	mustAdd(t, m, &Seq{ID: 2, Prompt: toks(64, 2), MaxTokens: 1})
	run(t, m)
	mustAdd(t, m, &Seq{ID: 3, Prompt: toks(64, 3), MaxTokens: 1})
	run(t, m)
	ev := m.DrainEvents(nil)
	movedToHost := map[uint64]kv.Event{}
	removedFromDevice := map[uint64]bool{}
	for _, e := range ev {
		for i, h := range e.EngineHashes {
			switch {
			case e.Kind == kv.BlockStored && e.Tier == kv.TierHost:
				if len(e.Tokens) != 16*len(e.EngineHashes) {
					t.Fatalf("host stored event without tokens: %+v", e)
				}
				movedToHost[h] = kv.Event{HasParent: e.HasParent, EngineParent: e.EngineParent, Tokens: e.Tokens[i*16 : (i+1)*16]}
			case e.Kind == kv.BlockRemoved && e.Tier == kv.TierDevice:
				removedFromDevice[h] = true
			}
		}
	}
	for i, h := range aHashes {
		if !removedFromDevice[h] {
			t.Fatalf("block %d of a not removed from the device", i)
		}
		e, ok := movedToHost[h]
		if !ok {
			t.Fatalf("block %d of a not stored in the host tier", i)
		}
		if e.HasParent != (i > 0) || (i > 0 && e.EngineParent != aHashes[i-1]) || e.Tokens[0] != a[i*16] {
			t.Fatalf("host copy of block %d has wrong parent or tokens: %+v", i, e)
		}
	}
	if m.HostBlocks() != 4 {
		t.Fatalf("host tier holds %d blocks, want a's 4", m.HostBlocks())
	}

	// a again: 3 blocks come from the host (the 4th is always computed).
	s := mustAdd(t, m, &Seq{ID: 4, Prompt: a, MaxTokens: 1})
	d, _ := m.Step()
	if s.CachedTokens() != 48 {
		t.Fatalf("host hit: %d cached tokens, want 48", s.CachedTokens())
	}
	if want := StepTime(16, 0, 0) + 3*load; !near(d, want) {
		t.Fatalf("step with host loads took %v, want %v", d, want)
	}
	if c := m.Counters(); c.HostHits != 48 || c.PrefixHits != 0 {
		t.Fatalf("counters %+v", c)
	}
	// Loads interleave with the evictions they cause, so they may span
	// several events; together they are a's blocks in order.
	var loaded []uint64
	for _, e := range m.DrainEvents(nil) {
		if e.Kind == kv.BlockStored && e.Tier == kv.TierDevice {
			if e.HasParent != (len(loaded) > 0) || (len(loaded) > 0 && e.EngineParent != loaded[len(loaded)-1]) {
				t.Fatalf("device stored event breaks the chain: %+v", e)
			}
			loaded = append(loaded, e.EngineHashes...)
		}
	}
	if len(loaded) != 4 { // 3 loaded + the recomputed last block
		t.Fatalf("%d blocks stored on the device after the reload, want 4", len(loaded))
	}
	for i := range loaded {
		if loaded[i] != aHashes[i] {
			t.Fatalf("reloaded block %d has hash %x, want %x", i, loaded[i], aHashes[i])
		}
	}
	var host, dev int
	for _, r := range m.AppendResident(nil) {
		if r.Tier == kv.TierHost {
			host++
		} else {
			dev++
		}
	}
	if host != m.HostBlocks() || dev != m.CachedBlocks() {
		t.Fatalf("resident: %d host %d device", host, dev)
	}
}

// The host tier is an LRU of its own: overflowing it removes blocks with
// medium CPU.
func TestHostTierEviction(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 5, HostCacheBlocks: 4, RecordEvents: true})
	for i := uint32(1); i <= 4; i++ {
		mustAdd(t, m, &Seq{ID: uint64(i), Prompt: toks(64, i), MaxTokens: 1})
		run(t, m)
	}
	var hostRemoved int
	for _, e := range m.DrainEvents(nil) {
		if e.Kind == kv.BlockRemoved && e.Tier == kv.TierHost {
			hostRemoved += len(e.EngineHashes)
		}
	}
	// 16 distinct blocks computed, 5 on the device, 4 on the host: every
	// other one went through the host and out again.
	if hostRemoved != 7 || m.HostBlocks() != 4 || m.CachedBlocks() != 5 {
		t.Fatalf("host removed %d, host %d, device %d", hostRemoved, m.HostBlocks(), m.CachedBlocks())
	}
	s := mustAdd(t, m, &Seq{ID: 9, Prompt: toks(64, 1), MaxTokens: 1})
	run(t, m)
	if s.CachedTokens() != 0 {
		t.Fatalf("prompt 1 left both tiers, yet %d cached", s.CachedTokens())
	}
}

// Recording switched on late (as Engine.PublishEvents does) still reports
// the tokens of blocks cached before, when they move to the host tier.
func TestEventsSwitchedOnLate(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 5, HostCacheBlocks: 8})
	a := toks(64, 1)
	mustAdd(t, m, &Seq{ID: 1, Prompt: a, MaxTokens: 1})
	run(t, m)
	m.SetRecordEvents(true)
	mustAdd(t, m, &Seq{ID: 2, Prompt: toks(64, 2), MaxTokens: 1})
	run(t, m)
	var host int
	for _, e := range m.DrainEvents(nil) {
		if e.Kind != kv.BlockStored || e.Tier != kv.TierHost {
			continue
		}
		for i := range e.EngineHashes {
			tk := e.Tokens[i*16 : (i+1)*16]
			found := false
			for b := 0; b < 4; b++ {
				found = found || tk[0] == a[b*16] && tk[15] == a[b*16+15]
			}
			if !found || e.BlockSize != 16 {
				t.Fatalf("host block %d has tokens %v, not a block of a", i, tk)
			}
			host++
		}
	}
	// b needs 4 blocks: 1 free, 3 evicted from a.
	if host != 3 {
		t.Fatalf("%d of a's blocks reported moving to the host, want 3", host)
	}
}
