package proxy

import (
	"net/http"
	"strings"
	"testing"
)

// A tenant limited to some models (tenants[].models) may use them, by
// name, alias or adapter, on every path; the other models do not exist
// for it: 404 model_not_found in the words an unknown model gets, left out
// of /v1/models, and not sent to any engine. A tenant without the setting
// uses every model.
func TestTenantModels(t *testing.T) {
	e := startFake(t, "e0", nil)
	e1 := startFake(t, "e1", nil)
	p := startProxyYAML(t, `
models:
  - {name: small, aliases: [s], adapters: [sql-lora], block_size: 16}
  - {name: big, block_size: 16}
backends:
  - {id: e0, url: 'http://{{e0}}', model: small}
  - {id: e1, url: 'http://{{e1}}', model: big}
auth:
  keys:
    - {key: key-limited-1, tenant: limited}
    - {key: key-open-12345, tenant: open}
tenants:
  - {name: limited, models: [s]}
`, e, e1)
	get := func(key, path string) (int, string) {
		req, _ := http.NewRequest("GET", p.url+path, nil)
		return doAuth(t, req, key)
	}
	chat := func(model string) string {
		return `{"model":"` + model + `","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`
	}
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", chat("small")},
		{"/v1/chat/completions", chat("s")},
		{"/v1/chat/completions", chat("sql-lora")},
		{"/v1/completions", `{"model":"small","prompt":"hi"}`},
		{"/v1/embeddings", `{"model":"small","input":"hi"}`},
	} {
		if resp, b := postAuth(t, p.url+c.path, "key-limited-1", c.body); resp.StatusCode != 200 {
			t.Fatalf("limited tenant, allowed model: %s %s: %d %s", c.path, c.body, resp.StatusCode, b)
		}
	}
	unknown := func(model string) string {
		_, b := postAuth(t, p.url+"/v1/chat/completions", "key-open-12345", chat(model))
		return b
	}
	sent := func() int { e1.mu.Lock(); defer e1.mu.Unlock(); return len(e1.paths) }
	sentBefore := sent()
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", chat("big")},
		{"/v1/chat/completions", `{"model":"big","messages":[{"role":"user","content":"hi"}],"nvext":{"annotations":["query_instance_id"]}}`},
		{"/v1/completions", `{"model":"big","prompt":"hi"}`},
		{"/v1/embeddings", `{"model":"big","input":"hi"}`},
		{"/v1/messages", `{"model":"big","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`},
	} {
		resp, b := postAuth(t, p.url+c.path, "key-limited-1", c.body)
		if resp.StatusCode != 404 || !strings.Contains(b, `the model \"big\" does not exist`) || !strings.Contains(b, "not_found") {
			t.Fatalf("limited tenant, other model: %s %s: %d %s", c.path, c.body, resp.StatusCode, b)
		}
		if c.path == "/v1/chat/completions" && b != strings.Replace(unknown("nope"), "nope", "big", 1) {
			t.Fatalf("not the words of an unknown model: %s", b)
		}
	}
	if n := sent(); n != sentBefore {
		t.Fatalf("the other model's engine got %d requests", n-sentBefore)
	}
	if code, b := get("key-limited-1", "/v1/models"); code != 200 || strings.Contains(b, `"big"`) || !strings.Contains(b, `"small"`) ||
		!strings.Contains(b, `"s"`) || !strings.Contains(b, `"sql-lora"`) {
		t.Fatalf("limited tenant's /v1/models: %d %s", code, b)
	}
	if code, _ := get("key-limited-1", "/v1/models/big"); code != 404 {
		t.Fatalf("limited tenant's /v1/models/big: %d", code)
	}
	if code, _ := get("key-limited-1", "/v1/models/s"); code != 200 {
		t.Fatalf("limited tenant's /v1/models/s: %d", code)
	}
	if code, b := get("key-open-12345", "/v1/models"); code != 200 || !strings.Contains(b, `"big"`) || !strings.Contains(b, `"small"`) {
		t.Fatalf("open tenant's /v1/models: %d %s", code, b)
	}
	if resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-open-12345", chat("big")); resp.StatusCode != 200 {
		t.Fatalf("open tenant: %d %s", resp.StatusCode, b)
	}
	// Leaving the model out means the one model the tenant may use; with
	// several, the request must name one.
	if resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-limited-1", `{"messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 ||
		resp.Header.Get(WorkerHeader) != "e0" {
		t.Fatalf("limited tenant, no model: %d %s", resp.StatusCode, b)
	}
	if resp, b := postAuth(t, p.url+"/v1/embeddings", "key-open-12345", `{"input":"hi"}`); resp.StatusCode != 400 || !strings.Contains(b, "you must provide a model parameter") {
		t.Fatalf("open tenant, no model: %d %s", resp.StatusCode, b)
	}
	// A stored response of a model the tenant may not use is none of its.
	id := string(appendTaggedID(nil, testTag(p, "e1", "limited", "resp_1"), []byte("resp_1")))
	sentBefore = sent()
	for _, method := range []string{"GET", "DELETE"} {
		req, _ := http.NewRequest(method, p.url+"/v1/responses/"+id, nil)
		if code, b := doAuth(t, req, "key-limited-1"); code != 404 || !strings.Contains(b, "response_not_found") {
			t.Fatalf("%s of a response of the other model: %d %s", method, code, b)
		}
	}
	if n := sent(); n != sentBefore {
		t.Fatalf("the other model's engine got %d requests about its responses", n-sentBefore)
	}
	p.waitIdle(t)
	if logs := p.logs.String(); !strings.Contains(logs, "model not allowed for the tenant (tenants[].models)") {
		t.Fatalf("the log does not say why:\n%s", logs)
	}
}
