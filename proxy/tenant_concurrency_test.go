package proxy

import (
	"bufio"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

const concurrencyYAML = `
models: [{name: m, aliases: [alias-m], block_size: 16}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
auth:
  keys: [{key: key-capped-123, tenant: capped}, {key: key-free-45678, tenant: free}]
tenants: [{name: capped, max_concurrency: 2}]
`

// sendAuth starts a request with the capped tenant's key on a connection
// of its own (proto HTTP/1.1 or HTTP/1.0) and returns the connection.
func sendAuth(t *testing.T, p *testProxy, proto, path, key, body string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "POST %s %s\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, proto, key, len(body), body)
	return c
}

func cappedInflight(p *testProxy) int64 { return p.s.st.Load().auth.tenants["capped"].inflight.Load() }

// waitInflight waits for the capped tenant's count to reach n: a stream's
// slot is given back just after the client has its last byte.
func waitInflight(t *testing.T, p *testProxy, n int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for cappedInflight(p) != n {
		if time.Now().After(deadline) {
			t.Fatalf("tenant in flight: %d, want %d", cappedInflight(p), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A tenant's max_concurrency caps its requests in flight: the next one is a
// 429 concurrency_limit_exceeded with Retry-After, other tenants are not
// affected, and every way a request ends gives its place back (streams
// ended, cut by the client, relayed to HTTP/1.0, whole answers, dry runs,
// refusals, pass-through), also across a reload.
func TestTenantMaxConcurrency(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 4, 1, 600*time.Millisecond })
	p := startProxyYAML(t, concurrencyYAML, e)
	stream := `{"model":"m","prompt":"x","stream":true}`
	a := sendAuth(t, p, "HTTP/1.1", "/v1/completions", "key-capped-123", stream)
	b := sendAuth(t, p, "HTTP/1.0", "/v1/completions", "key-capped-123", stream)
	waitInflight(t, p, 2)
	resp, body := postAuth(t, p.url+"/v1/completions", "key-capped-123", `{"model":"m","prompt":"y"}`)
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "1" || !strings.Contains(body, `"code":"concurrency_limit_exceeded"`) || !strings.Contains(body, "the limit is 2") {
		t.Fatalf("third request in flight: %d %v %s", resp.StatusCode, resp.Header, body)
	}
	if resp, body := postAuth(t, p.url+"/v1/completions", "key-free-45678", `{"model":"m","prompt":"y"}`); resp.StatusCode != 200 {
		t.Fatalf("another tenant: %d %s", resp.StatusCode, body)
	}
	a.Close() // cut by the client mid-stream
	waitInflight(t, p, 1)
	// The HTTP/1.0 stream ends with its connection.
	if all, _ := bufio.NewReader(b).ReadString(0); !strings.Contains(all, "data: [DONE]") {
		t.Fatalf("HTTP/1.0 stream: %q", all)
	}
	waitInflight(t, p, 0)

	// A reload while a stream runs keeps its place counted.
	c := sendAuth(t, p, "HTTP/1.1", "/v1/completions", "key-capped-123", stream)
	waitInflight(t, p, 1)
	y := strings.ReplaceAll(concurrencyYAML, "{{e0}}", e.addr) + "limits: {max_queue: 4}\n"
	cfg, err := config.Parse([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if n := cappedInflight(p); n != 1 {
		t.Fatalf("after the reload the tenant has %d in flight, want 1", n)
	}
	c.Close()
	waitInflight(t, p, 0)

	// Every other way a request can end gives its place back.
	for _, r := range []struct{ path, body string }{
		{"/v1/completions", `{"model":"m","prompt":"whole"}`},
		{"/v1/completions", `{"model":"m","prompt":"x","nvext":{"annotations":["query_instance_id"]}}`},
		{"/v1/completions", `{"model":"nosuch","prompt":"x"}`},
		{"/v1/completions", `{"model":"m","prompt":`},
		{"/v1/embeddings", `{"model":"m","input":"x"}`},
	} {
		postAuth(t, p.url+r.path, "key-capped-123", r.body)
		waitInflight(t, p, 0)
	}
	p.waitIdle(t)
	m := p.metrics(t)
	if !strings.Contains(m, `kvproxy_tenant_inflight_requests{tenant="capped"} 0`+"\n") || strings.Contains(m, `kvproxy_tenant_inflight_requests{tenant="free"}`) {
		t.Fatalf("/metrics: %s", grepLines(m, "kvproxy_tenant_inflight"))
	}
}

// max_concurrency must not be negative.
func TestTenantMaxConcurrencyValidated(t *testing.T) {
	_, err := config.Parse([]byte("models: [{name: m}]\nbackends: [{id: e0, url: 'http://127.0.0.1:1'}]\ntenants: [{name: a, max_concurrency: -1}]\n"))
	if err == nil || !strings.Contains(err.Error(), "tenants[0].max_concurrency") {
		t.Fatalf("%v", err)
	}
}

// A reload that lifts a tenant's cap and one that restores it keep counting
// the requests admitted under the cap (found by the sixth session's review:
// the cap was exceeded).
func TestReloadLiftingAndRestoringACapKeepsTheCount(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 4, 1, 3*time.Second })
	p := startProxyYAML(t, concurrencyYAML, e)
	stream := `{"model":"m","prompt":"x","stream":true}`
	sendAuth(t, p, "HTTP/1.1", "/v1/completions", "key-capped-123", stream)
	sendAuth(t, p, "HTTP/1.1", "/v1/completions", "key-capped-123", stream)
	waitInflight(t, p, 2)
	reload := func(y string) {
		cfg, err := config.Parse([]byte(strings.ReplaceAll(y, "{{e0}}", e.addr)))
		if err != nil {
			t.Fatal(err)
		}
		if err := p.s.Reload(cfg); err != nil {
			t.Fatal(err)
		}
	}
	reload(strings.Replace(concurrencyYAML, "max_concurrency: 2", "max_concurrency: 0", 1))
	reload(concurrencyYAML)
	sendAuth(t, p, "HTTP/1.1", "/v1/completions", "key-capped-123", stream)
	sendAuth(t, p, "HTTP/1.1", "/v1/completions", "key-capped-123", stream)
	time.Sleep(300 * time.Millisecond)
	if n := e.current.Load(); n > 2 {
		t.Fatalf("capped tenant (max_concurrency: 2) has %d requests at the engine; counter says %d", n, cappedInflight(p))
	}
}
