package proxy

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// A request queued for a full backend that then goes down is told at once
// that the model has no healthy backend (503 no_backend_available), as a
// new request is; it waited out queue_timeout and got queue_timeout, an
// outage answered and counted as saturation (the operator trial).
func TestQueuedRequestLearnsOfTheOutage(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]
limits: {queue_timeout: 10s}
`, e)
	held := holdSlot(t, p, e, chatBody, "")
	type answer struct {
		code int
		body string
		took time.Duration
	}
	queued := make(chan answer, 1)
	go func() {
		start := time.Now()
		resp, err := http.Post(p.url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
		if err != nil {
			queued <- answer{body: err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		queued <- answer{resp.StatusCode, string(b), time.Since(start)}
	}()
	b := p.s.st.Load().backends["e0"]
	waitFor(t, "the second request queued", func() bool { return b.pool.waiting.Load() == 1 })
	b.setProbe(false, "connection refused") // as the prober does when the engine dies
	a := <-queued
	if a.code != 503 || !strings.Contains(a.body, `"code":"no_backend_available"`) || a.took > 5*time.Second {
		t.Fatalf("the queued request, its backend down: %d after %v: %s", a.code, a.took, a.body)
	}
	<-held
	p.waitIdle(t)
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_unavailable_total{reason="no_healthy_backend"} 1`) || !strings.Contains(m, `kvproxy_unavailable_total{reason="queue_timeout"} 0`) {
		t.Fatalf("metrics:\n%s", grepLines(m, "kvproxy_unavailable_total"))
	}
}
