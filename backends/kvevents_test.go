package backends

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvproxy/kvproxy/kv"
)

func TestKVFeedHTTPPush(t *testing.T) {
	r := newRouter(t)
	f, err := StartKVFeed(KVFeedConfig{Backend: "lmcache", Mode: FeedHTTP, Shared: true}, r)
	if err != nil {
		t.Fatal(err)
	}
	toks := tokens(32, 0)
	ids := make([]string, len(toks))
	for i, v := range toks {
		ids[i] = fmt.Sprint(v)
	}
	body := `{"engine_id":"lmcache","data_parallel_rank":1,"events":[{"type":"block_stored","block_hashes":["a","b"],"token_ids":[` +
		strings.Join(ids, ",") + `],"block_size":16,"medium":"CPU"}]}`
	b, err := kv.ParseHTTPBatch([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	f.Push(b)
	d, tiers := depth(t, r, "lmcache#1", toks, 0)
	if d != 2 || tiers[kv.TierShared] != 2 {
		t.Fatalf("depth %d tiers %v", d, tiers)
	}
	if s := f.Stats(); s.Mode != FeedHTTP || s.ZMQ != nil || s.Apply.StoredBlocks != 2 || s.Apply.Blocks[kv.TierShared] != 2 {
		t.Fatalf("stats %+v", s)
	}
	// The same blocks pushed for a salted tenant land in its namespace.
	f.PushSalted(b, "acme-salt")
	if d, _ := depth(t, r, "lmcache#1", toks, kv.NewNamespace("acme-salt")); d != 2 {
		t.Fatalf("salted push depth %d", d)
	}
	f.Close()
	if r.Index().Len() != 0 {
		t.Fatalf("a closed feed left %d entries", r.Index().Len())
	}
	f.Push(b) // a late push of a removed backend
	if r.Index().Len() != 0 {
		t.Fatalf("a push after Close added %d entries", r.Index().Len())
	}
}

func TestKVFeedZMQ(t *testing.T) {
	eng := newTestEngine(t, 100)
	r := newRouter(t)
	f, err := StartKVFeed(KVFeedConfig{Backend: "z", Mode: FeedZMQ, ZMQ: ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: eng.replayAddr()}}, r)
	if err != nil {
		t.Fatal(err)
	}
	fx := &subFixture{t: t, eng: eng, sub: f.Subscriber()}
	fx.warmUp()
	toks := tokens(48, 1)
	eng.publish(0, stored([]uint64{1, 2, 3}, nil, toks, kv.TierDevice))
	last := int64(eng.next - 1)
	fx.wait("stored", func(s ZMQStats) bool { return s.LastSeq == last })
	if d, _ := depth(t, r, "z", toks, 0); d != 3 {
		t.Fatalf("depth %d", d)
	}
	if s := f.Stats(); s.ZMQ == nil || s.ZMQ.LastSeq != last || s.Apply.StoredBlocks != 3 {
		t.Fatalf("stats %+v", s)
	}
	f.Close()
	if r.Index().Len() != 0 || f.Subscriber().Stats().Connected {
		t.Fatalf("after Close: %d entries, %+v", r.Index().Len(), f.Subscriber().Stats())
	}
}

func TestKVFeedConfigErrors(t *testing.T) {
	r := newRouter(t)
	for _, c := range []KVFeedConfig{{Mode: FeedHTTP}, {Backend: "b", Mode: "nats"}, {Backend: "b", Mode: FeedZMQ}} {
		if _, err := StartKVFeed(c, r); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}
