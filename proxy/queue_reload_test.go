package proxy

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/config"
)

// Tests from the sixth session's review: requests waiting for a slot, and
// pinned requests, across reloads and cooling backends.

// A request queued behind a full backend should be served by a backend a
// reload adds ("added backends get traffic at once"), not wait out
// queue_timeout.
func TestQueuedRequestTakesABackendAReloadAdds(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.prefillDelay = 4 * time.Second })
	added := startFake(t, "added", nil)
	base := "models: [{name: m, aliases: [alias-m]}]\nlimits: {max_queue: 8, queue_timeout: 3s}\nbackends:\n  - {id: busy, url: 'http://{{e0}}', max_concurrency: 1}\n"
	p := startProxyYAML(t, base, busy)
	go postAsync(p.url+"/v1/chat/completions", chatBody) // occupies busy's only slot for 4s
	for busy.requests.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	type res struct {
		code   int
		worker string
		took   time.Duration
	}
	done := make(chan res, 1)
	go func() {
		t0 := time.Now()
		code, worker := postAsync(p.url+"/v1/chat/completions", chatBody)
		done <- res{code, worker, time.Since(t0)}
	}()
	time.Sleep(300 * time.Millisecond) // it is queued now
	y := strings.ReplaceAll(base, "{{e0}}", busy.addr) + "  - {id: added, url: 'http://" + added.addr + "'}\n"
	cfg, err := config.Parse([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	r := <-done
	t.Logf("queued request: status %d worker %q after %v", r.code, r.worker, r.took)
	if r.code != 200 || r.worker != "added" || r.took > time.Second {
		t.Fatalf("queued request did not move to the added backend at once: %+v", r)
	}
}

// Same with a reload that raises the full backend's max_concurrency.
func TestQueuedRequestTakesASlotAReloadAdds(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	base := "models: [{name: m, aliases: [alias-m]}]\nlimits: {max_queue: 8, queue_timeout: 3s}\nbackends:\n  - {id: busy, url: 'http://{{e0}}', max_concurrency: 1}\n"
	p := startProxyYAML(t, base, busy)
	go postAsync(p.url+"/v1/chat/completions", chatBody)
	for busy.requests.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	done := make(chan time.Duration, 1)
	go func() {
		t0 := time.Now()
		postAsync(p.url+"/v1/chat/completions", chatBody)
		done <- time.Since(t0)
	}()
	time.Sleep(300 * time.Millisecond)
	y := strings.ReplaceAll(strings.ReplaceAll(base, "{{e0}}", busy.addr), "max_concurrency: 1", "max_concurrency: 4")
	cfg, _ := config.Parse([]byte(y))
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Second)
	for busy.requests.Load() != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("1 s after the reload raised max_concurrency to 4 the engine has %d requests, want 2 (the queued one)", busy.requests.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if took := <-done; took > 3*time.Second { // its own 2 s, not 2 s more behind the running one
		t.Fatalf("the queued request waited for the running one: %v", took)
	}
}

// Pinned to a backend cooling after a 429 while another backend is full:
// the pinned request waits out queue_timeout and gets 503 "no backend had
// capacity" instead of the immediate 429 backend_cooling_down.
func TestPinnedToCoolingBackendIsNotQueuedBehindAnother(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.status, f.retryAfter, f.errBody = 429, "30", `{"error":{"message":"busy"}}` })
	ok := startFake(t, "ok", func(f *fakeEngine) { f.prefillDelay = 3000 * time.Millisecond })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n  - {id: busy, url: 'http://{{e0}}', model: m}\n  - {id: ok, url: 'http://{{e1}}', model: m, max_concurrency: 1}\n"+
		"limits: {queue_timeout: 2s}\nrouter: {policy: round_robin}\n", busy, ok)
	for i := 0; busy.requests.Load() == 0; i++ {
		if i == 4 {
			t.Fatal("busy never got a request")
		}
		post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
	}
	if p.s.st.Load().backends["busy"].coolingLeft() == 0 {
		t.Fatal("busy is not cooling")
	}
	n := ok.requests.Load()
	go postAsync(p.url+"/v1/completions", `{"model":"m","prompt":"y"}`) // fills ok
	for ok.requests.Load() == n {
		time.Sleep(time.Millisecond)
	}
	t0 := time.Now()
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"busy"}}`)
	if took := time.Since(t0); resp.StatusCode != 429 || !strings.Contains(string(b), "backend_cooling_down") || took > time.Second {
		t.Fatalf("pinned to cooling busy while ok is full: %d after %v: %s; want the immediate 429 backend_cooling_down", resp.StatusCode, took, b)
	}
}

// Pinned to a backend a reload removed: the pool keeps the old backend in
// its worker table, so the "no backend serves" 400 never comes; the client
// got 503 + Retry-After 1 forever. It is a 400, as for a name never known.
func TestPinnedToRemovedBackendIs400(t *testing.T) {
	a, b := startFake(t, "a", nil), startFake(t, "b", nil)
	y := "models: [{name: m, aliases: [alias-m]}]\nbackends:\n  - {id: a, url: 'http://{{e0}}'}\n  - {id: b, url: 'http://{{e1}}'}\n"
	p := startProxyYAML(t, y, a, b)
	cfg, _ := config.Parse([]byte("models: [{name: m, aliases: [alias-m]}]\nbackends:\n  - {id: a, url: 'http://" + a.addr + "'}\n"))
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"b", "nosuch"} {
		resp, out := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"`+id+`"}}`)
		if resp.StatusCode != 400 || !strings.Contains(string(out), `no backend \"`+id+`\" serves model`) {
			t.Fatalf("pinned to %s: %d %s", id, resp.StatusCode, out)
		}
	}
}

// postAsync posts from a goroutine other than the test's: the status and
// the worker that answered (0 when the request failed).
func postAsync(url, body string) (status int, worker string) {
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		return 0, ""
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get(WorkerHeader)
}

// A reload that rebuilds a model (its template changed) leaves the requests
// queued on the old pool no engine: they get a 503 that says to retry,
// counted as backend_removed, not as an outage (no_healthy_backend, the one
// to alert on), and a retry is served (the chaos trial).
//
// A request pinned to the backend (nvext.backend_instance_id, or a
// follow-up to its stored response) is answered the same: the backend is
// not down (the reload chaos trial: pinned_backend_unavailable, counted as
// an outage of a healthy engine).
func TestQueuedRequestsOfARebuiltModel(t *testing.T) {
	t.Run("routed", func(t *testing.T) { testQueuedRequestOfARebuiltModel(t, chatBody) })
	t.Run("pinned", func(t *testing.T) {
		testQueuedRequestOfARebuiltModel(t, strings.Replace(chatBody, `"nvext":{"annotations":[]}`, `"nvext":{"backend_instance_id":"busy"}`, 1))
	})
}

func testQueuedRequestOfARebuiltModel(t *testing.T, queuedBody string) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.prefillDelay = time.Second })
	base := "models: [{name: m, aliases: [alias-m], template: chatml}]\nlimits: {max_queue: 8, queue_timeout: 5s}\nbackends:\n  - {id: busy, url: 'http://{{e0}}', max_concurrency: 1}\n"
	p := startProxyYAML(t, base, busy)
	go postAsync(p.url+"/v1/chat/completions", chatBody) // holds busy's only slot
	waitFor(t, "the first request at the engine", func() bool { return busy.requests.Load() == 1 })
	type answer struct {
		code int
		body string
	}
	queued := make(chan answer, 1)
	go func() {
		resp, err := http.Post(p.url+"/v1/chat/completions", "application/json", strings.NewReader(queuedBody))
		if err != nil {
			queued <- answer{}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		queued <- answer{resp.StatusCode, string(b)}
	}()
	waitFor(t, "the second request queued", func() bool { return p.s.queued.Load() == 1 })
	cfg, err := config.Parse([]byte(strings.ReplaceAll(strings.Replace(base, "chatml", "raw", 1), "{{e0}}", busy.addr)))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	a := <-queued
	if a.code != 503 || !strings.Contains(a.body, "a reload changed or removed the model's configuration while the request waited; retry") || !strings.Contains(a.body, `"code":"backend_removed"`) {
		t.Fatalf("the queued request: %d %s", a.code, a.body)
	}
	m := p.metrics(t)
	for _, want := range []string{`kvproxy_unavailable_total{reason="backend_removed"} 1`, `kvproxy_unavailable_total{reason="no_healthy_backend"} 0`,
		`kvproxy_unavailable_total{reason="pinned_backend_unavailable"} 0`} {
		if !strings.Contains(m, want) {
			t.Errorf("want %s:\n%s", want, grepLines(m, "unavailable_total"))
		}
	}
	if resp, b := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 200 {
		t.Fatalf("the retry: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
	// The old busy is replaced, as the reload's line says, not removed (the
	// operator trial: its lines read as a backend gone).
	waitRetired(t, p, "busy", true)
	if logs := p.logs.String(); !strings.Contains(logs, `"backends_replaced":["busy"]`) ||
		!strings.Contains(logs, `"backend":"busy","message":"backend draining (replaced by reload: a backend of its id takes the new requests)"`) ||
		strings.Contains(logs, "removed by reload") {
		t.Fatalf("the reload's lines: %s", logs)
	}
}

// A pinned request admitted on the state before a reload that rebuilt its
// model resolves its pin on the old pool, whose backends are draining: a
// 503 to retry, as for a queued one, not a 400 that blames the client and
// that SDKs never retry (the last review's reload chaos).
func TestPinnedRequestAcrossAModelRebuildIsRetried(t *testing.T) {
	e := startFake(t, "busy", nil)
	base := "models: [{name: m, aliases: [alias-m], template: chatml}]\nbackends:\n  - {id: busy, url: 'http://{{e0}}'}\n"
	p := startProxyYAML(t, base, e)
	before := p.s.st.Load()
	cfg, err := config.Parse([]byte(strings.ReplaceAll(strings.Replace(base, "chatml", "raw", 1), "{{e0}}", e.addr)))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	var req fasthttp.Request
	req.Header.SetMethod("POST")
	req.SetRequestURI("/v1/chat/completions")
	req.Header.SetContentType("application/json")
	req.SetBodyString(strings.Replace(chatBody, `"nvext":{"annotations":[]}`, `"nvext":{"backend_instance_id":"busy"}`, 1))
	var ctx fasthttp.RequestCtx
	ctx.Init(&req, &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 5000}, nil)
	p.s.handleCompletion(&ctx, before, apiChat) // as admitted just before the reload
	if code, b := ctx.Response.StatusCode(), string(ctx.Response.Body()); code != 503 || !strings.Contains(b, `"code":"backend_removed"`) {
		t.Fatalf("%d %s", code, b)
	}
}
