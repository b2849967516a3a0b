package proxy

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Whole JSON answers to streaming requests and limits.body_memory_mb, from
// the review of their charging.

func gzipped(s string) string {
	var z bytes.Buffer
	w := gzip.NewWriter(&z)
	w.Write([]byte(s))
	w.Close()
	return z.String()
}

func wholeChatOf(content string) string {
	return `{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"` + content + `"},"finish_reason":"stop"}]}`
}

// nothingCharged waits until the proxy is idle and nothing stays charged.
func nothingCharged(t *testing.T, p *testProxy) {
	t.Helper()
	p.waitIdle(t)
	for deadline := time.Now().Add(3 * time.Second); p.s.bodyMem.Used() != 0; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes still charged after the request", p.s.bodyMem.Used())
		}
	}
}

const streamChat = `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`

// A compressed whole answer larger than the budget once decoded, and one
// that fits only without what the request's own body holds, are 502s that
// say kvproxy's budget is the cause (not 503s to retry, nor the engine's
// fault); a client that hangs up half way through a large one leaves
// nothing charged.
func TestWholeAnswerToStreamBudget(t *testing.T) {
	t.Run("beyond once decoded", func(t *testing.T) {
		e := jsonEngine(t, "application/json", "gzip", gzipped(wholeChatOf(strings.Repeat("word ", 4<<20))))
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {body_memory_mb: 8}\n", e)
		resp, b := post(t, p.url+"/v1/chat/completions", streamChat)
		if resp.StatusCode != 502 || !strings.Contains(string(b), "larger than kvproxy holds at once") {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		nothingCharged(t, p)
	})
	t.Run("beyond with the request's body", func(t *testing.T) {
		e := jsonEngine(t, "application/json", "", wholeChatOf(strings.Repeat("word ", 1<<20)))
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {body_memory_mb: 12, max_request_body_bytes: 67108864}\n", e)
		body := `{"model":"m","stream":true,"user":"` + strings.Repeat("u", 6<<20) + `","messages":[{"role":"user","content":"hi"}]}`
		resp, b := post(t, p.url+"/v1/chat/completions", body)
		if resp.StatusCode != 502 || !strings.Contains(string(b), "larger than kvproxy holds at once") {
			t.Fatalf("%d %.300s", resp.StatusCode, b)
		}
		nothingCharged(t, p)
	})
	t.Run("client hangs up half way", func(t *testing.T) {
		e := jsonEngine(t, "application/json", "gzip", gzipped(wholeChatOf(strings.Repeat("word ", 4<<20))))
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {body_memory_mb: 256}\n", e)
		for range 2 {
			c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(streamChat), streamChat)
			rd := bufio.NewReader(c)
			if line, err := rd.ReadString('\n'); err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
				t.Fatalf("%q %v", line, err)
			}
			io.CopyN(io.Discard, rd, 8<<20)
			c.Close()
			nothingCharged(t, p)
		}
	})
}

// A continuation whose whole answer kvproxy has no room for ends the move:
// the next engine would do the work again and meet the same refusal.
func TestMigrationStopsAtBudgetRefusal(t *testing.T) {
	dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 3 })
	var asked atomic.Int64
	big := wholeChatOf(strings.Repeat("word ", 2<<20)) // 10 MiB
	whole := func() *fakeEngine {
		return &fakeEngine{addr: startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
			if strings.HasSuffix(r.URL.Path, "completions") {
				asked.Add(1)
				w.Header().Set("Content-Type", "application/json")
				io.WriteString(w, big)
			}
		})}
	}
	p := startProxyYAML(t, `models: [{name: m}]
backends:
  - {id: dies, url: 'http://{{e0}}', model: m, served_model: engine-m}
  - {id: b1, url: 'http://{{e1}}', model: m, served_model: engine-m, kind: vllm}
  - {id: b2, url: 'http://{{e2}}', model: m, served_model: engine-m, kind: vllm}
router: {policy: round_robin}
limits:
  migration_limit: 2
  body_memory_mb: 4
`, dies, whole(), whole())
	resp, body := post(t, p.url+"/v1/chat/completions", migrateBody)
	if resp.StatusCode != 200 || !strings.Contains(string(body), "error") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	nothingCharged(t, p)
	if n := asked.Load(); n != 1 {
		t.Fatalf("the continuation was sent to %d engines", n)
	}
}
