package proxy

import (
	"bufio"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// An engine that stops answering (a frozen process, a lost node) neither
// answers nor closes its connections: its requests waited for
// stream_idle_timeout (5 minutes by default). Once its health probe fails,
// the requests it has sent nothing to since end at once with 504 (a stream
// with an error event and [DONE]); a stream it still sends to goes on.
func TestRequestsOfAnEngineThatStopsAnsweringEndEarly(t *testing.T) {
	stuck := startFake(t, "stuck", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 10, 3, 30*time.Second })
	whole := startFake(t, "whole", func(f *fakeEngine) { f.prefillDelay = 30 * time.Second })
	alive := startFake(t, "alive", func(f *fakeEngine) { f.tokens, f.tokenEvery = 60, 20*time.Millisecond })
	yaml := strings.NewReplacer("{{stuck}}", stuck.addr, "{{whole}}", whole.addr, "{{alive}}", alive.addr).Replace(
		"models: [{name: stuck}, {name: whole}, {name: alive}]\n" +
			"backends:\n" +
			"  - {id: stuck, url: 'http://{{stuck}}', model: stuck}\n" +
			"  - {id: whole, url: 'http://{{whole}}', model: whole}\n" +
			"  - {id: alive, url: 'http://{{alive}}', model: alive}\n" +
			"health: {interval: 200ms, timeout: 100ms, fall: 2}\n" +
			"limits: {stream_idle_timeout: 60s}\n")
	p := serveYAML(t, yaml, false)

	type answer struct {
		status int
		body   string
		took   time.Duration
	}
	send := func(model string, stream bool, started chan<- struct{}) <-chan answer {
		done := make(chan answer, 1)
		go func() {
			body := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]`
			if stream {
				body += `,"stream":true`
			}
			t0 := time.Now()
			resp, err := http.Post(p.url+"/v1/chat/completions", "application/json", strings.NewReader(body+"}"))
			if err != nil {
				done <- answer{body: err.Error()}
				return
			}
			defer resp.Body.Close()
			var got strings.Builder
			r := bufio.NewReader(resp.Body)
			for {
				line, err := r.ReadString('\n')
				got.WriteString(line)
				if started != nil && strings.Contains(line, `"t2 "`) {
					close(started)
					started = nil
				}
				if err != nil {
					if err != io.EOF {
						got.WriteString(err.Error())
					}
					break
				}
			}
			done <- answer{resp.StatusCode, got.String(), time.Since(t0)}
		}()
		return done
	}
	stuckStarted, aliveStarted := make(chan struct{}), make(chan struct{})
	stuckDone := send("stuck", true, stuckStarted)
	wholeDone := send("whole", false, nil)
	aliveDone := send("alive", true, aliveStarted)
	for _, c := range []chan struct{}{stuckStarted, aliveStarted} {
		select {
		case <-c:
		case <-time.After(5 * time.Second):
			t.Fatal("the streams did not start")
		}
	}
	waitFor(t, "the non-streamed request to reach its engine", func() bool { return whole.requests.Load() == 1 })
	for _, f := range []*fakeEngine{stuck, whole, alive} {
		f.unhealthy.Store(true)
	}

	a := <-stuckDone
	if a.status != 200 || !strings.Contains(a.body, "stopped answering") || !strings.Contains(a.body, `"code":"backend_timeout"`) ||
		!strings.HasSuffix(strings.TrimSpace(a.body), "data: [DONE]") || a.took > 10*time.Second {
		t.Fatalf("the stalled stream (%v): %d %s", a.took, a.status, a.body)
	}
	a = <-wholeDone
	if a.status != 504 || !strings.Contains(a.body, "health probe failed") || !strings.Contains(a.body, `"code":"backend_timeout"`) || a.took > 10*time.Second {
		t.Fatalf("the unanswered request (%v): %d %s", a.took, a.status, a.body)
	}
	a = <-aliveDone
	if a.status != 200 || !strings.Contains(a.body, `"t59 "`) || strings.Contains(a.body, "error") {
		t.Fatalf("the stream its engine kept sending: %d %s", a.status, a.body)
	}
	waitFor(t, "the warning", func() bool {
		return strings.Contains(p.logs.String(), "ended the requests the backend stopped answering")
	})
	for _, l := range strings.Split(p.logs.String(), "\n") {
		if strings.Contains(l, `"msg":"request"`) && strings.Contains(l, `"backend":"alive"`) && !strings.Contains(l, `"status":200`) {
			t.Fatalf("the live stream was logged as failed: %s", l)
		}
	}
	p.waitIdle(t)
}

// A request sent after the engine's probe first failed, but before enough
// failures took it out, is cut with the others if the engine sent it
// nothing: it waited out stream_idle_timeout (the review).
func TestRequestSentWhileTheProbeFailsIsCutToo(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 30 * time.Second })
	p := serveYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://"+e.addr+"'}]\n"+
		"health: {interval: 300ms, timeout: 100ms, fall: 3}\nlimits: {stream_idle_timeout: 60s}\n", false)
	waitFor(t, "a probe to pass", func() bool { return e.probes.Load() >= 2 })
	e.unhealthy.Store(true)
	time.Sleep(350 * time.Millisecond) // a probe or two failed: not yet three
	start := time.Now()
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if took := time.Since(start); took > 10*time.Second || resp.StatusCode != 504 && resp.StatusCode != 503 {
		t.Fatalf("after %v: %d %s", took, resp.StatusCode, body)
	}
	p.waitIdle(t)
}

// One host may serve several backends (models, API keys), each probed on
// its own: one's failing probe cuts its own requests, not the others' (the
// second review: a revoked key's probe cut the other key's requests).
func TestProbeCutsOnlyItsOwnBackend(t *testing.T) {
	var revoked atomic.Bool
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		if revoked.Load() && r.Header.Get("Authorization") == "Bearer key-b-12345" {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"object":"list","data":[]}`))
	})
	mux.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(time.Second)
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"id":"x","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"stop"}]}`))
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	p := serveYAML(t, "models: [{name: a}, {name: b}]\nbackends:\n"+
		"  - {id: a, url: 'http://"+host+"', model: a, kind: openai, api_key: key-a-12345}\n"+
		"  - {id: b, url: 'http://"+host+"', model: b, kind: openai, api_key: key-b-12345}\n"+
		"health: {interval: 200ms, timeout: 100ms, fall: 2}\n", false)
	time.Sleep(500 * time.Millisecond) // both probed healthy
	done := make(chan int, 1)
	go func() {
		resp, _ := post(t, p.url+"/v1/completions", `{"model":"a","prompt":"hi"}`)
		done <- resp.StatusCode
	}()
	time.Sleep(100 * time.Millisecond)
	revoked.Store(true)
	waitFor(t, "b's ejection", func() bool { return strings.Contains(p.logs.String(), `"ejected_by":"probe"`) })
	if code := <-done; code != 200 {
		t.Fatalf("backend a's request got %d when b's probe failed", code)
	}
}
