package proxy

import (
	"encoding/json"
	"net"
	"net/http"
	"testing"
)

// startRawEngine serves h on a loopback socket: an engine answering as no
// fake engine does.
func startRawEngine(t *testing.T, h http.HandlerFunc) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// TestPassthroughNoContentAnswer: an engine answering 204 No Content (no
// body at all) to a request whose answer is read as a stream must not
// crash the proxy; the request gets an answer and the next one is served.
func TestPassthroughNoContentAnswer(t *testing.T) {
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Input string }
		json.NewDecoder(r.Body).Decode(&req)
		if req.Input == "none" || r.URL.Path == "/v1/chat/completions" {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"object":"list","data":[]}`))
	})
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m}]\n")
	if resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"none"}`); resp.StatusCode == 200 {
		t.Fatalf("a 204 passed for an answer: %d %q", resp.StatusCode, b)
	}
	p.waitIdle(t)
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode == 200 {
		t.Fatalf("a 204 to a stream passed for an answer: %d %q", resp.StatusCode, b)
	}
	p.waitIdle(t)
	if resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"x"}`); resp.StatusCode != 200 || string(b) != `{"object":"list","data":[]}` {
		t.Fatalf("the next request: %d %q", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// TestPassthroughNullModel: vLLM's tokenizing and pooling requests take
// "model": null (what a Python client sends for None) as no model: with one
// model configured it goes to that model, as a request without model does.
func TestPassthroughNullModel(t *testing.T) {
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Model *string }
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/json")
		if req.Model == nil || *req.Model != "engine-m" {
			w.WriteHeader(http.StatusBadRequest)
			w.Write([]byte(`{"error":{"message":"bad model"}}`))
			return
		}
		w.Write([]byte(`{"count":1,"tokens":[1]}`))
	})
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m, served_model: engine-m}]\n")
	for _, body := range []string{`{"prompt":"hi"}`, `{"model":null,"prompt":"hi"}`} {
		if resp, b := post(t, p.url+"/tokenize", body); resp.StatusCode != 200 || string(b) != `{"count":1,"tokens":[1]}` {
			t.Fatalf("%s: %d %s", body, resp.StatusCode, b)
		}
	}
	p.waitIdle(t)
}
