package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestStreamHangUpDuringEnginePause: a client that hangs up mid-stream
// while the engine is silent is noticed at once (the engine is aborted, the
// slot freed), on HTTP/1.0 (a hijacked connection) as on HTTP/1.1.
func TestStreamHangUpDuringEnginePause(t *testing.T) {
	for _, proto := range []string{"HTTP/1.1", "HTTP/1.0"} {
		t.Run(proto, func(t *testing.T) {
			e := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 5, 2, 10*time.Second })
			p := startProxy(t, "kv", e)
			c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			body := `{"model":"m","prompt":"hello","stream":true}`
			fmt.Fprintf(c, "POST /v1/completions %s\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", proto, len(body), body)
			c.SetDeadline(time.Now().Add(5 * time.Second))
			rd := bufio.NewReader(c)
			readEvents(t, rd, 3) // the role chunk and two tokens, then the engine pauses
			start := time.Now()
			c.Close()
			for e.aborted.Load() == 0 {
				if time.Since(start) > 3*time.Second {
					t.Fatal("the engine never saw the abort")
				}
				time.Sleep(time.Millisecond)
			}
			t.Logf("aborted after %v", time.Since(start))
			p.waitIdle(t)
		})
	}
}

// rawEngine is an engine that answers each request (read whole) by writing
// to its connection itself, which is closed when answer returns.
func rawEngine(t *testing.T, answer func(c net.Conn, rd *bufio.Reader)) *fakeEngine {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				rd := bufio.NewReader(c)
				req, err := http.ReadRequest(rd)
				if err != nil {
					return
				}
				io.Copy(io.Discard, req.Body)
				answer(c, rd)
			}()
		}
	}()
	return &fakeEngine{id: "e0", addr: ln.Addr().String()}
}

// holdingEngine answers every request with a stream that sends its events
// and [DONE] but leaves the chunked body open: the proxy has the whole
// answer before the engine's stream ends.
func holdingEngine(t *testing.T) *fakeEngine {
	return rawEngine(t, func(c net.Conn, rd *bufio.Reader) {
		events := "data: {\"choices\":[{\"index\":0,\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n"
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n", len(events), events)
		io.Copy(io.Discard, rd) // until the proxy closes it
	})
}

// TestCutAfterDoneAddsNothing: a stream whose [DONE] has gone out is
// complete; a cut at the drain deadline must not append an error event and
// a second [DONE] to it.
func TestCutAfterDoneAddsNothing(t *testing.T) {
	e := holdingEngine(t)
	p := startProxy(t, "kv", e)
	resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hello","stream":true}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%v %v", err, resp)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	for {
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if line == "data: [DONE]\n" {
			break
		}
	}
	if n := p.s.Cut(); n != 1 {
		t.Fatalf("cut %d requests, want 1", n)
	}
	rest, err := io.ReadAll(rd)
	if err != nil || strings.TrimSpace(string(rest)) != "" {
		t.Fatalf("after [DONE]: %q %v", rest, err)
	}
	p.waitIdle(t)
}

// TestRefusalAvoidsEveryRankOfTheEngine: the data-parallel ranks of one
// engine ("busy", "busy#1", "busy#2") are one engine: a request it refuses
// goes next to another engine, not to another rank of the same one.
func TestRefusalAvoidsEveryRankOfTheEngine(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.status = 429; f.errBody = `{"error":{"message":"busy"}}` })
	ok := startFake(t, "ok", nil)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: busy, url: 'http://{{e0}}', model: m, kv_events: {mode: http}}\n"+
		"  - {id: ok, url: 'http://{{e1}}', model: m}\n", busy, ok)
	tokens := make([]string, 64)
	for i := range tokens {
		tokens[i] = fmt.Sprint(100 + i)
	}
	ids := strings.Join(tokens, ",")
	for rank := 1; rank < 3; rank++ { // rank 0 ("busy") has sent no events
		batch := fmt.Sprintf(`{"engine_id":"busy","data_parallel_rank":%d,"events":[{"type":"block_stored","block_hashes":[%d,%d,%d,%d],"parent_block_hash":null,"token_ids":[%s],"block_size":16}]}`,
			rank, 10*rank+1, 10*rank+2, 10*rank+3, 10*rank+4, ids)
		if resp, b := post(t, p.url+"/v1/kv_events", batch); resp.StatusCode != 200 {
			t.Fatalf("push: %d %s", resp.StatusCode, b)
		}
	}
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":[`+ids+`]}`)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "ok" {
		t.Fatalf("%d from %q: %s", resp.StatusCode, resp.Header.Get(WorkerHeader), b)
	}
	if n := busy.requests.Load(); n != 1 {
		t.Fatalf("the refusing engine saw %d attempts, want 1", n)
	}
	p.waitIdle(t)
}

// TestShutdownCutsHTTP10Stream: Shutdown waits for an HTTP/1.0 stream (a
// hijacked connection fasthttp no longer counts); Cut ends it with an error
// event and [DONE], the connection closes, Shutdown returns and no slot is
// left.
func TestShutdownCutsHTTP10Stream(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 5, 2, 10*time.Second })
	p := startProxy(t, "kv", e)
	body := `{"model":"m","prompt":"hello","stream":true}`
	c := rawPost(t, p, "HTTP/1.0", "/v1/completions", body)
	c.SetDeadline(time.Now().Add(5 * time.Second))
	rd := bufio.NewReader(c)
	readEvents(t, rd, 3) // the role chunk and two tokens, then the engine pauses
	shut := make(chan error, 1)
	go func() { shut <- p.s.Shutdown() }()
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned with a stream in flight: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	if n := p.s.Cut(); n != 1 {
		t.Fatalf("cut %d, want 1", n)
	}
	rest, err := io.ReadAll(rd)
	if err != nil || !strings.Contains(string(rest), `"code":"shutting_down"`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("ending: %q %v", rest, err)
	}
	select {
	case <-shut:
	case <-time.After(5 * time.Second):
		t.Fatal("Shutdown did not return after the cut")
	}
	if !p.s.Idle() {
		t.Fatalf("slots left: %+v", p.s.backendRows(p.s.st.Load()))
	}
}

// TestCutAnswersQueuedRequests: a request waiting in the queue for a full
// backend when the drain deadline passes is answered at once (503), not
// after queue_timeout.
func TestCutAnswersQueuedRequests(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	p := startProxyYAML(t, `
models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]
limits: {max_queue: 4, queue_timeout: 10s}
`, e)
	codes := make(chan int, 2)
	for _, prompt := range []string{"first", "second"} {
		go func() {
			resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"`+prompt+`"}`))
			if err != nil {
				codes <- 0
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		}()
		if prompt == "first" {
			waitFor(t, "the first request at the engine", func() bool { return e.requests.Load() == 1 })
		}
	}
	waitFor(t, "the second request in the queue", func() bool { return p.s.queued.Load() == 1 })
	if n := p.s.InFlight(); n != 2 {
		t.Fatalf("in flight before the cut: %d, want 2 (the queued request counts)", n)
	}
	start := time.Now()
	if n := p.s.Cut(); n != 2 {
		t.Fatalf("Cut reported %d requests, want 2", n)
	}
	for i := 0; i < 2; i++ {
		select {
		case code := <-codes:
			if code != 503 {
				t.Fatalf("answer %d: %d", i, code)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("answer %d not given %v after the cut", i, time.Since(start))
		}
	}
	if e.requests.Load() != 1 {
		t.Fatalf("the engine saw %d requests after the cut", e.requests.Load())
	}
	// Answered where it waited, not routed to the slot the cut freed.
	waitFor(t, "the queued request's log line", func() bool {
		return strings.Contains(p.logs.String(), "while waiting for a backend slot")
	})
	p.waitIdle(t)
}

// TestShuttingDownAnswersShareOneShape: the 503 of a request cut before its
// answer began and the 503 of a request that arrives while draining carry
// the same error type and code as a cut stream's error event
// (service_unavailable, shutting_down), so a client tells them apart from
// "no backend available".
func TestShuttingDownAnswersShareOneShape(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	p := startProxy(t, "kv", e)
	type answer struct {
		status int
		retry  string
		body   string
	}
	first := make(chan answer, 1)
	go func() {
		resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"slow"}`)
		first <- answer{resp.StatusCode, resp.Header.Get("Retry-After"), string(b)}
	}()
	waitFor(t, "the request at the engine", func() bool { return e.requests.Load() == 1 })
	p.s.Cut()
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"late"}`)
	for name, a := range map[string]answer{"cut": <-first, "draining": {resp.StatusCode, resp.Header.Get("Retry-After"), string(b)}} {
		if a.status != 503 || a.retry == "" || !strings.Contains(a.body, `"type":"service_unavailable"`) || !strings.Contains(a.body, `"code":"shutting_down"`) {
			t.Errorf("%s: %d Retry-After %q %s", name, a.status, a.retry, a.body)
		}
	}
	p.waitIdle(t)
}

// TestServeAfterShutdownReturns: "Serve answers on ln until Shutdown" holds
// when SIGTERM's Shutdown wins the race with a Serve still starting: Serve
// returns at once instead of serving on with probes restarted.
func TestServeAfterShutdownReturns(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	p.s.Shutdown()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	go func() { served <- p.s.Serve(ln) }()
	select {
	case <-served:
	case <-time.After(2 * time.Second):
		resp, err := http.Get("http://" + ln.Addr().String() + "/health")
		if err == nil {
			resp.Body.Close()
		}
		t.Fatalf("Serve after Shutdown is still serving (GET /health: %v %v)", resp, err)
	}
}

// An engine's unreadable answer is a 502 naming the backend; the bytes it
// sent (which fasthttp's error quotes) and its address stay in the log
// (found by the twelfth session's user trial).
func TestUnreadableAnswerIsNotQuoted(t *testing.T) {
	for _, tc := range []struct {
		answer, want string
		stream       bool
	}{
		{"garbage-from-engine\r\n\r\n", "backend e0 sent an answer kvproxy could not read", false},
		{"garbage-from-engine\r\n\r\n", "backend e0 sent an answer kvproxy could not read", true},
		// A streamed 200 cut short is a stream's failure, told as one.
		{"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"id\":", "backend e0 closed the connection before its answer was complete", false},
	} {
		p := startProxy(t, "kv", rawEngine(t, func(c net.Conn, _ *bufio.Reader) { io.WriteString(c, tc.answer) }))
		resp, body := post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"hello","stream":%v}`, tc.stream))
		if resp.StatusCode != 502 || !strings.Contains(string(body), tc.want) || strings.Contains(string(body), "garbage") || strings.Contains(string(body), "127.0.0.1") {
			t.Fatalf("stream %v: %d %s", tc.stream, resp.StatusCode, body)
		}
		if !strings.Contains(p.logs.String(), "garbage") && strings.Contains(tc.answer, "garbage") {
			t.Fatalf("the log lost the engine's error: %s", p.logs.String())
		}
		p.waitIdle(t)
	}
}
