package backends

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

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

// freePortPair finds a loopback port p such that p and p+1 are free.
func freePortPair(t *testing.T) int {
	for i := 0; i < 100; i++ {
		l1, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p := l1.Addr().(*net.TCPAddr).Port
		l2, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+1))
		l1.Close()
		if err == nil {
			l2.Close()
			return p
		}
	}
	t.Fatal("no free port pair")
	return 0
}

// vLLM with data parallelism publishes rank r on port + r: one subscriber per
// rank feeds one applier, each rank its own worker; a restart seen on one
// rank's feed clears only that rank.
func TestKVFeedDataParallel(t *testing.T) {
	pub, rep := freePortPair(t), freePortPair(t)
	engs := []*testEngine{
		newTestEngineAt(t, 100, fmt.Sprintf("tcp://127.0.0.1:%d", pub), fmt.Sprintf("tcp://127.0.0.1:%d", rep)),
		newTestEngineAt(t, 100, fmt.Sprintf("tcp://127.0.0.1:%d", pub+1), fmt.Sprintf("tcp://127.0.0.1:%d", rep+1)),
	}
	r := newRouter(t)
	f, err := StartKVFeed(KVFeedConfig{Backend: "dp", Mode: FeedZMQ, DPSize: 2,
		ZMQ: ZMQConfig{Endpoint: engs[0].pubAddr, ReplayEndpoint: engs[0].replayAddr(), BackoffMin: 5 * time.Millisecond}}, r)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fx := make([]*subFixture, 2)
	toks := tokens(32, 8)
	for i, e := range engs {
		fx[i] = &subFixture{t: t, eng: e, sub: f.Subscribers()[i], rank: i}
		fx[i].warmUp()
		e.publish(i, stored([]uint64{1, 2}, nil, toks, kv.TierDevice))
		last := int64(e.next - 1)
		fx[i].wait("stored", func(s ZMQStats) bool { return s.LastSeq == last })
	}
	for _, w := range []string{"dp", "dp#1"} {
		if d, _ := depth(t, r, w, toks, 0); d != 2 {
			t.Fatalf("%s depth %d", w, d)
		}
	}
	engs[1].restart()
	engs[1].publish(1, removed(99))
	fx[1].wait("restart", func(s ZMQStats) bool { return s.Clears == 1 })
	if d, _ := depth(t, r, "dp#1", toks, 0); d != 0 {
		t.Fatalf("rank 1 after its restart: depth %d", d)
	}
	if d, _ := depth(t, r, "dp", toks, 0); d != 2 {
		t.Fatalf("rank 0 after rank 1's restart: depth %d", d)
	}
	if s := f.Stats(); len(s.ZMQRanks) != 2 || s.ZMQ.Clears != 1 || !s.ZMQ.Connected {
		t.Fatalf("stats %+v", s)
	}
}

func TestOffsetEndpoint(t *testing.T) {
	for _, c := range []struct {
		in   string
		r    int
		want string
	}{
		{"tcp://10.0.0.5:5557", 0, "tcp://10.0.0.5:5557"},
		{"tcp://10.0.0.5:5557", 3, "tcp://10.0.0.5:5560"},
		{"tcp://[::1]:5557", 1, "tcp://[::1]:5558"},
		{"inproc://cache", 2, "inproc://cache_dp2"},
		{"ipc:///tmp/x", 0, "ipc:///tmp/x"},
	} {
		if got, err := OffsetEndpoint(c.in, c.r); err != nil || got != c.want {
			t.Errorf("%s rank %d: %q %v", c.in, c.r, got, err)
		}
	}
	for _, bad := range []string{"ipc:///tmp/x", "tcp://host", "tcp://h:65535"} {
		if _, err := OffsetEndpoint(bad, 1); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

// Pushed events of a hybrid model are followed for one KV cache group, as
// the ZMQ feed's are: group 0 until a stored block names its kind, then
// the lowest group of full attention, with what was followed cleared.
// Pushed events ignored group_idx, and a sliding window's blocks, freed
// as the window passes them, mixed with the full prefix's.
func TestKVFeedHTTPPushFollowsOneGroup(t *testing.T) {
	r := newRouter(t)
	f, err := StartKVFeed(KVFeedConfig{Backend: "e", Mode: FeedHTTP}, r)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	a, c := tokens(32, 0), tokens(32, 1000)
	ids := func(toks []uint32) string {
		s := make([]string, len(toks))
		for i, v := range toks {
			s[i] = fmt.Sprint(v)
		}
		return strings.Join(s, ",")
	}
	var applied int
	push := func(events ...string) {
		t.Helper()
		b, err := kv.ParseHTTPBatch([]byte(`{"engine_id":"e","events":[` + strings.Join(events, ",") + `]}`))
		if err != nil {
			t.Fatal(err)
		}
		applied = f.Push(b)
	}
	stored := func(h1, h2 string, toks []uint32, group string) string {
		return `{"type":"block_stored","block_hashes":["` + h1 + `","` + h2 + `"],"token_ids":[` + ids(toks) + `],"block_size":16` + group + `}`
	}
	removed := func(h, group string) string {
		return `{"type":"block_removed","block_hashes":["` + h + `"]` + group + `}`
	}
	check := func(step string, wantA, wantC int) {
		t.Helper()
		if da, _ := depth(t, r, "e", a, 0); da != wantA {
			t.Fatalf("%s: %d blocks of a, want %d", step, da, wantA)
		}
		if dc, _ := depth(t, r, "e", c, 0); dc != wantC {
			t.Fatalf("%s: %d blocks of c, want %d", step, dc, wantC)
		}
	}
	push(stored("c1", "c2", c, "")) // no groups named: group 0
	check("no groups", 0, 2)
	window, full := `,"group_idx":0,"kv_cache_spec_kind":"sliding_window"`, `,"group_idx":1,"kv_cache_spec_kind":"full_attention"`
	push(stored("w1", "w2", a, window), stored("f1", "f2", a, full), removed("w1", `,"group_idx":0`))
	check("group 1 of full attention chosen", 2, 0)
	if applied != 2 {
		t.Fatalf("%d of 3 events applied, want the 2 of group 1", applied)
	}
	push(removed("w2", `,"group_idx":0`), stored("c3", "c4", c, window))
	check("group 0 ignored", 2, 0)
	if applied != 0 {
		t.Fatalf("%d events of group 0 applied", applied)
	}
	push(removed("f2", `,"group_idx":1`))
	check("group 1 followed", 1, 0)

	// A pushed all_blocks_cleared makes the choice again: the engine may
	// have restarted with another layout, one without groups here.
	push(`{"type":"all_blocks_cleared"}`, stored("c5", "c6", c, ""))
	check("after a clear, events without groups", 0, 2)
	// So does a backend away too long (its feed cleared).
	push(stored("f3", "f4", a, full))
	check("group 1 chosen again", 2, 0)
	f.Clear()
	push(stored("c7", "c8", c, ""))
	check("after the feed's clear", 0, 2)
}
