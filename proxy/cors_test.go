package proxy

import (
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// A browser page on another origin can call kvproxy as it calls vLLM or
// OpenAI's API: the preflight is answered without a key, and answers
// (errors and streams too) carry Access-Control-Allow-Origin. An origin
// left out of cors.allowed_origins gets no CORS headers, and an empty list
// turns CORS off (found by the eighth session's trial: OPTIONS got 405).
func TestCORS(t *testing.T) {
	e := startFake(t, "e0", nil)
	do := func(p *testProxy, method, path, origin, key, body string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(method, p.url+path, strings.NewReader(body))
		if origin != "" {
			req.Header.Set("Origin", origin)
		}
		if method == "OPTIONS" {
			req.Header.Set("Access-Control-Request-Method", "POST")
			req.Header.Set("Access-Control-Request-Headers", "authorization, content-type, x-stainless-os")
		}
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	keys := "\nauth: {keys: [{key: key-web-12345, tenant: web}]}\ntenants: [{name: web}]\n"
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`

	p := startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]"+keys, e)
	pre := do(p, "OPTIONS", "/v1/chat/completions", "https://app.example.com", "", "")
	if pre.StatusCode != 204 || pre.Header.Get("Access-Control-Allow-Origin") != "*" ||
		!strings.Contains(pre.Header.Get("Access-Control-Allow-Methods"), "POST") ||
		pre.Header.Get("Access-Control-Allow-Headers") != "authorization, content-type, x-stainless-os" {
		t.Fatalf("preflight: %d %v", pre.StatusCode, pre.Header)
	}
	for _, c := range []struct {
		key    string
		status int
	}{{"key-web-12345", 200}, {"", 401}} {
		resp := do(p, "POST", "/v1/chat/completions", "https://app.example.com", c.key, chat)
		if resp.StatusCode != c.status || resp.Header.Get("Access-Control-Allow-Origin") != "*" ||
			!strings.Contains(resp.Header.Get("Access-Control-Expose-Headers"), "X-Request-Id") ||
			!strings.Contains(resp.Header.Get("Access-Control-Expose-Headers"), "X-Kvproxy-Overloaded") ||
			// The SDKs read it to know not to retry (kvproxy's 504 for a
			// silent engine): a page's could not (the SDK trial).
			!strings.Contains(resp.Header.Get("Access-Control-Expose-Headers"), "X-Should-Retry") {
			t.Fatalf("key %q: %d %v", c.key, resp.StatusCode, resp.Header)
		}
	}
	// Anthropic's SDK reads the id from Request-Id, which a page can read
	// too; a preflight of /v1/messages has no id to give (it said
	// "Request-Id: ": the twenty-ninth session's SDK trial).
	if resp := do(p, "POST", "/v1/messages", "https://app.example.com", "key-web-12345", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`); resp.Header.Get("Request-Id") == "" ||
		!slices.Contains(strings.Split(resp.Header.Get("Access-Control-Expose-Headers"), ", "), "Request-Id") {
		t.Fatalf("messages: %d %v", resp.StatusCode, resp.Header)
	}
	if pre := do(p, "OPTIONS", "/v1/messages", "https://app.example.com", "", ""); pre.StatusCode != 204 || len(pre.Header.Values("Request-Id")) != 0 {
		t.Fatalf("messages preflight: %d %v", pre.StatusCode, pre.Header)
	}
	if resp := do(p, "POST", "/v1/chat/completions", "", "key-web-12345", chat); resp.Header.Get("Access-Control-Allow-Origin") != "" {
		t.Fatalf("no Origin, yet CORS headers: %v", resp.Header)
	}
	// The operator's endpoints are not for web pages, even open ones.
	open := startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	for _, path := range []string{"/admin/backends", "/metrics", "/health"} {
		want := 200
		if path == "/admin/backends" {
			want = 403 // TestOperatorEndpointsRefuseBrowsers
		}
		if resp := do(open, "GET", path, "https://evil.example.com", "", ""); resp.StatusCode != want || resp.Header.Get("Access-Control-Allow-Origin") != "" {
			t.Fatalf("GET %s from a page: %d %v", path, resp.StatusCode, resp.Header)
		}
		if resp := do(open, "OPTIONS", path, "https://evil.example.com", "", ""); resp.Header.Get("Access-Control-Allow-Origin") != "" {
			t.Fatalf("preflight of %s: %d %v", path, resp.StatusCode, resp.Header)
		}
	}

	p = startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]"+keys+
		"cors: {allowed_origins: ['https://app.example.com']}\n", e)
	if resp := do(p, "POST", "/v1/chat/completions", "https://app.example.com", "key-web-12345", chat); resp.Header.Get("Access-Control-Allow-Origin") != "https://app.example.com" ||
		resp.Header.Get("Vary") != "Origin" {
		t.Fatalf("a listed origin: %v", resp.Header)
	}
	if resp := do(p, "OPTIONS", "/v1/chat/completions", "https://evil.example.net", "", ""); resp.Header.Get("Access-Control-Allow-Origin") != "" || resp.StatusCode != 400 {
		t.Fatalf("a preflight from an origin not listed: %d %v, want a 400 saying so", resp.StatusCode, resp.Header)
	}
	// With a list, every answer varies by Origin, for shared caches.
	if resp := do(p, "GET", "/v1/models", "", "", ""); resp.Header.Get("Vary") != "Origin" {
		t.Fatalf("an answer without Origin: %v", resp.Header)
	}

	p = startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]"+keys+
		"cors: {allowed_origins: []}\n", e)
	if resp := do(p, "OPTIONS", "/v1/chat/completions", "https://app.example.com", "", ""); resp.Header.Get("Access-Control-Allow-Origin") != "" || resp.StatusCode == 204 {
		t.Fatalf("CORS off: %d %v", resp.StatusCode, resp.Header)
	}
	p.waitIdle(t)
}

// A web page may delete a stored response (DELETE /v1/responses/{id}): the
// preflight must allow the method, or the browser never sends it (found by
// the newcomer trial, with the OpenAI SDK's responses.delete).
func TestCORSPreflightAllowsDelete(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	req, _ := http.NewRequest("OPTIONS", p.url+"/v1/responses/resp_abc", nil)
	req.Header.Set("Origin", "https://app.example.com")
	req.Header.Set("Access-Control-Request-Method", "DELETE")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	methods := strings.Split(resp.Header.Get("Access-Control-Allow-Methods"), ", ")
	if resp.StatusCode != 204 || !slices.Contains(methods, "DELETE") || !slices.Contains(methods, "POST") {
		t.Fatalf("preflight of a DELETE: %d, methods %q", resp.StatusCode, methods)
	}
}

// A web page may not drive the operator's endpoints through its visitors'
// browsers: with no keys configured, a form's POST (no preflight) reloaded
// the config and fed the KV index (the security review). Any request there
// with an Origin header is refused; the same request without one is served.
func TestOperatorEndpointsRefuseBrowsers(t *testing.T) {
	p := startProxy(t, "kv", startFake(t, "e0", nil))
	for _, path := range []string{"/admin/reload", "/v1/kv_events", "/admin/index/lookup"} {
		req, _ := http.NewRequest("POST", p.url+path, strings.NewReader(`{"engine_id":"e0","events":[{"type":"all_blocks_cleared"}]}`))
		req.Header.Set("Content-Type", "text/plain")
		req.Header.Set("Origin", "https://evil.example")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 403 || !strings.Contains(string(b), `"code":"browser_request_refused"`) {
			t.Fatalf("POST %s from a web page: %d %s", path, resp.StatusCode, b)
		}
	}
	if resp, b := post(t, p.url+"/admin/reload", ``); resp.StatusCode == 403 {
		t.Fatalf("a reload without an Origin header: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}
