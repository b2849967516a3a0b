package backends

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

// Reloads start and close feeds again and again: a closed feed leaves no
// goroutine behind (its subscribers, sockets and replay dealers), whether
// it was connected or still dialing a dead engine.
func TestFeedCloseLeavesNoGoroutines(t *testing.T) {
	eng := newTestEngine(t, 64)
	rt, err := router.New(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	settle := func(limit int) int {
		deadline := time.Now().Add(5 * time.Second)
		for {
			n := runtime.NumGoroutine()
			if n <= limit || time.Now().After(deadline) {
				return n
			}
			runtime.Gosched()
			time.Sleep(10 * time.Millisecond) // goroutine exit has no hook to wait on
		}
	}
	base := runtime.NumGoroutine()
	for i := 0; i < 4; i++ {
		live, err := StartKVFeed(KVFeedConfig{Backend: "live", Mode: FeedZMQ, DPSize: 1,
			ZMQ: ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: eng.replayAddr(), BackoffMin: 5 * time.Millisecond}}, rt)
		if err != nil {
			t.Fatal(err)
		}
		dead, err := StartKVFeed(KVFeedConfig{Backend: "dead", Mode: FeedZMQ,
			ZMQ: ZMQConfig{Endpoint: "tcp://127.0.0.1:1", ReplayEndpoint: "tcp://127.0.0.1:2", BackoffMin: 5 * time.Millisecond}}, rt)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = live.Subscriber().Wait(ctx, func(s ZMQStats) bool { return s.Connected })
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		eng.publish(0, removed(uint64(i)))
		t0 := time.Now()
		live.Close()
		dead.Close()
		if d := time.Since(t0); d > 2*time.Second {
			t.Fatalf("closing two feeds took %v", d)
		}
	}
	if n := settle(base + 2); n > base+2 {
		buf := make([]byte, 1<<20)
		t.Fatalf("%d goroutines after 4 feed cycles, %d before:\n%s", n, base, buf[:runtime.Stack(buf, true)])
	}
}

// Closing a feed twice must not clear, the second time, what a newer feed of
// the same backend (the same router worker) has indexed since: a backend
// removed and added back gets a new feed while the old one may be closed
// again on its way out.
func TestFeedCloseTwiceKeepsTheNewFeedsBlocks(t *testing.T) {
	r := newRouter(t)
	cfg := KVFeedConfig{Backend: "x", Mode: FeedHTTP}
	old, err := StartKVFeed(cfg, r)
	if err != nil {
		t.Fatal(err)
	}
	toks := tokens(32, 0)
	stored := kv.HTTPBatch{Events: []kv.Event{{Kind: kv.BlockStored, EngineHashes: []uint64{1, 2}, Tokens: toks, BlockSize: 16}}}
	old.Push(stored)
	old.Close()
	next, err := StartKVFeed(cfg, r)
	if err != nil {
		t.Fatal(err)
	}
	next.Push(stored)
	if d, _ := depth(t, r, "x", toks, 0); d != 2 {
		t.Fatalf("the new feed indexed depth %d, want 2", d)
	}
	old.Close()
	if d, _ := depth(t, r, "x", toks, 0); d != 2 {
		t.Fatalf("closing the old feed again left depth %d of the new feed's 2", d)
	}
	old.Applier().Clear() // the old backend's forget timer, firing late
	if d, _ := depth(t, r, "x", toks, 0); d != 2 {
		t.Fatalf("clearing the closed feed left depth %d of the new feed's 2", d)
	}
}
