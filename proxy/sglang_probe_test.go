package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// A current SGLang engine's /health answers after a second (it runs a
// one-token generation and looks once a second whether its engine produced
// anything): with the default health.timeout of 1 s every SGLang engine was
// down for good and every request got 503 (the quirks trial). Its probe now
// waits for it; the same answer from an engine of another kind is still too
// slow, so the test would see a probe that waits for nothing.
func TestSGLangHealthTakesASecond(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			time.Sleep(1050 * time.Millisecond)
			return
		}
		if r.Method != http.MethodPost {
			http.NotFound(w, r)
			return
		}
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	}))
	t.Cleanup(engine.Close)
	for _, kind := range []string{"sglang", "vllm"} {
		t.Run(kind, func(t *testing.T) {
			p := serveYAML(t, "models: [{name: m}]\nhealth: {interval: 100ms}\nbackends: [{id: e0, url: '"+engine.URL+"', model: m, kind: "+kind+"}]\n", false)
			b0 := p.s.st.Load().backends["e0"]
			time.Sleep(2500 * time.Millisecond) // two probes answered, or timed out
			resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
			switch kind {
			case "sglang":
				if resp.StatusCode != 200 || !strings.Contains(string(b), `"content":"hi"`) || !b0.isAvailable() {
					t.Fatalf("a healthy SGLang engine: %d %s\n%s", resp.StatusCode, b, p.logs.String())
				}
			default:
				if resp.StatusCode != 503 || b0.isAvailable() {
					t.Fatalf("an engine whose /health takes longer than health.timeout: %d %s", resp.StatusCode, b)
				}
			}
			p.waitIdle(t)
		})
	}
}
