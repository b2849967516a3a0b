package proxy

import (
	"crypto/tls"
	"encoding/json"
	"net"
	"strings"
	"testing"
	"time"
)

// A handler that panics answers its request with an OpenAI 500, logs the
// stack and gives back everything the request held: its tenant's slot, the
// backend's max_concurrency slot, its router load and its place in the
// drain. The process goes on serving (fasthttp recovers no handler's panic:
// before, one such request ended kvproxy and every stream in it).
func TestHandlerPanicIsA500AndFreesEverything(t *testing.T) {
	addr := startTLSEngine(t)
	s, logs := newTestServer(t, `
models: [{name: m, tokenizer: cl100k_base, template: chatml}]
backends: [{id: e0, url: 'https://`+addr+`', model: m, insecure_skip_verify: true, max_concurrency: 1}]
limits: {queue_timeout: 300ms}
auth:
  keys: [{key: key-alpha-123, tenant: alpha}]
tenants: [{name: alpha, max_concurrency: 1}]
`, true)
	// The fault: the engine's TLS handshake, run on the handler's
	// goroutine once the request holds every slot, panics.
	up := s.st.Load().backends["e0"].up
	up.TLS = up.TLS.Clone()
	up.TLS.VerifyConnection = func(tls.ConnectionState) error { panic("injected fault") }
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(ln)
	t.Cleanup(func() {
		// A leaked exchange would hold the drain for ever.
		done := make(chan struct{})
		go func() { s.Shutdown(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("Shutdown still waits for the abandoned exchanges")
		}
	})
	p := &testProxy{s: s, url: "http://" + ln.Addr().String(), logs: logs}

	// One of each kind, in turn: each would find the tenant's single slot
	// (429) or the backend's (503 after the queue timeout) still taken if
	// the one before had kept it.
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`},
		{"/v1/embeddings", `{"model":"m","input":"a cat"}`},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`},
	} {
		resp, body := postAuth(t, p.url+c.path, "key-alpha-123", c.body)
		var e struct {
			Error struct{ Message, Type, Code string }
		}
		if resp.StatusCode != 500 || json.Unmarshal([]byte(body), &e) != nil || e.Error.Type != "server_error" || e.Error.Code != "internal_error" {
			t.Fatalf("%s: want an OpenAI 500 internal_error, got %d %s", c.path, resp.StatusCode, body)
		}
		if rid := resp.Header.Get("X-Request-Id"); rid == "" || !strings.Contains(e.Error.Message, rid) {
			t.Fatalf("the answer should carry the request id the log has: %q, %q", rid, e.Error.Message)
		}
		p.waitIdle(t)
		if n := s.InFlight(); n != 0 {
			t.Fatalf("%s: %d exchanges left in the drain's count", c.path, n)
		}
	}
	if n := s.st.Load().auth.tenants["alpha"].inflight.Load(); n != 0 {
		t.Fatalf("the tenant's slot count is %d, want 0", n)
	}
	if got := strings.Count(logs.String(), `"message":"request handler panicked"`); got != 4 || !strings.Contains(logs.String(), "injected fault") {
		t.Fatalf("want 4 logged panics with their value, got %d:\n%s", got, logs.String())
	}
	if m := p.metrics(t); !strings.Contains(m, "kvproxy_handler_panics_total 4") {
		t.Fatalf("panics not counted:\n%s", grepLines(m, "panics"))
	}
}
