package proxy

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// An engine may end SSE lines with \r alone (the SSE grammar allows it):
// its last event's final \r ends the stream, and the stream is complete,
// not an engine failure (found by the seventh session's trial: kvproxy
// appended a mid-stream error and ejected the engine).
func TestStreamFramedWithCarriageReturnsOnly(t *testing.T) {
	engine := func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, tok := range []string{"a", "b"} {
			io.WriteString(w, `data: {"choices":[{"index":0,"text":"`+tok+`"}]}`+"\r\r")
			w.(http.Flusher).Flush()
		}
		io.WriteString(w, "data: [DONE]\r\r")
	}
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: e0, url: 'http://"+startRawEngine(t, engine)+"', model: m}]\n")
	for range 2 {
		resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
		body := string(b)
		if resp.StatusCode != 200 || strings.Contains(body, "error") || !strings.Contains(body, "data: [DONE]\r\r") || strings.Count(body, `"text"`) != 2 {
			t.Fatalf("%d %q", resp.StatusCode, body)
		}
	}
	if ejected(p, "e0") || strings.Contains(p.logs.String(), "failed mid-stream") {
		t.Fatalf("a complete stream counted as a failure:\n%s", p.logs.String())
	}
	p.waitIdle(t)
}
