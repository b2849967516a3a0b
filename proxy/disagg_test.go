package proxy

import (
	"strings"
	"testing"
	"time"
)

// A model with a prefill engine (role: prefill) computes each chat or
// completion prompt there first, as vLLM's NixlConnector expects: one
// token, not streamed, kv_transfer_params asking for the KV to be kept;
// the request then goes to a decode engine with the params the prefill
// answered, and its answer, streamed or not, is the client's. Prefill
// engines get nothing else.
func TestDisaggregatedPrefill(t *testing.T) {
	pre := startFake(t, "pre", nil)
	dec := startFake(t, "dec", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends:\n"+
		"  - {id: pre, url: 'http://{{e0}}', model: m, role: prefill}\n"+
		"  - {id: dec, url: 'http://{{e1}}', model: m}\n", pre, dec)
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":50,"messages":[{"role":"user","content":"hello there"}]}`},
		{"/v1/completions", `{"model":"m","max_tokens":50,"prompt":"hello there","kv_transfer_params":{"do_remote_prefill":true}}`},
	} {
		resp, body := post(t, p.url+c.path, c.body)
		if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "dec" || resp.Header.Get("X-Kvproxy-Prefill-Worker") != "pre" {
			t.Fatalf("%s: %d %s (worker %q, prefill %q)", c.path, resp.StatusCode, body, resp.Header.Get(WorkerHeader), resp.Header.Get("X-Kvproxy-Prefill-Worker"))
		}
		if strings.Contains(string(body), "kv_transfer_params") {
			t.Fatalf("%s: the prefill's answer reached the client: %s", c.path, body)
		}
		first, second := pre.lastBody(), dec.lastBody()
		kvp, _ := first["kv_transfer_params"].(map[string]any)
		if first["stream"] != false || first["max_tokens"] != float64(1) || first["max_completion_tokens"] != nil || first["stream_options"] != nil ||
			kvp["do_remote_decode"] != true || kvp["do_remote_prefill"] != false {
			t.Fatalf("%s: the prefill engine got %v", c.path, first)
		}
		kvp, _ = second["kv_transfer_params"].(map[string]any)
		if kvp["do_remote_prefill"] != true || kvp["remote_engine_id"] != "pre" || second["max_tokens"] == float64(1) && second["max_completion_tokens"] == nil {
			t.Fatalf("%s: the decode engine got %v", c.path, second)
		}
		if pre.ids[len(pre.ids)-1] != dec.ids[len(dec.ids)-1] {
			t.Fatalf("%s: the two stages went with different request ids", c.path)
		}
	}
	// Other requests never go to the prefill engine.
	before := pre.requests.Load()
	for range 4 {
		if resp, body := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"x"}`); resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "dec" {
			t.Fatalf("embeddings: %d %s", resp.StatusCode, body)
		}
	}
	if pre.requests.Load() != before {
		t.Fatalf("the prefill engine got a request that is not a prefill: %v", pre.paths)
	}
	waitFor(t, "the access log", func() bool { return strings.Contains(p.logs.String(), `"prefill_backend":"pre"`) })
	p.waitIdle(t)
}

// A prefill that fails leaves the decode engine to compute the prompt.
func TestDisaggregatedPrefillFailing(t *testing.T) {
	pre := startFake(t, "pre", func(f *fakeEngine) { f.status, f.errBody = 500, `{"error":{"message":"boom"}}` })
	dec := startFake(t, "dec", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends:\n"+
		"  - {id: pre, url: 'http://{{e0}}', model: m, role: prefill}\n"+
		"  - {id: dec, url: 'http://{{e1}}', model: m}\n", pre, dec)
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "dec" || resp.Header.Get("X-Kvproxy-Prefill-Worker") != "" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if got := dec.lastBody(); got["kv_transfer_params"] != nil {
		t.Fatalf("the decode engine was sent params no prefill gave: %v", got)
	}
	waitFor(t, "the access log", func() bool { return strings.Contains(p.logs.String(), `"prefill_error":"answered 500"`) })
	p.waitIdle(t)
}

// A prefill engine that stops answering (frozen, its node lost) is cut off
// once its health probe fails, and the decode engine computes the prompt:
// the request waited for stream_idle_timeout.
func TestDisaggregatedPrefillOnAFrozenEngine(t *testing.T) {
	pre := startFake(t, "pre", func(f *fakeEngine) { f.prefillDelay = 30 * time.Second })
	dec := startFake(t, "dec", nil)
	yaml := strings.NewReplacer("{{pre}}", pre.addr, "{{dec}}", dec.addr).Replace("models: [{name: m}]\nbackends:\n" +
		"  - {id: pre, url: 'http://{{pre}}', model: m, role: prefill}\n" +
		"  - {id: dec, url: 'http://{{dec}}', model: m}\n" +
		"health: {interval: 200ms, timeout: 100ms, fall: 2}\nlimits: {stream_idle_timeout: 60s}\n")
	p := serveYAML(t, yaml, false)
	go func() {
		waitFor(t, "the prefill at its engine", func() bool { return pre.requests.Load() == 1 })
		pre.unhealthy.Store(true)
	}()
	start := time.Now()
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "dec" || time.Since(start) > 10*time.Second {
		t.Fatalf("after %v: %d %s", time.Since(start), resp.StatusCode, body)
	}
	if got := dec.lastBody(); got["kv_transfer_params"] != nil {
		t.Fatalf("the decode engine was sent params no prefill gave: %v", got)
	}
	waitFor(t, "the access log", func() bool { return strings.Contains(p.logs.String(), `"prefill_error":"backend pre sent nothing`) })
	p.waitIdle(t)
}
