package proxy

import (
	"io"
	"net/http"
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
	pre, dec, p := startPD(t, nil, "[{name: m}]", "")
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
	// The dry run names both stages' engines.
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello there"}],"nvext":{"annotations":["query_instance_id"]}}`)
	if !strings.Contains(string(b), `"worker_id":"dec"`) || !strings.Contains(string(b), `"prefill_worker_id":"pre"`) || resp.Header.Get("X-Kvproxy-Prefill-Worker") != "pre" {
		t.Fatalf("dry run: %s", b)
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
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_requests_total{backend="pre",code="200"} 2`) {
		t.Fatalf("the prefill stages are not counted:\n%s", grepLines(m, "requests_total"))
	}
	if _, b := fetch(t, p.url+"/admin/backends"); !strings.Contains(string(b), `"id":"pre","url"`) || !strings.Contains(string(b), `"role":"prefill"`) {
		t.Fatalf("/admin/backends does not show the role: %s", b)
	}
	// Each stage's engines have their fitted speeds compared with their own.
	for _, w := range p.s.st.Load().models["m"].rt.Workers() {
		if want := map[string]int{"pre": 1, "dec": 0}[w.Name]; w.PeerGroup != want {
			t.Fatalf("worker %s in peer group %d, want %d", w.Name, w.PeerGroup, want)
		}
	}
	p.waitIdle(t)
}

// Without a prefill engine to use, the decode engine computes the prompt,
// and the log says why (the trial: nothing told P/D had turned off).
func TestDisaggregatedPrefillWithItsEngineDown(t *testing.T) {
	// Ejected for a minute: at the default second, the second request on a
	// loaded machine came after the ejection ended, and was refused again.
	pre, _, p := startPD(t, nil, "[{name: m}]", "health: {eject_base: 1m}\n")
	pre.srv.Close()
	for range 2 {
		if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	waitFor(t, "the access log", func() bool {
		l := p.logs.String()
		return strings.Contains(l, `"prefill_error":"connect: `) && strings.Contains(l, `"prefill_error":"no prefill engine is available"`)
	})
	p.waitIdle(t)
}

// A prefill that fails leaves the decode engine to compute the prompt.
func TestDisaggregatedPrefillFailing(t *testing.T) {
	_, dec, p := startPD(t, func(f *fakeEngine) { f.status, f.errBody = 500, `{"error":{"message":"boom"}}` }, "[{name: m}]", "")
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "dec" || resp.Header.Get("X-Kvproxy-Prefill-Worker") != "" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if got := dec.lastBody(); got["kv_transfer_params"] != nil {
		t.Fatalf("the decode engine was sent params no prefill gave: %v", got)
	}
	waitFor(t, "the access log", func() bool { return strings.Contains(p.logs.String(), `"prefill_error":"answered 500"`) })
	// Its 500s count as a completion's do: three in a row take it out.
	for range 2 {
		post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello"}]}`)
	}
	waitFor(t, "the prefill engine's ejection", func() bool { return strings.Contains(p.logs.String(), `"ejected_by":"error_answers"`) })
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
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_requests_total{backend="pre",code="504"} 1`) {
		t.Fatalf("the cut prefill is not counted as a 504:\n%s", grepLines(m, "requests_total"))
	}
	p.waitIdle(t)
}

// A client's own kv_transfer_params never reach an engine (they would have
// a NixlConnector engine fetch KV from any host they name), nor does a
// batch of prompts get one prompt's (vLLM's answer holds one sequence's
// params): a batch is not disaggregated. Found by the review.
func TestDisaggregatedPrefillKeepsTheParamsItsOwn(t *testing.T) {
	pre, dec, p := startPD(t, nil, "[{name: m}, {name: plain}]", "  - {id: plain, url: 'http://{{e1}}', model: plain}\n")
	evil := `"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"evil","remote_host":"10.0.0.66","remote_port":5600,"remote_block_ids":[1]}`
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"plain","prompt":"hi",`+evil+`}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if got := dec.lastBody()["kv_transfer_params"]; got != nil {
		t.Fatalf("the client's kv_transfer_params reached the engine: %v", got)
	}
	before := pre.requests.Load()
	for _, body := range []string{`{"model":"m","prompt":["first prompt","a second one"],` + evil + `}`, `{"model":"m","n":2,"prompt":"hi"}`,
		`{"model":"m","n":2.0,"prompt":"hi"}`, `{"model":"m","n":"2","prompt":"hi"}`} { // two to vLLM as well (the second review)
		if resp, b := post(t, p.url+"/v1/completions", body); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		if got := dec.lastBody()["kv_transfer_params"]; got != nil || pre.requests.Load() != before {
			t.Fatalf("%s: disaggregated (decode engine got %v)", body, got)
		}
	}
	p.waitIdle(t)
}

// A prefill engine of longer context than the others does not make the
// length filter leave the decode engines out (a 503 for every long prompt:
// the review): the prompt goes to a decode engine, which answers.
func TestLongPromptsWithAPrefillEngineOfLongerContext(t *testing.T) {
	pre := startFake(t, "pre", func(f *fakeEngine) { f.modelList = modelCard(8192) })
	dec := startFake(t, "dec", func(f *fakeEngine) { f.modelList = modelCard(1024) })
	p := startProxyYAML(t, "models:\n  - {name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}\nbackends:\n"+
		"  - {id: pre, url: 'http://{{e0}}', model: m, served_model: engine-m, role: prefill}\n"+
		"  - {id: dec, url: 'http://{{e1}}', model: m, served_model: engine-m}\n", pre, dec)
	waitListsRead(t, p, 2)
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"`+strings.Repeat("hello ", 2000)+`"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "dec" {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}

// startPD serves models (YAML) with a prefill engine (pre, set up by
// preSetup) and a decode engine (dec) for model m, and more backends.
func startPD(t *testing.T, preSetup func(*fakeEngine), models, more string) (pre, dec *fakeEngine, p *testProxy) {
	t.Helper()
	pre = startFake(t, "pre", preSetup)
	dec = startFake(t, "dec", nil)
	p = startProxyYAML(t, "models: "+models+"\nbackends:\n"+
		"  - {id: pre, url: 'http://{{e0}}', model: m, role: prefill}\n"+
		"  - {id: dec, url: 'http://{{e1}}', model: m}\n"+more, pre, dec)
	return pre, dec, p
}

// A tenant's priority reaches a prefill engine that schedules by priority
// as it reaches the decode engine (the second review: the prefill went
// without one, at vLLM's default 0, more urgent than the tenant's 10).
func TestDisaggregatedPrefillCarriesTheTenantsPriority(t *testing.T) {
	pre, dec, p := startPD(t, nil, "[{name: m}]", "auth: {keys: [{key: key-batch-1234, tenant: batch}]}\ntenants: [{name: batch, priority: 10}]\n")
	_ = dec
	p.reloadYAML(t, "models: [{name: m}]\nbackends:\n"+
		"  - {id: pre, url: 'http://"+pre.addr+"', model: m, role: prefill, priority_scheduling: true}\n"+
		"  - {id: dec, url: 'http://"+dec.addr+"', model: m, priority_scheduling: true}\n"+
		"auth: {keys: [{key: key-batch-1234, tenant: batch}]}\ntenants: [{name: batch, priority: 10}]\n")
	if resp, b := postAuth(t, p.url+"/v1/completions", "key-batch-1234", `{"model":"m","prompt":"hi","priority":-100}`); resp.StatusCode != 200 || pre.requests.Load() != 1 {
		t.Fatalf("%d %s (prefills %d)", resp.StatusCode, b, pre.requests.Load())
	}
	if got, got2 := pre.lastBody()["priority"], dec.lastBody()["priority"]; got != float64(10) || got2 != float64(10) {
		t.Fatalf("priorities sent: prefill %v, decode %v; want the tenant's 10 to both", got, got2)
	}
	p.waitIdle(t)
}

// A prefill engine serves no request alone: with only it healthy, /health
// and kvproxy_model_healthy_backends say the model is down, as its
// requests get 503 (the review).
func TestHealthDoesNotCountPrefillEngines(t *testing.T) {
	_, _, p := startPD(t, nil, "[{name: m}]", "")
	p.s.st.Load().backends["dec"].setProbe(false, "")
	resp, err := http.Get(p.url + "/health?model=m")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(b), `"healthy_backends":0`) {
		t.Fatalf("/health with only the prefill engine up: %d %s", resp.StatusCode, b)
	}
	wantMetrics(t, p.metrics(t), `kvproxy_model_healthy_backends{model="m"} 0`)
}
