package proxy

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// A client that hangs up while kvproxy reads an engine's error answer to a
// streamed request (the status is in, the body slow) is a 499; the engine
// is not ejected as if its connection had failed (found by the eighth
// session's review).
func TestHangUpDuringAnErrorAnswerIsNotTheEngines(t *testing.T) {
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return // the probe and the scrape
		}
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(400)
		w.Write([]byte(`{"error":{"message":"bad`))
		w.(http.Flusher).Flush()
		time.Sleep(1500 * time.Millisecond)
		w.Write([]byte(` request"}}`))
	})
	p := startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://"+addr+"', model: m}]\n")
	c := rawCompletion(t, p, `{"model":"m","prompt":"x","stream":true}`)
	time.Sleep(300 * time.Millisecond)
	c.Close()
	p.waitIdle(t)
	// The slots are freed before the access line is written.
	waitFor(t, "the access line", func() bool { return strings.Contains(p.logs.String(), `"message":"request"`) })
	logs := p.logs.String()
	if strings.Contains(logs, "backend ejected") || !strings.Contains(logs, `"status":499`) {
		t.Fatalf("a client hanging up on an engine's error answer:\n%s", logs)
	}
	if b := p.s.st.Load().backends["e0"]; !b.isAvailable() {
		t.Fatal("the engine was taken out of routing")
	}
}
