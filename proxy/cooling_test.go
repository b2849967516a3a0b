package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

// pushRank pushes one block_stored batch of the given tokens for a
// data-parallel rank of backend id (kv_events mode http).
func pushRank(t *testing.T, p *testProxy, id string, rank int, ids string) {
	t.Helper()
	batch := fmt.Sprintf(`{"engine_id":%q,"data_parallel_rank":%d,"events":[{"type":"block_stored","block_hashes":[%d,%d,%d,%d],"parent_block_hash":null,"token_ids":[%s],"block_size":16}]}`,
		id, rank, 10*rank+1, 10*rank+2, 10*rank+3, 10*rank+4, ids)
	if resp, b := post(t, p.url+"/v1/kv_events", batch); resp.StatusCode != 200 {
		t.Fatalf("push: %d %s", resp.StatusCode, b)
	}
}

func promptIDs(first int) string {
	tokens := make([]string, 64)
	for i := range tokens {
		tokens[i] = fmt.Sprint(first + i)
	}
	return strings.Join(tokens, ",")
}

// TestNewRankOfACoolingBackendIsLeftOut: a data-parallel rank that first
// shows up (its first KV event) while its backend cools down after a 429
// is left out like the backend's other ranks; it was selectable, and the
// next request went straight back to the engine that had just refused.
func TestNewRankOfACoolingBackendIsLeftOut(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.status, f.retryAfter, f.errBody = 429, "30", `{"error":{"message":"busy"}}` })
	ok := startFake(t, "ok", nil)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: busy, url: 'http://{{e0}}', model: m, kv_events: {mode: http}}\n"+
		"  - {id: ok, url: 'http://{{e1}}', model: m}\n", busy, ok)
	ids := promptIDs(100)
	pushRank(t, p, "busy", 1, ids)
	body := `{"model":"m","prompt":[` + ids + `]}`
	if resp, b := post(t, p.url+"/v1/completions", body); resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "ok" || busy.requests.Load() != 1 {
		t.Fatalf("%d from %q: %s (busy saw %d)", resp.StatusCode, resp.Header.Get(WorkerHeader), b, busy.requests.Load())
	}
	// A rank busy had not named yet, holding a prompt no one else holds.
	ids = promptIDs(500)
	pushRank(t, p, "busy", 2, ids)
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":[`+ids+`]}`); resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "ok" {
		t.Fatalf("%d from %q: %s", resp.StatusCode, resp.Header.Get(WorkerHeader), b)
	}
	if n := busy.requests.Load(); n != 1 {
		t.Fatalf("the cooling engine saw %d requests, want 1: its new rank was selectable", n)
	}
	p.waitIdle(t)
}

// TestNewRankOfAFullBackendDoesNotSpin: a rank that first shows up while
// its backend is at max_concurrency must not be chosen: route took it,
// failed to take a slot and chose it again, spinning until a slot freed,
// instead of queueing (here: max_queue 0, so a 503 at once).
func TestNewRankOfAFullBackendDoesNotSpin(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, max_concurrency: 1, kv_events: {mode: http}}\n"+
		"limits: {max_queue: 0}\n", e)
	ids := promptIDs(100)
	first := make(chan int, 1)
	go func() {
		resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hold the slot"}`))
		if err != nil {
			first <- 0
			return
		}
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	deadline := time.Now().Add(3 * time.Second)
	for e.current.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	pushRank(t, p, "e0", 1, ids) // e0 is full: its new rank must not be selectable
	start := time.Now()
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":[`+ids+`]}`)
	if took := time.Since(start); resp.StatusCode != 503 || took > time.Second {
		t.Fatalf("with the only backend full and no queue: %d after %v: %s", resp.StatusCode, took, b)
	}
	if c := <-first; c != 200 {
		t.Fatalf("the first request: %d", c)
	}
	p.waitIdle(t)
}

// TestCoolingEndsWhenTheOtherBackendsGo: a backend cooling down after a 429
// is the model's last one once the other is ejected; it takes requests
// again rather than leave the model with none (503 no healthy backend).
func TestCoolingEndsWhenTheOtherBackendsGo(t *testing.T) {
	busy, ok, p := coolingPair(t, "", `{"model":"m","prompt":"x"}`)
	ok.srv.Close() // ok goes away: its next request is refused and ejects it
	post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
	before := busy.requests.Load()
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 429 || resp.Header.Get(WorkerHeader) != "busy" || resp.Header.Get("Retry-After") != "30" || busy.requests.Load() != before+1 {
		t.Fatalf("with busy the last backend: %d from %q (Retry-After %q): %s", resp.StatusCode, resp.Header.Get(WorkerHeader), resp.Header.Get("Retry-After"), b)
	}
	p.waitIdle(t)
}

// TestHealthCountsFullBackends: a backend at max_concurrency is healthy;
// /health answered 503 "unavailable" while the only one was busy.
func TestHealthCountsFullBackends(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = time.Second })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, max_concurrency: 1}\n", e)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x"}`)); err == nil {
			resp.Body.Close()
		}
	}()
	deadline := time.Now().Add(3 * time.Second)
	for e.current.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	resp, err := http.Get(p.url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/health with its only backend busy: %d", resp.StatusCode)
	}
	<-done
	p.waitIdle(t)
}

// TestReplacedBackendLeavesItsWorkerAlone: a backend replaced by a reload
// (same id, new settings) shares its router worker with its successor. A
// 429 reaching the old one's last request after the reload cooled the
// shared worker down, and retiring the old one stopped the timer that
// would have ended it: the new backend stayed unselectable (a pinned
// request got 503) for good.
func TestReplacedBackendLeavesItsWorkerAlone(t *testing.T) {
	arrived, hold := make(chan struct{}), make(chan struct{})
	var once sync.Once
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) })
	var held atomic.Bool
	mux.HandleFunc("POST /v1/", func(w http.ResponseWriter, r *http.Request) { // not GET /v1/models: the scrape loop lists it
		io.Copy(io.Discard, r.Body)
		if held.CompareAndSwap(false, true) {
			once.Do(func() { close(arrived) })
			<-hold
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(429)
			w.Write([]byte(`{"error":{"message":"busy"}}`))
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"id":"x","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"stop"}]}`))
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	ok := startFake(t, "ok", nil)
	yaml := func(maxConc int) string {
		return "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
			"backends:\n" +
			fmt.Sprintf("  - {id: busy, url: 'http://%s', model: m, max_concurrency: %d}\n", ln.Addr(), maxConc) +
			"  - {id: ok, url: 'http://" + ok.addr + "', model: m}\n" +
			"router: {policy: round_robin}\n"
	}
	p := startProxyYAML(t, yaml(4))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 4 && !held.Load(); i++ {
			if resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x"}`)); err == nil {
				resp.Body.Close()
			}
		}
	}()
	select {
	case <-arrived:
	case <-time.After(5 * time.Second):
		t.Fatal("busy never got a request")
	}
	cfg, err := config.Parse([]byte(yaml(5)))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	close(hold) // the old backend's request is refused now
	<-done
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(p.logs.String(), `"backend":"busy","replaced":true,"message":"backend retired"`) {
		if time.Now().After(deadline) {
			t.Fatalf("the old busy never retired: %s", p.logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(1500 * time.Millisecond) // past the 1 s Retry-After
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"busy"}}`)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "busy" {
		t.Fatalf("pinned to the new busy: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// TestPinnedToACoolingBackendIs429: a request pinned to a backend cooling
// down after a 429 is told to come back when the cooling ends (429 with
// that Retry-After), as the engine said; it was a 503 "not available",
// retried every second, for a backend that is up.
func TestPinnedToACoolingBackendIs429(t *testing.T) {
	_, _, p := coolingPair(t, "", `{"model":"m","prompt":"x"}`)
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"busy"}}`)
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != 429 || ra < 29 || ra > 30 || !strings.Contains(string(b), `"type":"rate_limit_error"`) || resp.Header.Get(WorkerHeader) != "busy" {
		t.Fatalf("pinned to the cooling backend: %d (Retry-After %q): %s", resp.StatusCode, resp.Header.Get("Retry-After"), b)
	}
	p.waitIdle(t)
}

// TestEngineRefusalOutlivesARefusedConnection: when the last engine up
// refuses with 429 and the other one cannot be reached, the client gets
// the engine's 429 and Retry-After, whatever order they were tried in; a
// refused connection tried after the 429 turned it into a 502.
func TestEngineRefusalOutlivesARefusedConnection(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) {
		f.status, f.retryAfter, f.errBody = 429, "7", `{"error":{"message":"engine busy","type":"rate_limit_error"}}`
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: busy, url: 'http://{{e0}}', model: m}\n"+
		"  - {id: dead, url: 'http://"+dead+"', model: m}\n"+
		"health: {eject_base: 1ms, eject_max: 1ms}\n"+
		"router: {policy: round_robin}\n", busy)
	for i := 0; i < 4; i++ {
		time.Sleep(5 * time.Millisecond) // dead's 1 ms ejection ends: it is tried again
		resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
		if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "7" || resp.Header.Get(WorkerHeader) != "busy" || !strings.Contains(string(b), "engine busy") {
			t.Fatalf("request %d: %d from %q (Retry-After %q): %s", i, resp.StatusCode, resp.Header.Get(WorkerHeader), resp.Header.Get("Retry-After"), b)
		}
	}
	p.waitIdle(t)
}

// TestQueuedRequestTakesABackendBackFromCooling: a request queued for a
// full backend is woken when another backend's cooling down ends; it
// waited on for a slot of the full one (or queue_timeout).
func TestQueuedRequestTakesABackendBackFromCooling(t *testing.T) {
	handler := func(serve func(w http.ResponseWriter, prompt string)) string {
		mux := http.NewServeMux()
		mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) })
		mux.HandleFunc("POST /v1/", func(w http.ResponseWriter, r *http.Request) { // not GET /v1/models: the scrape loop lists it
			var body struct{ Prompt string }
			json.NewDecoder(r.Body).Decode(&body)
			serve(w, body.Prompt)
		})
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: mux}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		return ln.Addr().String()
	}
	answer := func(w http.ResponseWriter) {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"id":"x","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"stop"}]}`))
	}
	var refused atomic.Bool
	busy := handler(func(w http.ResponseWriter, _ string) {
		if refused.CompareAndSwap(false, true) {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(429)
			w.Write([]byte(`{"error":{"message":"busy"}}`))
			return
		}
		answer(w)
	})
	slow := handler(func(w http.ResponseWriter, prompt string) {
		if prompt == "slow" {
			time.Sleep(4 * time.Second)
		}
		answer(w)
	})
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: busy, url: 'http://"+busy+"', model: m}\n"+
		"  - {id: slow, url: 'http://"+slow+"', model: m, max_concurrency: 1}\n"+
		"router: {policy: round_robin}\n"+
		"limits: {queue_timeout: 10s}\n")
	for i := 0; !refused.Load(); i++ {
		if i == 4 {
			t.Fatal("busy never got a request")
		}
		post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
	}
	cooled := time.Now() // busy cools down for 1 s
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"slow"}`)); err == nil {
			resp.Body.Close()
		}
	}()
	b := p.s.st.Load().backends["slow"]
	for deadline := time.Now().Add(time.Second); ; {
		b.mu.Lock()
		full := b.full
		b.mu.Unlock()
		if full {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("slow never got the slow request")
		}
		time.Sleep(5 * time.Millisecond)
	}
	resp, body := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`) // queued: slow is full, busy cooling
	if took := time.Since(cooled); resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "busy" || took > 2500*time.Millisecond {
		t.Fatalf("queued request: %d from %q after %v: %s", resp.StatusCode, resp.Header.Get(WorkerHeader), took, body)
	}
	<-done
	p.waitIdle(t)
}

// TestBackendDownWhileCoolingIsForgotten: a backend whose probe fails while
// it cools down after a 429 is down: it is logged so and, after
// health.forget_after, loses its index entries. Its availability did not
// change (cooling had already left it out), so neither happened, ever.
func TestBackendDownWhileCoolingIsForgotten(t *testing.T) {
	body := `{"model":"m","prompt":[` + promptIDs(100) + `]}`
	_, _, p := coolingPair(t, "health: {forget_after: 100ms}\n", body)
	b := p.s.st.Load().backends["busy"]
	blocks := func() int {
		for _, w := range b.pool.rt.Workers() {
			if w.ID == b.worker {
				return w.IndexedBlocks
			}
		}
		return -1
	}
	if blocks() == 0 {
		t.Fatal("busy holds no blocks to forget")
	}
	b.setProbe(false, "") // as the prober does when the engine stops answering /health
	for deadline := time.Now().Add(3 * time.Second); blocks() != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("busy, down for 3s with forget_after 100ms, still holds %d blocks; log: %s", blocks(), p.logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !strings.Contains(p.logs.String(), `"backend":"busy","probe_ok":false`) {
		t.Fatal("busy going down was not logged")
	}
	p.waitIdle(t)
}

// TestReloadedBodyLimitApplies: a reload that raises
// limits.max_request_body_bytes takes effect (the HTTP server kept the
// first limit: a body under the new one got 413), and settings the running
// server cannot change are named in restart_needed.
func TestReloadedBodyLimitApplies(t *testing.T) {
	e := startFake(t, "e0", nil)
	conf := func(limits string) string {
		return "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
			"backends: [{id: e0, url: 'http://" + e.addr + "', model: m}]\n" +
			"limits: {" + limits + "}\n"
	}
	p := startProxyYAML(t, conf("max_request_body_bytes: 2048"))
	var next atomic.Pointer[config.Config]
	p.s.SetReloader(func() error { return p.s.Reload(next.Load()) })
	body := `{"model":"m","prompt":"` + strings.Repeat("a ", 2000) + `"}`
	if resp, b := post(t, p.url+"/v1/completions", body); resp.StatusCode != 413 {
		t.Fatalf("4 KB under a 2 KB limit: %d %s", resp.StatusCode, b)
	}
	cfg, err := config.Parse([]byte(conf("max_request_body_bytes: 65536, max_header_bytes: 32768")))
	if err != nil {
		t.Fatal(err)
	}
	next.Store(cfg)
	if resp, b := post(t, p.url+"/admin/reload", ""); resp.StatusCode != 200 || !strings.Contains(string(b), "limits.max_header_bytes") {
		t.Fatalf("reload: %d %s", resp.StatusCode, b)
	}
	if resp, b := post(t, p.url+"/v1/completions", body); resp.StatusCode != 200 {
		t.Fatalf("4 KB under a reloaded 64 KB limit: %d %s", resp.StatusCode, b)
	}
	// The same file again: the header limit still waits for a restart (it
	// was compared with the last reload's, and the answer forgot it).
	if resp, b := post(t, p.url+"/admin/reload", ""); resp.StatusCode != 200 || !strings.Contains(string(b), "limits.max_header_bytes") {
		t.Fatalf("second reload: %d %s", resp.StatusCode, b)
	}
	// Back to the running value: nothing waits.
	cfg, err = config.Parse([]byte(conf("max_request_body_bytes: 65536")))
	if err != nil {
		t.Fatal(err)
	}
	next.Store(cfg)
	if resp, b := post(t, p.url+"/admin/reload", ""); resp.StatusCode != 200 || strings.Contains(string(b), "restart_needed") {
		t.Fatalf("reload to the running header limit: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// TestReloadedUpstreamLimitsApply: a reload that changes
// limits.upstream_connect_timeout or max_conns_per_backend reaches the
// backends (they were kept as they were, the change silently ignored).
func TestReloadedUpstreamLimitsApply(t *testing.T) {
	e := startFake(t, "e0", nil)
	conf := func(limits string) *config.Config {
		c, err := config.Parse([]byte("models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
			"backends: [{id: e0, url: 'http://" + e.addr + "', model: m}]\n" +
			"limits: {" + limits + "}\n"))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m}]\n"+
		"limits: {upstream_connect_timeout: 1s, max_conns_per_backend: 10}\n", e)
	if err := p.s.Reload(conf("upstream_connect_timeout: 3s, max_conns_per_backend: 20")); err != nil {
		t.Fatal(err)
	}
	if up := p.s.st.Load().backends["e0"].up; up.DialTimeout != 3*time.Second || up.MaxIdle != 20 {
		t.Fatalf("after the reload: dial timeout %v, max idle %d", up.DialTimeout, up.MaxIdle)
	}
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// TestAdminBackendsShowsCooling: /admin/backends tells a backend cooling
// down after a 429 (healthy, not available, for how long) from a down one;
// it showed "healthy": false, as /health no longer counts it.
func TestAdminBackendsShowsCooling(t *testing.T) {
	_, _, p := coolingPair(t, "", `{"model":"m","prompt":"x"}`)
	resp, err := http.Get(p.url + "/admin/backends")
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct {
		ID        string `json:"id"`
		Healthy   bool   `json:"healthy"`
		Available bool   `json:"available"`
		CoolingMs int64  `json:"cooling_ms"`
	}
	err = json.NewDecoder(resp.Body).Decode(&rows)
	resp.Body.Close()
	if err != nil || len(rows) != 2 || rows[0].ID != "busy" || !rows[0].Healthy || rows[0].Available || rows[0].CoolingMs < 29000 ||
		!rows[1].Healthy || !rows[1].Available || rows[1].CoolingMs != 0 {
		t.Fatalf("rows: %+v %v", rows, err)
	}
	p.waitIdle(t)
}

// TestRearmedCoolingOutlivesTheOldTimer: a cooling timer that fired while
// the cooling was re-armed (it waits for the lock) must not end the new
// cooling early.
func TestRearmedCoolingOutlivesTheOldTimer(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	b := p.s.st.Load().backends["e0"]
	b.mu.Lock()
	b.coolLocked(10 * time.Millisecond)
	b.mu.Unlock()
	b.mu.Lock()
	time.Sleep(60 * time.Millisecond) // the old timer fires and waits for b.mu
	b.coolLocked(time.Hour)
	b.mu.Unlock()
	time.Sleep(30 * time.Millisecond)
	b.mu.Lock()
	cooling := b.cooling
	if b.coolTimer != nil {
		b.coolTimer.Stop()
	}
	b.mu.Unlock()
	if !cooling {
		t.Fatal("the re-armed cooling was ended by the timer it replaced")
	}
}

// coolingPair starts a round_robin proxy over "busy", an engine that
// answers 429 with Retry-After 30, and "ok", plus extraYAML, and sends body
// until busy has refused a request (each is retried on ok): busy is then
// cooling down.
func coolingPair(t *testing.T, extraYAML, body string) (busy, ok *fakeEngine, p *testProxy) {
	t.Helper()
	busy = startFake(t, "busy", func(f *fakeEngine) { f.status, f.retryAfter, f.errBody = 429, "30", `{"error":{"message":"busy"}}` })
	ok = startFake(t, "ok", nil)
	p = startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: busy, url: 'http://{{e0}}', model: m}\n"+
		"  - {id: ok, url: 'http://{{e1}}', model: m}\n"+
		extraYAML+"router: {policy: round_robin}\n", busy, ok)
	for i := 0; busy.requests.Load() == 0; i++ {
		if i == 4 {
			t.Fatal("busy never got a request")
		}
		if resp, b := post(t, p.url+"/v1/completions", body); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	return busy, ok, p
}

// TestRebuiltBackendCountsTheRequestsItsEngineRuns: a reload that rebuilds
// a backend (here: new connection limits; a lowered max_concurrency too)
// hands the requests the old one still runs to the new one's count. Each
// rebuilt backend used to start with every max_concurrency slot free: the
// queued requests went in at once, and the engine ran twice its limit, or
// three times a lowered one (found by the thirteenth session's review).
func TestRebuiltBackendCountsTheRequestsItsEngineRuns(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 500 * time.Millisecond })
	conf := func(maxConns, maxConcurrency int) string {
		return fmt.Sprintf("models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
			"backends: [{id: e0, url: 'http://%s', model: m, max_concurrency: %d}]\n"+
			"limits: {max_conns_per_backend: %d, queue_timeout: 10s}\n", e.addr, maxConcurrency, maxConns)
	}
	p := startProxyYAML(t, conf(10, 2), e)
	reload := func(maxConns, maxConcurrency int) { t.Helper(); p.reloadYAML(t, conf(maxConns, maxConcurrency)) }
	send := func(n int) *sync.WaitGroup { return p.sendCompletions(t, n) }
	waitRunning := func(n int64) { t.Helper(); e.waitRunning(t, n) }

	wg := send(4) // two run, two wait for a slot
	waitRunning(2)
	reload(20, 2)
	wg.Wait()
	if peak := e.peak.Load(); peak != 2 {
		t.Fatalf("the engine ran %d requests at once around a reload, max_concurrency 2", peak)
	}

	wg = send(2)
	waitRunning(2)
	reload(30, 1) // lowered: the next waits until both have ended
	e.peak.Store(0)
	wg2 := send(1)
	wg.Wait()
	wg2.Wait()
	if peak := e.peak.Load(); peak != 1 { // counted as the third came in
		t.Fatalf("the engine ran %d requests at once after max_concurrency went from 2 to 1", peak)
	}
	p.waitIdle(t)
}

// TestSlotCountFollowsTheEngine: the count of the requests an engine runs
// goes with the backend's id and URL, through whatever else a reload
// rebuilds (the model's settings: a new pool) and through a removal and
// return while they run; a backend moved to another URL is another engine,
// with its slots free (the first version shared the count with any
// successor of the same id and pool: a backend moved off a bad host
// answered 503 until the old host's requests ended; found by the
// thirteenth session's review).
func TestSlotCountFollowsTheEngine(t *testing.T) {
	e0 := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 500 * time.Millisecond })
	e1 := startFake(t, "e1", nil)
	conf := func(blockSize int, backends string) string {
		return fmt.Sprintf("models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: %d}]\n"+
			"backends: [%s]\nlimits: {queue_timeout: 10s}\n", blockSize, backends)
	}
	on := func(e *fakeEngine) string {
		return fmt.Sprintf("{id: gpu, url: 'http://%s', model: m, max_concurrency: 2}", e.addr)
	}
	p := startProxyYAML(t, conf(16, on(e0)), e0)
	reload := func(yaml string) { t.Helper(); p.reloadYAML(t, yaml) }
	send := func(n int) *sync.WaitGroup { return p.sendCompletions(t, n) }
	waitRunning := func(n int64) { t.Helper(); e0.waitRunning(t, n) }

	wg := send(2)
	waitRunning(2)
	reload(conf(32, on(e0))) // a new pool for the model, the same engine
	wg.Add(1)
	go func() { defer wg.Done(); send(2).Wait() }()
	wg.Wait()
	if peak := e0.peak.Load(); peak != 2 {
		t.Fatalf("e0 ran %d requests at once across a reload that rebuilt its model, max_concurrency 2", peak)
	}

	wg = send(2)
	waitRunning(2)
	reload(conf(32, fmt.Sprintf("{id: other, url: 'http://%s', model: m}", e1.addr))) // gpu removed...
	reload(conf(32, on(e0)))                                                          // ...and back
	wg.Add(1)
	go func() { defer wg.Done(); send(2).Wait() }()
	wg.Wait()
	if peak := e0.peak.Load(); peak != 2 {
		t.Fatalf("e0 ran %d requests at once after its backend was removed and added back", peak)
	}

	wg = send(2)
	waitRunning(2)
	reload(conf(32, on(e1))) // moved to another engine: its slots are free
	start := time.Now()
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "gpu" {
		t.Fatalf("on the new engine: %d %s", resp.StatusCode, b)
	}
	if d := time.Since(start); d > 300*time.Millisecond || e1.requests.Load() == 0 {
		t.Fatalf("the request to the moved backend took %v, %d reached its engine: it waited for the old engine's", d, e1.requests.Load())
	}
	wg.Wait()
	p.waitIdle(t)
}

// reloadYAML reloads the proxy with a configuration.
func (p *testProxy) reloadYAML(t *testing.T, yaml string) {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
}

// sendCompletions sends n completions at once, each expected to succeed;
// the group ends when all have.
func (p *testProxy) sendCompletions(t *testing.T, n int) *sync.WaitGroup {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
				t.Errorf("%d %s", resp.StatusCode, b)
			}
		})
	}
	return &wg
}

// waitRunning waits until the engine runs n requests.
func (f *fakeEngine) waitRunning(t *testing.T, n int64) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); f.current.Load() != n; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s runs %d requests, want %d", f.id, f.current.Load(), n)
		}
	}
}
