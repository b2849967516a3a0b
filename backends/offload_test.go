package backends

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvproxy/kvproxy/kv"
)

// copyOf is a BlockStored without tokens: the engine now also holds the
// blocks of these engine hashes in tier (vLLM's CPU offloading).
func copyOf(tier kv.Tier, hashes ...uint64) kv.Event {
	return kv.Event{Kind: kv.BlockStored, EngineHashes: hashes, Tier: tier}
}

// A copy adds its tier to the blocks the applier knows, indexes the router
// blocks they end there, and skips (counts) engine hashes it does not know.
func TestKVApplyCopies(t *testing.T) {
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "b"}, r)
	toks := tokens(48, 5)
	a.ApplyEvents(0, []kv.Event{stored([]uint64{1, 2, 3}, nil, toks, kv.TierDevice)})
	a.ApplyEvents(0, []kv.Event{copyOf(kv.TierHost, 2, 99), copyOf(kv.TierHost, 2)})
	s := a.Stats()
	if s.Blocks[kv.TierDevice] != 3 || s.Blocks[kv.TierHost] != 1 || s.UnknownCopies != 1 || s.StoredBlocks != 5 || s.BlockSizeMismatch != 0 {
		t.Fatalf("stats %+v", s)
	}
	// Evicted from the GPU, block 2 is still matched, in host memory.
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{2}, Tier: kv.TierDevice}})
	if d, tiers := depth(t, r, "b", toks, 0); d != 3 || tiers[kv.TierDevice] != 2 || tiers[kv.TierHost] != 1 {
		t.Fatalf("depth %d tiers %v after the GPU eviction", d, tiers)
	}
	a.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{2}, Tier: kv.TierHost}})
	if d, _ := depth(t, r, "b", toks, 0); d != 1 {
		t.Fatalf("depth %d after the CPU eviction", d)
	}
	if s := a.Stats(); s.UnknownRemovals != 0 || s.Blocks[kv.TierHost] != 0 {
		t.Fatalf("stats %+v", s)
	}

	// A copy of a partial engine block (smaller than the router's) records
	// its tier, so its removal from that tier is known; nothing is indexed.
	pr := newRouter(t)
	p := NewKVApplier(KVApplierConfig{Backend: "sg"}, pr)
	p.ApplyEvents(0, pages(toks[:16], 8, 1000, nil))
	p.ApplyEvents(0, []kv.Event{copyOf(kv.TierHost, 1000)})
	p.ApplyEvents(0, []kv.Event{{Kind: kv.BlockRemoved, EngineHashes: []uint64{1000}, Tier: kv.TierHost}})
	if s := p.Stats(); s.Blocks[kv.TierHost] != 0 || s.UnknownRemovals != 0 || s.UnknownCopies != 0 || pr.Index().Len() != 1 {
		t.Fatalf("partial block copy: stats %+v, index %d", s, pr.Index().Len())
	}

	// A shared cache layer indexes copies in tier shared too.
	sh := NewKVApplier(KVApplierConfig{Backend: "lmcache", Shared: true}, r)
	sh.ApplyEvents(0, []kv.Event{stored([]uint64{1}, nil, toks[:16], kv.TierDevice), copyOf(kv.TierHost, 1)})
	if s := sh.Stats(); s.Blocks[kv.TierShared] != 1 || s.Blocks[kv.TierHost] != 0 {
		t.Fatalf("shared: stats %+v", s)
	}
}

// encodeBatch writes [ts, [events...], rank] with each event written by fn.
func encodeBatch(t *testing.T, rank int, events ...func(*msgpack.Encoder) error) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(enc.EncodeArrayLen(3))
	must(enc.EncodeFloat64(1))
	must(enc.EncodeArrayLen(len(events)))
	for _, ev := range events {
		must(ev(enc))
	}
	must(enc.EncodeInt(int64(rank)))
	return buf.Bytes()
}

// encodeValues writes vs in msgpack, in order.
func encodeValues(vs ...any) func(*msgpack.Encoder) error {
	return func(enc *msgpack.Encoder) error {
		if err := enc.EncodeArrayLen(len(vs)); err != nil {
			return err
		}
		for _, v := range vs {
			if err := enc.Encode(v); err != nil {
				return err
			}
		}
		return nil
	}
}

func startFeed(t *testing.T, eng *testEngine) *KVFeed {
	t.Helper()
	feed, err := StartKVFeed(KVFeedConfig{Backend: "e0", Mode: FeedZMQ, ZMQ: ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: eng.replayAddr()}}, newRouter(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(feed.Close)
	f := &subFixture{t: t, eng: eng, sub: feed.Subscriber()}
	f.warmUp()
	return feed
}

func waitSeq(t *testing.T, feed *KVFeed, seq uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := feed.Subscriber().Wait(ctx, func(s ZMQStats) bool { return s.LastSeq == int64(seq) }); err != nil {
		t.Fatal(err)
	}
}

// vLLM's OffloadingConnector reports the blocks it copies to CPU memory as
// BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[],
// block_size=0 (older versions: the block size), medium="CPU"). Such a
// batch used to fail to decode, and the subscriber dropped every block of
// the backend; now the known block gains tier host.
func TestZMQOffloadCopiesKeepTheIndex(t *testing.T) {
	eng := newTestEngine(t, 100)
	feed := startFeed(t, eng)
	eng.publish(0, stored([]uint64{10, 11, 12}, nil, tokens(48, 1), kv.TierDevice))
	eng.publishRaw(encodeBatch(t, 0, encodeValues("BlockStored", []uint64{11}, nil, []int{}, 16, nil, "CPU", nil)))
	waitSeq(t, feed, eng.publish(0, copyOf(kv.TierHost, 12, 99))) // block_size 0
	st := feed.Stats()
	if st.Apply.Blocks[kv.TierDevice] != 3 || st.Apply.Blocks[kv.TierHost] != 2 || st.Apply.UnknownCopies != 1 ||
		st.ZMQ.DecodeErrors != 0 || st.ZMQ.Clears != 0 || st.ZMQ.MalformedEvents != 0 {
		t.Fatalf("after the CPU copies: apply %+v, zmq %+v", st.Apply, *st.ZMQ)
	}
	// The offloader's eviction: BlockRemoved(block_hashes=[h], medium="CPU").
	waitSeq(t, feed, eng.publish(0, kv.Event{Kind: kv.BlockRemoved, EngineHashes: []uint64{11}, Tier: kv.TierHost}))
	if st2 := feed.Stats(); st2.Apply.Blocks[kv.TierDevice] != 3 || st2.Apply.Blocks[kv.TierHost] != 1 || st2.Apply.UnknownRemovals != st.Apply.UnknownRemovals {
		t.Fatalf("after the CPU eviction: apply %+v", st2.Apply)
	}
}

// An event that cannot be read no longer drops its batch (and every block
// of the backend): a BlockStored is skipped; a BlockRemoved, whose removals
// are then unknown, drops its rank's blocks in its place; the rest of the
// batch is applied either way.
func TestZMQMalformedEventSkipped(t *testing.T) {
	eng := newTestEngine(t, 100)
	feed := startFeed(t, eng)
	eng.publish(0, stored([]uint64{10, 11, 12}, nil, tokens(48, 1), kv.TierDevice))
	seq := eng.publishRaw(encodeBatch(t, 0,
		encodeValues("BlockStored", []uint64{20}, nil, []int{1, 2, 3}, 16, nil, "GPU", nil), // 3 tokens for a block of 16
		encodeValues("BlockRemoved", []uint64{12}, "GPU"),
	))
	waitSeq(t, feed, seq)
	st := feed.Stats()
	if st.Apply.Blocks[kv.TierDevice] != 2 || st.ZMQ.MalformedEvents != 1 || st.ZMQ.Clears != 0 || st.ZMQ.DecodeErrors != 0 ||
		!strings.Contains(st.ZMQ.LastError, "malformed event in batch") {
		t.Fatalf("after a bad BlockStored: apply %+v, zmq %+v", st.Apply, *st.ZMQ)
	}
	seq = eng.publishRaw(encodeBatch(t, 0,
		encodeValues("BlockRemoved", []any{nil}, "GPU"), // a nil hash
		encodeValues("BlockStored", []uint64{30}, nil, tokens(16, 100), 16, nil, "GPU", nil),
	))
	waitSeq(t, feed, seq)
	st = feed.Stats()
	if st.Apply.Blocks[kv.TierDevice] != 1 || st.ZMQ.MalformedEvents != 2 || st.ZMQ.Clears != 1 || st.ZMQ.DecodeErrors != 0 {
		t.Fatalf("after a bad BlockRemoved: apply %+v, zmq %+v", st.Apply, *st.ZMQ)
	}
}
