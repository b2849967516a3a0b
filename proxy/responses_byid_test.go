package proxy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// byIDYAML: a tenant with a max_concurrency, and a stream_idle_timeout
// short enough that a request left to it would end within the test.
const byIDYAML = `
models: [{name: m, block_size: 16}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
auth:
  keys: [{key: key-capped-123, tenant: capped}]
tenants: [{name: capped, max_concurrency: 2}]
limits: {stream_idle_timeout: 3s}
`

// startHeldByID starts a request for a stored response the engine never
// answers (it sits in a long prefill) and waits for the engine to have it.
// It returns the client's connection.
func startHeldByID(t *testing.T, p *testProxy, e *fakeEngine, method, sub string) net.Conn {
	t.Helper()
	id := string(appendTaggedID(nil, testTag(p, "e0", "capped", "resp_held"), []byte("resp_held")))
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "%s /v1/responses/%s%s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-capped-123\r\nContent-Length: 0\r\n\r\n", method, id, sub)
	deadline := time.Now().Add(3 * time.Second)
	for e.requests.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the request never reached the engine")
		}
		time.Sleep(time.Millisecond)
	}
	return c
}

// byIDLogLine waits for the access log line of the by-id request on path.
func byIDLogLine(t *testing.T, p *testProxy, path string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		for _, l := range strings.Split(p.logs.String(), "\n") {
			if strings.Contains(l, `"path":"`+path+`"`) {
				return decodeJSON(t, []byte(l))
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log line for %s:\n%s", path, p.logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A client that hangs up on a request for a stored response ends its
// engine exchange at once, as a completion's does: the engine sees its
// connection close, the tenant's place and the backend's count are given
// back, the request is logged 499, and the engine, which did nothing
// wrong, is not struck. While it runs it counts on the backend and among
// the live exchanges.
func TestResponseByIDClientHangUp(t *testing.T) {
	for _, tc := range []struct{ method, sub string }{
		{"GET", ""}, {"DELETE", ""}, {"POST", "/cancel"}, {"GET", "/input_items"},
	} {
		t.Run(tc.method+tc.sub, func(t *testing.T) {
			e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
			p := startProxyYAML(t, byIDYAML, e)
			b := p.s.st.Load().backends["e0"]
			c := startHeldByID(t, p, e, tc.method, tc.sub)

			if n, in, live := cappedInflight(p), b.inflight.Load(), p.s.InFlight(); n != 1 || in != 1 || live != 1 {
				t.Fatalf("while it runs: tenant %d, backend %d, live %d; want 1 each", n, in, live)
			}
			if m := grepLines(p.metrics(t), `kvproxy_inflight_requests{backend="e0"}`); m != `kvproxy_inflight_requests{backend="e0"} 1` {
				t.Fatalf("metrics while it runs: %q", m)
			}

			left := time.Now()
			c.Close()
			line := byIDLogLine(t, p, "/v1/responses/{id}"+tc.sub)
			if line["status"] != 499.0 || line["method"] != tc.method || line["error"] != nil {
				t.Fatalf("logged %v, want status 499 and no error", line)
			}
			for e.aborted.Load() == 0 {
				if time.Since(left) > 2*time.Second {
					t.Fatal("the engine never saw its connection close")
				}
				time.Sleep(time.Millisecond)
			}
			waitInflight(t, p, 0)
			p.waitIdle(t)
			if took := time.Since(left); took > 2*time.Second {
				t.Fatalf("freed %v after the client left, want at once (stream_idle_timeout is 3s)", took)
			}
			if p.s.InFlight() != 0 {
				t.Fatalf("still %d live exchanges", p.s.InFlight())
			}
			b.mu.Lock()
			silent := b.silentWhole
			b.mu.Unlock()
			if silent != 0 || !b.healthy() || !b.isAvailable() {
				t.Fatalf("backend struck for the client's hang-up: silent %d, healthy %v, available %v", silent, b.healthy(), b.isAvailable())
			}
			if m := p.metrics(t); !strings.Contains(m, `kvproxy_requests_total{backend="e0",code="499"} 1`) {
				t.Fatalf("499 not counted:\n%s", grepLines(m, "kvproxy_requests_total"))
			}
		})
	}
}

// The drain deadline's cut ends a request for a stored response as it ends
// any other: the client gets a 503 shutting_down at once.
func TestResponseByIDCutAtDrainDeadline(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	p := startProxyYAML(t, byIDYAML, e)
	c := startHeldByID(t, p, e, "GET", "")
	cut := time.Now()
	if n := p.s.Cut(); n != 1 {
		t.Fatalf("Cut ended %d requests, want 1", n)
	}
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no answer within 2s of the cut: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	var v struct {
		Error struct{ Code string } `json:"error"`
	}
	json.Unmarshal(body, &v)
	if resp.StatusCode != 503 || v.Error.Code != "shutting_down" || time.Since(cut) > 2*time.Second {
		t.Fatalf("after the cut: %d %s, %v later", resp.StatusCode, body, time.Since(cut))
	}
	for e.aborted.Load() == 0 {
		if time.Since(cut) > 2*time.Second {
			t.Fatal("the engine never saw its connection close")
		}
		time.Sleep(time.Millisecond)
	}
}

// A request for a stored response whose backend a reload is retiring,
// caught in the moment between its lookup and its counting on the backend
// (the retirement may have read the count before it, and the engine be
// gone), gets a 503 to retry, and never reaches the engine.
func TestResponseByIDOnARetiringBackend(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, byIDYAML, e)
	b := p.s.st.Load().backends["e0"]
	b.retiring.Store(true) // the reload's mark, set just after the lookup
	defer b.retiring.Store(false)
	id := string(appendTaggedID(nil, testTag(p, "e0", "capped", "resp_1"), []byte("resp_1")))
	req, _ := http.NewRequest("GET", p.url+"/v1/responses/"+id, nil)
	req.Header.Set("Authorization", "Bearer key-capped-123")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" || e.requests.Load() != 0 {
		t.Fatalf("%d %s (engine saw %d requests), want a 503 to retry", resp.StatusCode, body, e.requests.Load())
	}
	if n := b.inflight.Load(); n != 0 {
		t.Fatalf("backend count %d after the refusal", n)
	}
}

// An engine refusing kvproxy's key on a request about a stored response is
// kvproxy's configuration at fault, as on every other path: a 502 naming
// the backend by the refusal's status and kind, never the engine's message
// (it may echo the key kvproxy sent; the review), and not a 401 the
// client's SDK takes for its own key refused.
func TestResponseByIDEngineRefusalIs502(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) {
		f.status, f.errBody = 401, `{"error":{"message":"bad key: Bearer ENGINE-KEY-SECRET","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}`
	})
	p := startProxyYAML(t, byIDYAML, e)
	id := string(appendTaggedID(nil, testTag(p, "e0", "capped", "resp_1"), []byte("resp_1")))
	for _, method := range []string{"GET", "DELETE"} {
		req, _ := http.NewRequest(method, p.url+"/v1/responses/"+id, nil)
		code, b := doAuth(t, req, "key-capped-123")
		if code != 502 || strings.Contains(b, "SECRET") ||
			!strings.Contains(b, "backend e0 refused kvproxy's credentials (401: type invalid_request_error, code invalid_api_key); check its api_key") {
			t.Fatalf("%s: %d %s", method, code, b)
		}
	}
	p.waitIdle(t)
	if strings.Contains(p.logs.String(), "SECRET") {
		t.Fatalf("the log holds the engine's message:\n%s", p.logs.String())
	}
}
