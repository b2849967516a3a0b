package proxy

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

// TestRetireWaitsForEveryRank: a backend removed by a reload is retired
// (its router workers removed, its connections closed) only once the
// requests on all its data-parallel ranks have ended. It used to wait for
// rank 0's alone, and retired at once while a rank 1 stream was running.
func TestRetireWaitsForEveryRank(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 800 * time.Millisecond })
	other := startFake(t, "e1", nil)
	head := "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
		"backends:\n" +
		"  - {id: e1, url: 'http://" + other.addr + "', model: m}\n"
	p := startProxyYAML(t, head+"  - {id: e0, url: 'http://{{e0}}', model: m, kv_events: {mode: http}}\n", e)
	ids := promptIDs(100)
	pushRank(t, p, "e0", 1, ids) // only e0's rank 1 holds the prompt

	type result struct {
		status int
		worker string
		body   string
		at     time.Time
	}
	res := make(chan result, 1)
	go func() {
		resp, err := http.Post(p.url+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"m","prompt":[`+ids+`],"stream":true}`))
		if err != nil {
			res <- result{body: err.Error(), at: time.Now()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		res <- result{resp.StatusCode, resp.Header.Get(WorkerHeader), string(b), time.Now()}
	}()
	deadline := time.Now().Add(3 * time.Second)
	for e.current.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("e0 never got the request")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cfg, err := config.Parse([]byte(head)) // e0 removed
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	var retired time.Time
	for deadline := time.Now().Add(5 * time.Second); retired.IsZero(); time.Sleep(5 * time.Millisecond) {
		if strings.Contains(p.logs.String(), `"backend":"e0","replaced":false,"message":"backend retired"`) {
			retired = time.Now()
		} else if time.Now().After(deadline) {
			t.Fatalf("e0 never retired: %s", p.logs.String())
		}
	}
	r := <-res
	if r.status != 200 || r.worker != "e0" || !strings.HasSuffix(strings.TrimSpace(r.body), "data: [DONE]") {
		t.Fatalf("the stream on rank 1: %d from %q: %s", r.status, r.worker, r.body)
	}
	if retired.Before(r.at.Add(-20 * time.Millisecond)) {
		t.Fatalf("e0 retired %v before its rank 1 stream ended", r.at.Sub(retired))
	}
	p.waitIdle(t)
}

// startSlowOnE0 starts a proxy for models m and m2 with backends e1 and e0
// (model m) and one request on e0 that takes 600 ms; it returns once e0 has
// it. head is the config without e0; done closes when the request ends.
func startSlowOnE0(t *testing.T) (p *testProxy, e, other *fakeEngine, head string, done chan struct{}) {
	t.Helper()
	e = startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 600 * time.Millisecond })
	other = startFake(t, "e1", nil)
	head = "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}, {name: m2, tokenizer: cl100k_base, template: chatml}]\n" +
		"backends:\n  - {id: e1, url: 'http://" + other.addr + "', model: m}\n"
	p = startProxyYAML(t, head+"  - {id: e0, url: 'http://{{e0}}', model: m}\n", e)
	done = make(chan struct{})
	go func() {
		defer close(done)
		post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"e0"}}`)
	}()
	for deadline := time.Now().Add(3 * time.Second); e.current.Load() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("e0 never got the request")
		}
	}
	return p, e, other, head, done
}

// TestDrainingBackendShowsInAdmin: a backend a reload removed or replaced
// stays in /admin/backends, marked draining with its in-flight requests,
// until it has retired; /metrics keeps one series per backend id.
func TestDrainingBackendShowsInAdmin(t *testing.T) {
	p, e, _, head, done := startSlowOnE0(t)
	// e0 replaced (another URL, the same id) and the old one draining.
	third := startFake(t, "e2", nil)
	cfg, err := config.Parse([]byte(head + "  - {id: e0, url: 'http://" + third.addr + "', model: m, max_concurrency: 7}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	get := func(url string) (*http.Response, []byte) { return fetch(t, url) }
	rows := func() []backendJSON {
		resp, b := get(p.url + "/admin/backends")
		var out []backendJSON
		if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return out
	}
	var draining *backendJSON
	for _, r := range rows() {
		if r.Draining {
			draining = &r
		}
	}
	if draining == nil || draining.ID != "e0" || draining.Inflight != 1 || draining.URL != "http://"+e.addr {
		t.Fatalf("no draining e0 with its request in %+v", rows())
	}
	// Its engine is healthy, and the router load of its request shows
	// (shared with its successor): a reload looked like an outage of an
	// idle engine (the replicas trial).
	if !draining.Healthy || draining.Down != nil || draining.ActiveBlocks == 0 {
		t.Fatalf("the draining e0: %+v", *draining)
	}
	if resp, b := get(p.url + "/metrics"); resp.StatusCode != 200 || strings.Count(string(b), `kvproxy_inflight_requests{backend="e0"}`) != 1 ||
		!strings.Contains(string(b), `kvproxy_inflight_requests{backend="e0"} 1`) {
		t.Fatalf("/metrics: %d, e0 series %d (want one, of 1 request):\n%s", resp.StatusCode, strings.Count(string(b), `kvproxy_inflight_requests{backend="e0"}`), b)
	}
	<-done
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		left := false
		for _, r := range rows() {
			left = left || r.Draining
		}
		if !left {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the old e0 never left: %+v", rows())
		}
	}
	p.waitIdle(t)
}

// A backend a reload removed, or moved to another model, keeps counting
// its requests in kvproxy_inflight_requests while they drain: they are
// still running on that engine (found by the seventh session's trial: a
// model rename showed 0 in flight while 6 streams ran). Each counts once,
// whatever the reloads: one removed and added again while its requests
// drain counted them twice, in the draining backend and in the router
// worker the new one took back (found by the twelfth session's operator
// trial).
func TestDrainingRequestsStayInTheMetrics(t *testing.T) {
	const e0 = "  - {id: e0, url: 'http://{{e0}}', model: m}\n"
	for _, c := range []struct {
		name    string
		reloads []string // what follows head, one reload each
	}{
		{"removed", []string{""}},
		{"moved", []string{"  - {id: e0, url: 'http://{{e0}}', model: m2}\n"}},
		{"replaced", []string{"  - {id: e0, url: 'http://{{e0}}', model: m, max_concurrency: 8}\n"}},
		{"removed then added again", []string{"", e0}},
		{"replaced then removed", []string{"  - {id: e0, url: 'http://{{e0}}', model: m, max_concurrency: 8}\n", ""}},
		{"removed, added again, removed", []string{"", e0, ""}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, e, _, head, done := startSlowOnE0(t)
			for _, after := range c.reloads {
				cfg, err := config.Parse([]byte(head + strings.ReplaceAll(after, "{{e0}}", e.addr)))
				if err != nil {
					t.Fatal(err)
				}
				if err := p.s.Reload(cfg); err != nil {
					t.Fatal(err)
				}
			}
			resp, err := http.Get(p.url + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if n := strings.Count(string(b), `kvproxy_inflight_requests{backend="e0"}`); n != 1 || !strings.Contains(string(b), `kvproxy_inflight_requests{backend="e0"} 1`) {
				t.Fatalf("e0 series %d, want one of 1 request in flight:\n%s", n, b)
			}
			// /admin/backends counts it once too, in the row of the
			// backend that holds it (found by the session's review).
			var rows []backendJSON
			_, ab := fetch(t, p.url+"/admin/backends")
			json.Unmarshal(ab, &rows)
			total := int64(0)
			for _, r := range rows {
				if r.ID == "e0" {
					total += r.Inflight
				}
			}
			if total != 1 {
				t.Fatalf("/admin/backends counts %d requests on e0, want 1: %s", total, ab)
			}
			<-done
			p.waitIdle(t)
		})
	}
}

// A backend a reload removed stays listed as draining, with its requests
// in flight, until they have ended, even past limits.drain_timeout: it left
// /admin/backends and /metrics at the deadline while its stream went on,
// and an operator who saw it gone would have stopped the engine under it
// (found by the ninth session's operator trial).
func TestRemovedBackendListedUntilItsRequestsEnd(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 1500 * time.Millisecond })
	other := startFake(t, "e1", nil)
	head := "models: [{name: m}]\nlimits: {drain_timeout: 100ms}\nbackends:\n  - {id: e1, url: 'http://" + other.addr + "', model: m}\n"
	p := startProxyYAML(t, head+"  - {id: e0, url: 'http://{{e0}}', model: m}\n", e)
	done := make(chan struct{})
	go func() {
		defer close(done)
		post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"e0"}}`)
	}()
	for deadline := time.Now().Add(3 * time.Second); e.current.Load() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("e0 never got the request")
		}
	}
	cfg, err := config.Parse([]byte(head))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	listed := func() (bool, int64) {
		resp, err := http.Get(p.url + "/admin/backends")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var rows []struct {
			ID       string `json:"id"`
			Inflight int64  `json:"inflight"`
			Draining bool   `json:"draining"`
		}
		json.NewDecoder(resp.Body).Decode(&rows)
		for _, r := range rows {
			if r.ID == "e0" {
				return r.Draining, r.Inflight
			}
		}
		return false, 0
	}
	time.Sleep(300 * time.Millisecond) // past drain_timeout, before the request ends
	if draining, n := listed(); !draining || n != 1 {
		t.Fatalf("past drain_timeout with its request running: listed draining %v with %d in flight, want true and 1", draining, n)
	}
	if !strings.Contains(p.logs.String(), "backend still has requests after limits.drain_timeout") {
		t.Errorf("no warning that the backend outlived drain_timeout:\n%s", p.logs.String())
	}
	<-done
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if draining, _ := listed(); !draining {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("e0 still listed after its request ended")
		}
	}
	p.waitIdle(t)
}
