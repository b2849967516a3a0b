package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

// The time a request waits for a backend slot is measured: every routing
// is observed in kvproxy_queue_wait_seconds (0 without a wait), and the
// access log line of a request that waited says for how long ("queued").
func TestQueueWaitIsMeasured(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 600 * time.Millisecond })
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]
limits: {queue_timeout: 10s}
`, e)
	first := holdSlot(t, p, e, chatBody, "first")
	start := time.Now()
	second := make(chan int, 1)
	go func() {
		second <- postID(p.url+"/v1/chat/completions", chatBody, "second")
	}()
	waitFor(t, "the second request queued", func() bool { return p.s.st.Load().models["m"].waiting.Load() == 1 })
	if a, b := <-first, <-second; a != 200 || b != 200 {
		t.Fatalf("statuses %d and %d", a, b)
	}
	longest := time.Since(start)
	p.waitIdle(t)

	m := p.metrics(t)
	if !strings.Contains(m, `kvproxy_queue_wait_seconds_count{model="m"} 2`) || !strings.Contains(m, `kvproxy_queue_wait_seconds_bucket{model="m",le="0.001"} 1`) {
		t.Fatalf("two routings, one of them without a wait, expected:\n%s", grepLines(m, "queue_wait"))
	}
	sum := regexp.MustCompile(`kvproxy_queue_wait_seconds_sum\{model="m"\} (\S+)`).FindStringSubmatch(m)
	if sum == nil {
		t.Fatalf("no sum:\n%s", grepLines(m, "queue_wait"))
	}
	if s, _ := strconv.ParseFloat(sum[1], 64); s < 0.1 || s > longest.Seconds() {
		t.Fatalf("waited %gs in all, want 0.1s to %v (the first request's prefill is 600 ms)", s, longest)
	}

	// Its line also says when it went to the engine ("sent"), after its
	// wait: kvproxy's own time.
	logs := p.logs.String()
	queued := regexp.MustCompile(`"request_id":"second[^\n]*"sent":([0-9.]+),"queued":([0-9.]+)`).FindStringSubmatch(logs)
	if queued == nil {
		t.Fatalf("the second request's log line says nothing of its wait:\n%s", logs)
	}
	sent, _ := strconv.ParseFloat(queued[1], 64)
	if ms, _ := strconv.ParseFloat(queued[2], 64); ms < 100 || sent < ms {
		t.Fatalf("queued %s ms and sent at %s ms, want at least 100, and sent after", queued[2], queued[1])
	}
	if !regexp.MustCompile(`"request_id":"first[^\n]*"sent":`).MatchString(logs) {
		t.Fatalf("the first request's line does not say when it was sent:\n%s", logs)
	}
	if regexp.MustCompile(`"request_id":"first[^\n]*"queued"`).MatchString(logs) {
		t.Fatalf("the first request did not wait, and its line says it did:\n%s", logs)
	}
}

// An engine's failure whose retry finds no backend with a slot in time is
// answered with the engine's failure, counted under that engine: kvproxy's
// own 503 queue_timeout told of saturation only, and the engine's 500 was
// counted nowhere (the metrics trial).
func TestRefusalWhoseRetryFindsNoSlotIsAnswered(t *testing.T) {
	good := startFake(t, "good", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	bad := startFake(t, "bad", func(f *fakeEngine) {
		f.status = 500
		f.errBody = `{"error":{"message":"CUDA error: an illegal memory access","type":"InternalServerError","param":null,"code":500}}`
	})
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: good, url: 'http://{{e0}}', max_concurrency: 1}, {id: bad, url: 'http://{{e1}}'}]
limits: {queue_timeout: 300ms}
`, good, bad)
	pinned := strings.Replace(chatBody, `"model":"alias-m"`, `"model":"alias-m","nvext":{"backend_instance_id":"good"}`, 1)
	held := holdSlot(t, p, good, pinned, "")
	resp, body := post(t, p.url+"/v1/chat/completions", chatBody)
	if resp.StatusCode != 500 || resp.Header.Get("X-Kvproxy-Worker") != "bad" || !strings.Contains(string(body), "CUDA error") {
		t.Fatalf("%d from %q: %s", resp.StatusCode, resp.Header.Get("X-Kvproxy-Worker"), body)
	}
	<-held
	p.waitIdle(t)
	m := p.metrics(t)
	if !strings.Contains(m, `kvproxy_requests_total{backend="bad",code="500"} 1`) || !strings.Contains(m, `kvproxy_unavailable_total{reason="queue_timeout"} 0`) {
		t.Fatalf("metrics:\n%s", grepLines(m, "requests_total")+grepLines(m, "unavailable_total"))
	}
	if !regexp.MustCompile(`"backend":"bad"[^\n]*"status":500[^\n]*"error":"[^"]*its retry: no backend had capacity within the queue timeout"`).MatchString(p.logs.String()) {
		t.Fatalf("the log line says nothing of the retry:\n%s", p.logs.String())
	}
}

// A backend a reload adds takes no request before it is in its pool: one
// routed to it while the reload was still building found none, and got
// 503 backend_removed with the other engines healthy (the scale trial);
// one added again after its old self retired had requests spin on the
// retired one until the reload was done (the review).
func TestBackendBeingAddedTakesNoRequestYet(t *testing.T) {
	for _, readded := range []bool{false, true} {
		t.Run(fmt.Sprint("added again=", readded), func(t *testing.T) {
			e0, e1 := startFake(t, "e0", nil), startFake(t, "e1", nil)
			base := "models: [{name: m, aliases: [alias-m]}]\nrouter: {policy: round_robin}\nbackends:\n  - {id: e0, url: 'http://{{e0}}'}\n"
			both := base + "  - {id: e1, url: 'http://{{e1}}'}\n"
			fill := func(y string) string {
				return strings.ReplaceAll(strings.ReplaceAll(y, "{{e0}}", e0.addr), "{{e1}}", e1.addr)
			}
			p := startProxyYAML(t, base, e0, e1)
			if readded {
				p.reloadYAML(t, fill(both))
				p.reloadYAML(t, fill(base))
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				if err := p.s.AwaitRetired(ctx, "e1", "http://"+e1.addr); err != nil {
					t.Fatal(err)
				}
			}
			next, err := config.Parse([]byte(fill(both)))
			if err != nil {
				t.Fatal(err)
			}
			prev := p.s.st.Load()
			st, err := p.s.build(next, prev) // as a reload does, before it activates st
			if err != nil {
				t.Fatal(err)
			}
			var toE1 atomic.Int64
			hook := func(b *backend) {
				if b.cfg.ID == "e1" {
					toE1.Add(1)
				}
			}
			p.s.testRouted.Store(&hook)
			client := &http.Client{Timeout: 2 * time.Second}
			for range 6 {
				resp, err := client.Post(p.url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
				if err != nil {
					t.Fatalf("while the reload builds: %v (routed to e1 %d times)", err, toE1.Load())
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Fatalf("%d while the reload builds: %s", resp.StatusCode, b)
				}
			}
			if n := toE1.Load(); n != 0 || e1.requests.Load() != 0 {
				t.Fatalf("the backend being added was routed %d times, took %d requests", n, e1.requests.Load())
			}
			p.s.activate(st, prev)
			for range 4 {
				post(t, p.url+"/v1/chat/completions", chatBody)
			}
			if e1.requests.Load() == 0 {
				t.Fatal("the added backend took no request once active")
			}
		})
	}
}

// kvproxy's own failures (503s of saturation, an outage) log as warnings,
// as an engine's do, their summaries too: at log_level warn they were
// gone (the replicas trial). Its refusals of the client's doing stay info.
func TestOwnFailuresLogAsWarnings(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]
limits: {max_queue: 0}
`, e)
	held := holdSlot(t, p, e, chatBody, "")
	for range rejectLinesPerSec + 5 {
		if resp, b := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 503 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	post(t, p.url+"/v1/chat/completions", strings.Replace(chatBody, "alias-m", "no-such-model", 1))
	<-held
	waitFor(t, "the summary of the suppressed lines", func() bool { return strings.Contains(p.logs.String(), "similar lines") })
	logs := p.logs.String()
	for _, want := range []string{
		`{"level":"warn","request_id":`, `"status":503`, `{"level":"warn","tenant":"","error":"every backend is at its concurrency limit and the wait queue is full","suppressed":5`,
	} {
		if !strings.Contains(logs, want) {
			t.Fatalf("no %s in:\n%s", want, logs)
		}
	}
	if !regexp.MustCompile(`\{"level":"info","request_id":"[^"]*"[^\n]*"status":404`).MatchString(logs) {
		t.Fatalf("the unknown model's 404 is not an info line:\n%s", logs)
	}
	if regexp.MustCompile(`\{"level":"info"[^\n]*"status":503`).MatchString(logs) {
		t.Fatalf("a 503 of kvproxy's logged at info:\n%s", logs)
	}
}

// postID posts body with the request id id ("": none) and returns the
// answer's status (0: no answer).
func postID(url, body, id string) int {
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if id != "" {
		req.Header.Set("X-Request-Id", id)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// holdSlot posts body (request id id) in the background and returns once
// e has it, which takes up to 10 s when it is the first (it loads the
// tokenizer); the answer's status comes on the channel.
func holdSlot(t *testing.T, p *testProxy, e *fakeEngine, body, id string) <-chan int {
	t.Helper()
	status := make(chan int, 1)
	go func() { status <- postID(p.url+"/v1/chat/completions", body, id) }()
	for deadline := time.Now().Add(10 * time.Second); e.current.Load() != 1; {
		if time.Now().After(deadline) {
			t.Fatalf("the first request never reached the engine:\n%s", p.logs.String())
		}
		time.Sleep(time.Millisecond)
	}
	return status
}
