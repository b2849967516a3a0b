package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/router"
)

// workerStatus is the router's view of the worker named name in model m.
func workerStatus(p *testProxy, model, name string) (router.WorkerStatus, bool) {
	for _, w := range p.s.st.Load().models[model].rt.Workers() {
		if w.Name == name {
			return w, true
		}
	}
	return router.WorkerStatus{}, false
}

// TestScrapedLoadPerDataParallelRank: vLLM with data parallelism exports one
// series per engine (engine="r"). Each rank's worker gets its own engine's
// load and capacity; they were summed onto rank 0's worker, which pushed the
// router towards the rank that was actually overloaded (found by the ninth
// session's review). Before any rank worker exists, the backend's one worker
// stands for the whole engine and gets the total.
func TestScrapedLoadPerDataParallelRank(t *testing.T) {
	const page = `vllm:num_requests_waiting{engine="0",model_name="m"} 0
vllm:num_requests_waiting{engine="1",model_name="m"} 40
vllm:num_requests_running{engine="0",model_name="m"} 2
vllm:num_requests_running{engine="1",model_name="m"} 64
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.05
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.95
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="3000"} 1
`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			w.Write([]byte(page))
		}
	}))
	defer srv.Close()
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n  - {id: e0, url: '"+srv.URL+"', model: m, kv_events: {mode: http}}\n")
	type load struct {
		waiting, running int64
		usage, blocks    float64
	}
	waitFor := func(name string, want load) {
		t.Helper()
		var got load
		for deadline := time.Now().Add(4 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			w, ok := workerStatus(p, "m", name)
			got = load{w.EngineWaiting, w.EngineRunning, w.EngineKVUsage, w.CacheBlocks}
			if ok && fmt.Sprintf("%.3f", got.usage) == fmt.Sprintf("%.3f", want.usage) && got.waiting == want.waiting &&
				got.running == want.running && got.blocks == want.blocks {
				return
			}
		}
		t.Fatalf("worker %s: engine load %+v, want %+v", name, got, want)
	}
	waitFor("e0", load{40, 66, 0.5, 3000}) // the whole engine: one engine's capacity, as before
	pushRank(t, p, "e0", 1, promptIDs(100))
	waitFor("e0#1", load{40, 64, 0.95, 3000})
	waitFor("e0", load{0, 2, 0.05, 1000})
}

const dpHead = "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\nrouter: {policy: %s}\nbackends:\n"

// reloadYAML applies a new configuration to the running proxy.
func reloadYAML(t *testing.T, p *testProxy, yaml string) {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
}

// waitRetired waits for the log line of backend id's retirement.
func waitRetired(t *testing.T, p *testProxy, id string, replaced bool) {
	t.Helper()
	line := fmt.Sprintf(`"backend":%q,"replaced":%v,"message":"backend retired"`, id, replaced)
	for deadline := time.Now().Add(3 * time.Second); !strings.Contains(p.logs.String(), line); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s never retired", id)
		}
	}
}

// owned reports whether worker name is live in the router and one of the
// current backend id's workers.
func owned(p *testProxy, id, name string) (live, ofBackend bool) {
	w, ok := workerStatus(p, "m", name)
	if !ok || w.Removed {
		return false, false
	}
	b := p.s.st.Load().backends[id]
	return true, b != nil && slices.Contains(b.workerIDs(), w.ID)
}

// TestRankWorkerLeavesWithItsBackend: a data-parallel rank worker ("e0#1")
// of a backend replaced by a reload, then removed, was left in the router,
// available, and the requests chosen for it got 503 "the chosen backend was
// just removed" (found by the ninth session's review: 2 of 10 with policy
// kv, 5 of 10 with round_robin). The backend that replaces another takes
// its rank workers over, and they leave with it.
func TestRankWorkerLeavesWithItsBackend(t *testing.T) {
	for _, policy := range []string{"round_robin", "kv"} {
		t.Run(policy, func(t *testing.T) {
			e0, e1 := startFake(t, "e0", nil), startFake(t, "e1", nil)
			head := fmt.Sprintf(dpHead, policy) + "  - {id: e1, url: 'http://" + e1.addr + "', model: m}\n"
			p := startProxyYAML(t, head+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: {mode: http}}\n")
			pushRank(t, p, "e0", 1, promptIDs(100))
			reloadYAML(t, p, head+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, max_concurrency: 5, kv_events: {mode: http}}\n")
			if live, mine := owned(p, "e0", "e0#1"); !live || !mine {
				t.Errorf("after e0 was replaced, e0#1: live %v, e0's %v; want both", live, mine)
			}
			reloadYAML(t, p, head)
			waitRetired(t, p, "e0", false)
			if live, _ := owned(p, "e0", "e0#1"); live {
				t.Error("e0#1 outlived its backend")
			}
			for i := 0; i < 10; i++ {
				if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"hello"}`); resp.StatusCode != 200 {
					t.Fatalf("request %d with e1 healthy: %d %s", i, resp.StatusCode, b)
				}
			}
		})
	}
}

// TestRankWorkerKeptOnlyWhileConfigured: a reload that replaces a backend
// keeps its rank workers only where its new configuration has them: zmq
// subscribes to the ranks below dp_size, http ones are pushed by the same
// engine (same URL), and without events there are none. e0#1 kept getting
// requests with X-Data-Parallel-Rank: 1 after a reload to dp_size 1 or to
// kv_events none, until e0 was removed.
func TestRankWorkerKeptOnlyWhileConfigured(t *testing.T) {
	e0, other := startFake(t, "e0", nil), startFake(t, "other", nil)
	head := fmt.Sprintf(dpHead, "round_robin")
	httpCfg := head + "  - {id: e0, url: 'http://" + e0.addr + "', model: m, kv_events: {mode: http}}\n"
	zmq := func(dp int) string {
		return head + fmt.Sprintf("  - {id: e0, url: 'http://%s', model: m, kv_events: {mode: zmq, endpoint: 'tcp://127.0.0.1:23501', dp_size: %d}}\n", e0.addr, dp)
	}
	p := startProxyYAML(t, httpCfg)
	for _, c := range []struct {
		name, yaml string
		kept       bool
	}{
		{"http, same engine", head + "  - {id: e0, url: 'http://" + e0.addr + "', model: m, max_concurrency: 9, kv_events: {mode: http}}\n", true},
		{"zmq dp_size 2", zmq(2), true},
		{"zmq dp_size 2 again, another url", strings.Replace(zmq(2), e0.addr, other.addr, 1), true},
		{"zmq dp_size 1", zmq(1), false},
		{"http, another engine", strings.Replace(httpCfg, e0.addr, other.addr, 1), false},
		{"events none", head + "  - {id: e0, url: 'http://" + e0.addr + "', model: m}\n", false},
	} {
		if live, _ := owned(p, "e0", "e0#1"); !live {
			reloadYAML(t, p, httpCfg)
			pushRank(t, p, "e0", 1, promptIDs(100))
		}
		reloadYAML(t, p, c.yaml)
		live, mine := owned(p, "e0", "e0#1")
		if live != c.kept || mine != c.kept {
			t.Errorf("%s: e0#1 live %v, e0's %v; want %v", c.name, live, mine, c.kept)
		}
		if w, _ := workerStatus(p, "m", "e0#1"); c.kept && !w.Available {
			t.Errorf("%s: e0#1 kept but not available", c.name)
		}
	}
	// The last configuration has no ranks: no request names rank 1.
	for i := 0; i < 6; i++ {
		if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"hello"}`); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	e0.mu.Lock()
	defer e0.mu.Unlock()
	for _, h := range e0.headers[len(e0.headers)-6:] {
		if r := h.Get("X-Data-Parallel-Rank"); r != "" {
			t.Fatalf("a request went to rank %s of a backend without ranks", r)
		}
	}
}

// TestRankWorkerOfDrainingBackendTakenOver: a backend removed while it
// still has requests, then configured again before it retires, takes over
// the rank workers its configuration has; they left the router with
// neither backend (the drained one's retirement saw the id back and kept
// them, the new one did not know them).
func TestRankWorkerOfDrainingBackendTakenOver(t *testing.T) {
	e0 := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 600 * time.Millisecond })
	e1 := startFake(t, "e1", nil)
	head := fmt.Sprintf(dpHead, "round_robin") + "  - {id: e1, url: 'http://" + e1.addr + "', model: m}\n"
	p := startProxyYAML(t, head+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: {mode: http}}\n")
	pushRank(t, p, "e0", 1, promptIDs(100))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 3; i++ { // round robin: one reaches e0 or e0#1
			http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hello"}`))
		}
	}()
	for deadline := time.Now().Add(2 * time.Second); e0.current.Load() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no request reached e0")
		}
	}
	reloadYAML(t, p, head) // e0 drains
	reloadYAML(t, p, head+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: {mode: zmq, endpoint: 'tcp://127.0.0.1:23502', dp_size: 2}}\n")
	<-done
	waitRetired(t, p, "e0", false)
	if live, mine := owned(p, "e0", "e0#1"); !live || !mine {
		t.Fatalf("e0#1 after the old e0 retired: live %v, e0's %v; want both", live, mine)
	}
	reloadYAML(t, p, head)
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if live, _ := owned(p, "e0", "e0#1"); !live {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("e0#1 outlived its backend")
		}
	}
}

// A request for rank 0 of a data-parallel engine names rank 0: without the
// header vLLM balances it over its ranks itself, away from the cache the
// router chose (found by the ninth session's review). An engine with one
// rank gets no header.
func TestRankZeroIsNamedOnADataParallelEngine(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	p := startProxyYAML(t, fmt.Sprintf(dpHead, "round_robin")+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: {mode: http}}\n")
	send := func(n int) []string {
		t.Helper()
		for i := range n {
			if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"hello"}`); resp.StatusCode != 200 {
				t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
			}
		}
		e0.mu.Lock()
		defer e0.mu.Unlock()
		var ranks []string
		for _, h := range e0.headers[len(e0.headers)-n:] {
			ranks = append(ranks, h.Get("X-Data-Parallel-Rank"))
		}
		return ranks
	}
	if ranks := send(2); ranks[0] != "" || ranks[1] != "" {
		t.Fatalf("one rank: headers %q, want none", ranks)
	}
	pushRank(t, p, "e0", 1, promptIDs(100))
	ranks := send(4)
	slices.Sort(ranks)
	if want := []string{"0", "0", "1", "1"}; !slices.Equal(ranks, want) {
		t.Fatalf("two ranks, round robin: headers %q, want %q", ranks, want)
	}
}

// /admin/backends shows the feed's problem counters: blocks dropped over a
// block size mismatch (an engine with 32-token blocks against the model's
// 16), and the zero counts of offloaded copies it could not index.
func TestAdminShowsFeedProblemCounters(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	p := startProxyYAML(t, fmt.Sprintf(dpHead, "kv")+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: {mode: http}}\n")
	batch := `{"engine_id":"e0","events":[{"type":"block_stored","block_hashes":[7,8],"parent_block_hash":null,"token_ids":[` + promptIDs(1) + `],"block_size":32}]}`
	if resp, b := post(t, p.url+"/v1/kv_events", batch); resp.StatusCode != 200 {
		t.Fatalf("push: %d %s", resp.StatusCode, b)
	}
	resp, err := http.Get(p.url + "/admin/backends")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []struct {
		KVEvents map[string]any `json:"kv_events"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil || len(rows) != 1 {
		t.Fatalf("/admin/backends: %v %+v", err, rows)
	}
	ev := rows[0].KVEvents
	if ev["block_size_mismatch"] != 2.0 || ev["unknown_copies"] != 0.0 {
		t.Fatalf("kv_events %v: want block_size_mismatch 2 and unknown_copies 0", ev)
	}
}

// A zmq backend with dp_size ranks routes to every rank from the start, not
// only to those that have sent events: requests for rank 0 name it, so a
// rank without a worker got no requests, stored nothing and never sent
// the event that would have made its worker.
func TestEveryConfiguredRankIsRoutedFromTheStart(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	p := startProxyYAML(t, fmt.Sprintf(dpHead, "round_robin")+
		"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: {mode: zmq, endpoint: 'tcp://127.0.0.1:23511', dp_size: 3}}\n")
	for i := range 6 {
		if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"hello"}`); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	e0.mu.Lock()
	defer e0.mu.Unlock()
	var ranks []string
	for _, h := range e0.headers {
		ranks = append(ranks, h.Get("X-Data-Parallel-Rank"))
	}
	slices.Sort(ranks)
	if want := []string{"0", "0", "1", "1", "2", "2"}; !slices.Equal(ranks, want) {
		t.Fatalf("ranks of 6 requests, round robin over dp_size 3: %q, want %q", ranks, want)
	}
}

// dp_size with http events routes every rank from the start too; without
// events kvproxy has no rank workers, and the engine balances over its
// ranks itself: no request names one.
func TestDPSizeWithHTTPEventsAndWithout(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	for _, c := range []struct {
		events string
		want   []string
	}{
		{"{mode: http, dp_size: 2}", []string{"0", "0", "1", "1"}},
		{"{mode: none, dp_size: 2}", []string{"", "", "", ""}},
	} {
		p := startProxyYAML(t, fmt.Sprintf(dpHead, "round_robin")+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: "+c.events+"}\n")
		for i := range 4 {
			if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"hello"}`); resp.StatusCode != 200 {
				t.Fatalf("%s: request %d: %d %s", c.events, i, resp.StatusCode, b)
			}
		}
		e0.mu.Lock()
		var ranks []string
		for _, h := range e0.headers[len(e0.headers)-4:] {
			ranks = append(ranks, h.Get("X-Data-Parallel-Rank"))
		}
		e0.mu.Unlock()
		slices.Sort(ranks)
		if !slices.Equal(ranks, c.want) {
			t.Errorf("%s: ranks %q, want %q", c.events, ranks, c.want)
		}
	}
}

// An offloaded copy pushed over HTTP (block_stored without tokens, medium
// CPU) adds the host tier to the blocks it names, as over ZMQ; one naming
// blocks never stored is counted, not indexed. It was a 400 for the batch.
func TestPushedOffloadCopyIndexesTheHostTier(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	p := startProxyYAML(t, fmt.Sprintf(dpHead, "kv")+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: {mode: http}}\n")
	pushRank(t, p, "e0", 0, promptIDs(100)) // engine hashes 1–4
	copies := `{"engine_id":"e0","events":[{"type":"block_stored","block_hashes":[1,2,3,4,99],"parent_block_hash":null,"token_ids":[],"block_size":0,"medium":"CPU"}]}`
	if resp, b := post(t, p.url+"/v1/kv_events", copies); resp.StatusCode != 200 {
		t.Fatalf("push of offloaded copies: %d %s", resp.StatusCode, b)
	}
	resp, err := http.Get(p.url + "/admin/backends")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []struct {
		KVEvents struct {
			BlocksPerTier map[string]int64 `json:"blocks_per_tier"`
			UnknownCopies int64            `json:"unknown_copies"`
		} `json:"kv_events"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil || len(rows) != 1 {
		t.Fatalf("/admin/backends: %v", err)
	}
	if ev := rows[0].KVEvents; ev.BlocksPerTier["host"] != 4 || ev.BlocksPerTier["device"] != 4 || ev.UnknownCopies != 1 {
		t.Fatalf("kv_events %+v: want 4 blocks in device and host, 1 unknown copy", ev)
	}
}

// http events with dp_size 4, reloaded to dp_size 2 on the same engine:
// ranks 2 and 3 leave (they kept being routed; found by the ninth
// session's second review).
func TestLoweredDPSizeDropsItsRanksOverHTTP(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	cfg := func(dp int) string {
		return fmt.Sprintf(dpHead, "round_robin") + fmt.Sprintf("  - {id: e0, url: 'http://%s', model: m, kv_events: {mode: http, dp_size: %d}}\n", e0.addr, dp)
	}
	p := startProxyYAML(t, cfg(4))
	reloadYAML(t, p, cfg(2))
	for _, n := range []string{"e0#1", "e0#2", "e0#3"} {
		live, mine := owned(p, "e0", n)
		w, _ := workerStatus(p, "m", n)
		t.Logf("after dp_size 4 -> 2: %s live %v owned %v available %v", n, live, mine, w.Available)
	}
	for i := range 8 {
		if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"hello"}`); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	e0.mu.Lock()
	var ranks []string
	for _, h := range e0.headers[len(e0.headers)-8:] {
		ranks = append(ranks, h.Get("X-Data-Parallel-Rank"))
	}
	e0.mu.Unlock()
	slices.Sort(ranks)
	t.Logf("ranks of 8 round-robin requests after reload to dp_size 2: %q", ranks)
	if slices.Contains(ranks, "3") || slices.Contains(ranks, "2") {
		t.Errorf("requests name ranks beyond dp_size 2: %q", ranks)
	}
}

// An http feed a reload keeps keeps its count of events received too.
func TestPushedEventsCountAcrossAKeptFeed(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	cfg := func(mc int) string {
		return fmt.Sprintf(dpHead, "round_robin") + fmt.Sprintf("  - {id: e0, url: 'http://%s', model: m, max_concurrency: %d, kv_events: {mode: http}}\n", e0.addr, mc)
	}
	p := startProxyYAML(t, cfg(5))
	pushRank(t, p, "e0", 0, promptIDs(100))
	before := p.s.st.Load().backends["e0"].eventCounters()
	reloadYAML(t, p, cfg(6))
	after := p.s.st.Load().backends["e0"].eventCounters()
	t.Logf("before reload: events %d blocks %v; after: events %d blocks %v", before.Events, before.BlocksPerTier, after.Events, after.BlocksPerTier)
	if after.Events != before.Events {
		t.Errorf("kv_events.events went from %d to %d while the feed (and its blocks) carried over", before.Events, after.Events)
	}
}

// A reload that adds a data-parallel backend makes its rank workers when its
// feed starts, before the new configuration is current: a request routed to
// one then found no backend of its name and got 503 backend_removed (the
// twenty-fifth session's note). It waits for the reload to finish instead.
func TestRankOfABackendAReloadAddsIsServedDuringTheReload(t *testing.T) {
	e0, e1 := startFake(t, "e0", nil), startFake(t, "e1", nil)
	head := fmt.Sprintf(dpHead, "round_robin") + "  - {id: e1, url: 'http://" + e1.addr + "', model: m}\n"
	p := startProxyYAML(t, head)
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"hello"}`); resp.StatusCode != 200 {
		t.Fatalf("warm-up: %d %s", resp.StatusCode, b) // loads the tokenizer
	}
	const n = 6
	statuses := make(chan string, n)
	hook := func() {
		for range n {
			go func() {
				resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hello"}`))
				if err != nil {
					statuses <- err.Error()
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				statuses <- fmt.Sprintf("%d %s", resp.StatusCode, b)
			}()
		}
		// Long enough for every request to be routed; those for e0#1 now
		// wait for the reload, which this hook holds.
		time.Sleep(time.Second)
	}
	p.s.testActivating.Store(&hook)
	reloadYAML(t, p, head+"  - {id: e0, url: 'http://"+e0.addr+"', model: m, kv_events: {mode: zmq, endpoint: 'tcp://127.0.0.1:23512', dp_size: 2}}\n")
	p.s.testActivating.Store(nil)
	for range n {
		select {
		case s := <-statuses:
			if !strings.HasPrefix(s, "200 ") {
				t.Errorf("a request during the reload: %s", s)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a request during the reload was never answered")
		}
	}
	e0.mu.Lock()
	defer e0.mu.Unlock()
	var ranks []string
	for _, h := range e0.headers {
		ranks = append(ranks, h.Get("X-Data-Parallel-Rank"))
	}
	if !slices.Contains(ranks, "1") {
		t.Fatalf("e0's requests named ranks %q: none was routed to rank 1", ranks)
	}
}
