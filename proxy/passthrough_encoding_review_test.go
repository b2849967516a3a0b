package proxy

import (
	"compress/gzip"
	"net/http"
	"testing"
)

// TestPassthroughKeepsContentEncoding: a pass-through answer is relayed
// byte for byte, so the engine's Content-Encoding must go with it: a
// gzipped answer without it reaches the client as binary noise.
func TestPassthroughKeepsContentEncoding(t *testing.T) {
	const answer = `{"object":"list","data":[{"embedding":[0.5]}]}`
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzip.NewWriter(w)
		zw.Write([]byte(answer))
		zw.Close()
	})
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m}]\n")
	// Go's client asks for gzip and decodes it when the answer says so.
	resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"x"}`)
	if resp.StatusCode != 200 || string(b) != answer {
		t.Fatalf("gzipped answer: %d %q (Content-Encoding %q)", resp.StatusCode, b, resp.Header.Get("Content-Encoding"))
	}
	p.waitIdle(t)
}
