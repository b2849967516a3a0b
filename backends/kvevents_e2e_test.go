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
)

// A simulated engine with a cache smaller than the working set publishes
// vLLM events over ZMQ; after a churn with evictions, the router index fed by
// subscriber and applier holds exactly the engine's resident blocks (its
// /debug/cache, in router-scheme hashes): precision and recall 100%.
func TestKVEventsTrackMockEngine(t *testing.T) {
	for _, enc := range []kv.VLLMEncoding{kv.VLLMArrays, kv.VLLMMaps} {
		for _, host := range []int{0, 40} {
			t.Run(fmt.Sprintf("encoding%d/host%d", enc, host), func(t *testing.T) { trackMockEngine(t, enc, host) })
		}
	}
}

// trackMockEngine runs the churn against one engine; with host > 0 the
// engine also has a host (CPU) tier that device evictions move to.
func trackMockEngine(t *testing.T, enc kv.VLLMEncoding, host int) {
	e, err := mockengine.New(mockengine.Config{ID: "mock-0", CacheBlocks: 48, HostCacheBlocks: host, Speedup: 1000})
	if err != nil {
		t.Fatal(err)
	}
	addr, err := e.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	pub, err := mockengine.NewPublisher(mockengine.PublisherConfig{
		Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv", Encoding: enc,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	feed := e.PublishEvents(pub)
	defer feed.Stop()

	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "mock-0"}, r)
	sub := NewZMQSubscriber(ZMQConfig{Endpoint: pub.Endpoint(), ReplayEndpoint: pub.ReplayEndpoint(), Topic: "kv"}, a)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	// 60 requests: 10 prompt families asked twice each round (the
	// second time from cache), sharing 0-3 leading blocks across
	// families; about 5x the cache, so blocks are evicted all along.
	for k := 0; k < 60; k++ {
		fam := (k / 2) % 10
		prompt := make([]int, 16*(4+fam%4)+5)
		for i := range prompt {
			prompt[i] = 500 + (k/20)*100000 + fam*1000 + i
			if i < 16*(fam%4) {
				prompt[i] = 3 + i // shared prefix
			}
		}
		postJSON(t, "http://"+addr+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 4})
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if err := e.WaitIdle(wctx); err != nil {
		t.Fatal(err)
	}
	if err := feed.Flush(); err != nil {
		t.Fatal(err)
	}
	last := int64(pub.Published()) - 1
	if err := sub.Wait(wctx, func(s ZMQStats) bool { return s.LastSeq == last }); err != nil {
		t.Fatal(err)
	}

	var dc mockengine.DebugCache
	if err := json.Unmarshal(getBody(t, "http://"+addr+"/debug/cache"), &dc); err != nil {
		t.Fatal(err)
	}
	id, _ := r.WorkerByName("mock-0")
	// The engine's truth: each block's tiers.
	truth := map[uint64]uint8{}
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
	st, ast := sub.Stats(), a.Stats()
	if ast.RemovedBlocks == 0 {
		t.Fatalf("no evictions: the test proves little (%+v)", ast)
	}
	if host > 0 && perTier[kv.TierHost] == 0 {
		t.Fatalf("nothing reached the host tier: the test proves little")
	}
	held := r.Index().WorkerBlocks(id)
	if hits != len(truth) || held != len(truth) || ast.Blocks != perTier {
		t.Fatalf("engine holds %d blocks %v, index %d, both %d, applier %v (feed %+v, applier %+v)",
			len(truth), perTier, held, hits, ast.Blocks, st, ast)
	}
	if st.Clears != 0 || ast.OrphanBlocks != 0 {
		t.Fatalf("feed %+v applier %+v", st, ast)
	}
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
