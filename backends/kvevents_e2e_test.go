package backends

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/bits"
	"net/http"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/mockengine"
	"github.com/kvproxy/kvproxy/router"
)

// simEngine is a simulated engine serving HTTP and publishing vLLM events.
type simEngine struct {
	e    *mockengine.Engine
	addr string
	pub  *mockengine.Publisher
	feed *mockengine.EventFeed
}

// startSim starts an engine whose publisher listens on pubEP and replayEP
// (port 0: any).
func startSim(t *testing.T, cfg mockengine.Config, enc kv.VLLMEncoding, pubEP, replayEP string) *simEngine {
	t.Helper()
	cfg.ID, cfg.Speedup = "mock-0", 1000
	e, err := mockengine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	addr, err := e.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pub, err := mockengine.NewPublisher(mockengine.PublisherConfig{Endpoint: pubEP, ReplayEndpoint: replayEP, Topic: "kv", Encoding: enc})
	if err != nil {
		e.Close()
		t.Fatal(err)
	}
	s := &simEngine{e: e, addr: addr, pub: pub, feed: e.PublishEvents(pub)}
	t.Cleanup(s.stop)
	return s
}

func (s *simEngine) stop() {
	s.feed.Stop()
	s.pub.Close()
	s.e.Close()
}

// churn sends 60 requests: 10 prompt families asked twice each round (the
// second time from cache), sharing 0-3 leading blocks across families; about
// 5x a 48-block cache, so blocks are evicted all along. Then it waits until
// the engine is idle, its events are published, and sub has applied them.
func (s *simEngine) churn(t *testing.T, sub *ZMQSubscriber, salt int) {
	t.Helper()
	for k := 0; k < 60; k++ {
		fam := (k / 2) % 10
		prompt := make([]int, 16*(4+fam%4)+5)
		for i := range prompt {
			prompt[i] = 500 + salt*10000000 + (k/20)*100000 + fam*1000 + i
			if i < 16*(fam%4) {
				prompt[i] = 3 + i // shared prefix
			}
		}
		postJSON(t, "http://"+s.addr+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 4})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.e.WaitIdle(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.feed.Flush(); err != nil {
		t.Fatal(err)
	}
	last := int64(s.pub.Published()) - 1
	if err := sub.Wait(ctx, func(st ZMQStats) bool { return st.LastSeq == last }); err != nil {
		t.Fatal(err)
	}
}

// indexMatchesEngine checks that the index holds exactly the engine's
// resident blocks (its /debug/cache, router-scheme hashes), each at its
// fastest tier, and that the applier's per-tier counts agree. It returns
// the engine's per-tier block counts.
func (s *simEngine) indexMatchesEngine(t *testing.T, r *router.Router, a *KVApplier) [kv.NumTiers]int64 {
	t.Helper()
	var dc mockengine.DebugCache
	if err := json.Unmarshal(getBody(t, "http://"+s.addr+"/debug/cache"), &dc); err != nil {
		t.Fatal(err)
	}
	id, _ := r.WorkerByName("mock-0")
	truth := map[uint64]uint8{} // block → tiers holding it
	var perTier [kv.NumTiers]int64
	for _, b := range dc.Blocks {
		tier, err := kv.TierFromMedium(b.Medium)
		if err != nil {
			t.Fatal(err)
		}
		truth[b.Hash] |= 1 << tier
		perTier[tier]++
	}
	hits := 0
	for h, tiers := range truth {
		best := kv.Tier(bits.TrailingZeros8(tiers))
		for _, o := range r.Index().Match([]kv.BlockHash{kv.BlockHash(h)}, nil) {
			if o.Worker == id && o.Tiers[best] == 1 {
				hits++
			}
		}
	}
	held, as := r.Index().WorkerBlocks(id), a.Stats()
	if hits != len(truth) || held != len(truth) || as.Blocks != perTier {
		t.Fatalf("engine holds %d blocks %v, index %d, both %d, applier %v (applier %+v)",
			len(truth), perTier, held, hits, as.Blocks, as)
	}
	return perTier
}

func follow(t *testing.T, cfg ZMQConfig, sink EventSink) *ZMQSubscriber {
	cfg.BackoffMin, cfg.BackoffMax = 5*time.Millisecond, 50*time.Millisecond
	sub := NewZMQSubscriber(cfg, sink)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return sub
}

// A simulated engine with a cache smaller than the working set publishes
// vLLM events over ZMQ; after a churn with evictions, the router index fed by
// subscriber and applier holds exactly the engine's resident blocks:
// precision and recall 100%, tiers included.
func TestKVEventsTrackMockEngine(t *testing.T) {
	for _, enc := range []kv.VLLMEncoding{kv.VLLMArrays, kv.VLLMMaps} {
		for _, host := range []int{0, 40} {
			t.Run(fmt.Sprintf("encoding%d/host%d", enc, host), func(t *testing.T) {
				s := startSim(t, mockengine.Config{CacheBlocks: 48, HostCacheBlocks: host}, enc, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
				r := newRouter(t)
				a := NewKVApplier(KVApplierConfig{Backend: "mock-0"}, r)
				sub := follow(t, ZMQConfig{Endpoint: s.pub.Endpoint(), ReplayEndpoint: s.pub.ReplayEndpoint(), Topic: "kv"}, a)
				s.churn(t, sub, 0)
				perTier := s.indexMatchesEngine(t, r, a)
				st, as := sub.Stats(), a.Stats()
				if as.RemovedBlocks == 0 {
					t.Fatalf("no evictions: the test proves little (%+v)", as)
				}
				if host > 0 && perTier[kv.TierHost] == 0 {
					t.Fatal("nothing reached the host tier: the test proves little")
				}
				if st.Clears != 0 || as.OrphanBlocks != 0 {
					t.Fatalf("feed %+v applier %+v", st, as)
				}
			})
		}
	}
}

// An engine restarted on the same endpoints: the subscriber reconnects, finds
// the last batch it applied gone from the new engine's replay buffer, clears
// the worker at once (before the new engine publishes anything), and then
// rebuilds the index from the new engine's events.
func TestKVEventsEngineRestart(t *testing.T) {
	s := startSim(t, mockengine.Config{CacheBlocks: 48}, kv.VLLMArrays, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
	pubEP, replayEP := s.pub.Endpoint(), s.pub.ReplayEndpoint()
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "mock-0"}, r)
	sub := follow(t, ZMQConfig{Endpoint: pubEP, ReplayEndpoint: replayEP, Topic: "kv"}, a)
	s.churn(t, sub, 0)
	s.indexMatchesEngine(t, r, a)
	id, _ := r.WorkerByName("mock-0")
	if r.Index().WorkerBlocks(id) == 0 {
		t.Fatal("nothing indexed before the restart")
	}

	s.stop()
	s2 := startSim(t, mockengine.Config{CacheBlocks: 48}, kv.VLLMArrays, pubEP, replayEP)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := sub.Wait(ctx, func(st ZMQStats) bool { return st.Reconnects >= 1 && st.Clears >= 1 }); err != nil {
		t.Fatal(err)
	}
	if n := r.Index().WorkerBlocks(id); n != 0 {
		t.Fatalf("%d blocks of the old engine survived its restart", n)
	}
	s2.churn(t, sub, 1)
	s2.indexMatchesEngine(t, r, a)
}

func postJSON(t *testing.T, url string, body any) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil || resp.StatusCode != 200 {
		t.Fatalf("POST %s: status %d %v", url, resp.StatusCode, err)
	}
}

func getBody(t *testing.T, url string) []byte {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
