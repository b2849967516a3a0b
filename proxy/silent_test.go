package proxy

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func ejected(p *testProxy, id string) bool {
	b := p.s.st.Load().backends[id]
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.ejected
}

// TestEngineThatNeverAnswersWholeRequestsIsEjected: an engine that takes
// non-streamed requests and never answers them (its health probe may
// pass) is ejected after silentWholeLimit timeouts in a row; before, every
// request sent to it waited out stream_idle_timeout for good.
func TestEngineThatNeverAnswersWholeRequestsIsEjected(t *testing.T) {
	hung := startFake(t, "hung", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	ok := startFake(t, "ok", nil)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: hung, url: 'http://{{e0}}', model: m}, {id: ok, url: 'http://{{e1}}', model: m}]\n"+
		"limits: {stream_idle_timeout: 200ms}\n", hung, ok)
	pinned := `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"hung"}}`
	for i := 1; i <= silentWholeLimit; i++ {
		// x-should-retry: false, or an SDK sends it again to the same
		// engine, for the same wait (the twenty-ninth session's SDK trial).
		if resp, b := post(t, p.url+"/v1/completions", pinned); resp.StatusCode != 504 || resp.Header.Get("X-Should-Retry") != "false" {
			t.Fatalf("request %d: %d %v %s", i, resp.StatusCode, resp.Header, b)
		}
		if got, want := ejected(p, "hung"), i == silentWholeLimit; got != want {
			t.Fatalf("after %d silent requests: ejected %v", i, got)
		}
	}
	if !strings.Contains(p.logs.String(), "non-streamed requests in a row") {
		t.Fatalf("the ejection's reason is not logged: %s", p.logs.String())
	}
	for i := 0; i < 4; i++ {
		if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "ok" {
			t.Fatalf("after the ejection: %d from %q: %s", resp.StatusCode, resp.Header.Get(WorkerHeader), b)
		}
	}
	p.waitIdle(t)
}

// The Responses API's whole answers get x-should-retry: false too.
func TestSilentResponseIsNotRetried(t *testing.T) {
	hung := startFake(t, "hung", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: hung, url: 'http://{{e0}}', model: m}]\nlimits: {stream_idle_timeout: 200ms}\n", hung)
	if resp, b := post(t, p.url+"/v1/responses", `{"model":"m","input":"x"}`); resp.StatusCode != 504 || resp.Header.Get("X-Should-Retry") != "false" {
		t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, b)
	}
	p.waitIdle(t)
}

// A good answer between silent ones starts the count again: long answers
// now and then do not eject a working engine.
func TestAnAnswerResetsTheSilentCount(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	b := p.s.st.Load().backends["e0"]
	for round := 0; round < 3; round++ {
		for i := 1; i < silentWholeLimit; i++ {
			b.wholeTimedOut("silent")
		}
		b.succeed()
	}
	if ejected(p, "e0") {
		t.Fatal("ejected although every streak ended in an answer")
	}
}

// A stream the engine leaves silent past stream_idle_timeout ends with an
// error event that says so (504 in the log), and the engine is ejected.
func TestSilentMidStreamSaysTimeout(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 4, 2, 5*time.Second })
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {stream_idle_timeout: 200ms}\n", e)
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
	if resp.StatusCode != 200 || !strings.Contains(string(b), `went silent mid-stream: backend e0 sent nothing for 200ms (limits.stream_idle_timeout)","type":"timeout_error","param":null,"code":"backend_timeout"}}`) || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if !ejected(p, "e0") {
		t.Fatal("a silent stream did not eject its engine")
	}
	p.waitIdle(t)
	if !strings.Contains(p.logs.String(), `"status":504`) {
		t.Fatalf("access log: %s", p.logs.String())
	}
}

// An engine that sends [DONE] and then leaves its body open (no chunked
// terminator) has answered: the client's stream ends endGrace later, with
// nothing added, logged 200, and the engine stays in. It waited out
// stream_idle_timeout (5 minutes by default: SDKs read a stream to its end
// after [DONE]), then got an error event and a second [DONE], and the
// engine was ejected (the chaos trial).
func TestStallAfterDoneEndsTheStream(t *testing.T) {
	release := make(chan struct{})
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"stop"}]}`+"\n\n")
		io.WriteString(w, "data: [DONE]\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer engine.Close()
	defer close(release)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: '"+engine.URL+"', model: m}]\nlimits: {stream_idle_timeout: 30s}\n")
	start := time.Now()
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
	took := time.Since(start)
	if resp.StatusCode != 200 || strings.Contains(string(b), "error") || strings.Count(string(b), "[DONE]") != 1 || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if took > endGrace+5*time.Second {
		t.Fatalf("the stream ended %v after it began, want about endGrace (%v)", took, endGrace)
	}
	if ejected(p, "e0") {
		t.Fatal("an engine that answered in full was ejected")
	}
	p.waitIdle(t)
	if l := p.logs.String(); !strings.Contains(l, `"status":200`) {
		t.Fatalf("access log: %s", l)
	}
}

// The engine's 2 s after [DONE] are a budget of its own time, not 2 s per
// read: an engine that trickles a comment every 500 ms after [DONE] held the
// client for as long as it went on (the review: 8 s for 8 pings).
func TestTrickleAfterDoneEndsTheStream(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
		w.(http.Flusher).Flush()
		for i := 0; i < 16; i++ {
			select {
			case <-r.Context().Done():
				return
			case <-time.After(500 * time.Millisecond):
			}
			io.WriteString(w, ": ping\n\n")
			w.(http.Flusher).Flush()
		}
	}))
	defer engine.Close()
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: '"+engine.URL+"', model: m}]\nlimits: {stream_idle_timeout: 30s}\n")
	start := time.Now()
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
	if took := time.Since(start); resp.StatusCode != 200 || strings.Contains(string(b), "error") || took > endGrace+2*time.Second {
		t.Fatalf("%d after %v, want the end about endGrace (%v) after [DONE]:\n%s", resp.StatusCode, took, endGrace, b)
	}
	p.waitIdle(t)
}

// A stream that ends before the engine's first event, with nothing of the
// engine's to relay, is answered with an HTTP status in the API's error
// shape, which the SDKs retry (a 502 or 504), not a 200 whose stream holds
// an error event: the engine silent past stream_idle_timeout (504,
// ejected), its stream ended with no event (502, not ejected), on chat and
// on the Messages API. A stream whose engine sent anything first (a keep-alive
// comment) is the engine's answer begun: it stays a 200 that ends with the
// error event.
func TestStreamOverBeforeItsFirstEventIsAnHTTPError(t *testing.T) {
	engine := func(first string, hold bool) *httptest.Server {
		release := make(chan struct{})
		e := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(200)
			io.WriteString(w, first)
			w.(http.Flusher).Flush()
			if hold {
				select {
				case <-r.Context().Done():
				case <-release:
				}
			}
		}))
		t.Cleanup(func() { close(release); e.Close() })
		return e
	}
	for _, tc := range []struct {
		name, first, path, body string
		hold, ejects            bool
		status                  int
		want                    string
	}{
		{"silent", "", "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`, true, true, 504,
			`{"error":{"message":"the backend serving this request went silent before its first event: backend e0 sent nothing for 200ms (limits.stream_idle_timeout)","type":"timeout_error","param":null,"code":"backend_timeout"}}`},
		{"no event", "", "/v1/completions", `{"model":"m","stream":true,"prompt":"x"}`, false, false, 502,
			`{"error":{"message":"the backend serving this request failed before its first event","type":"upstream_error","param":null,"code":"backend_failed"}}`},
		{"blank lines, then the end", "\n\n\r\n\n", "/v1/completions", `{"model":"m","stream":true,"prompt":"x"}`, false, false, 502,
			`{"error":{"message":"the backend serving this request failed before its first event","type":"upstream_error","param":null,"code":"backend_failed"}}`},
		{"blank lines, then silent", "\n\n", "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`, true, true, 504,
			`{"error":{"message":"the backend serving this request went silent before its first event: backend e0 sent nothing for 200ms (limits.stream_idle_timeout)","type":"timeout_error","param":null,"code":"backend_timeout"}}`},
		{"messages, silent", "", "/v1/messages", `{"model":"m","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, true, true, 504,
			`{"type":"error","error":{"type":"timeout_error","message":"the backend serving this request went silent before its first event: backend e0 sent nothing for 200ms (limits.stream_idle_timeout)"}`},
		{"a comment, then silent", ": ping\n\n", "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`, true, true, 200,
			": ping\n\ndata: {\"error\":{\"message\":\"the backend serving this request went silent before its first event: backend e0 sent nothing for 200ms (limits.stream_idle_timeout)\",\"type\":\"timeout_error\",\"param\":null,\"code\":\"backend_timeout\"}}\n\ndata: [DONE]\n\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := engine(tc.first, tc.hold)
			p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: '"+e.URL+"', model: m}]\nlimits: {stream_idle_timeout: 200ms}\n")
			resp, b := post(t, p.url+tc.path, tc.body)
			if resp.StatusCode != tc.status || !strings.HasPrefix(string(b), tc.want) {
				t.Fatalf("%d %q\nwant %d %q", resp.StatusCode, b, tc.status, tc.want)
			}
			if ct := resp.Header.Get("Content-Type"); (tc.status == 200) != strings.HasPrefix(ct, "text/event-stream") {
				t.Fatalf("status %d with Content-Type %q", resp.StatusCode, ct)
			}
			// A silent engine is ejected; one that ended its stream cleanly
			// answered, wrongly, and is counted as for its 500s: a model's
			// only engine stays in (it was ejected, and the SDK's retry got
			// a 503: the second quirks trial).
			if ejected(p, "e0") != tc.ejects {
				t.Fatalf("ejected %v, want %v", !tc.ejects, tc.ejects)
			}
			p.waitIdle(t)
			if want := fmt.Sprintf(`"status":%d`, map[int]int{200: 504}[tc.status]+tc.status*map[bool]int{true: 0, false: 1}[tc.status == 200]); !strings.Contains(p.logs.String(), want) {
				t.Fatalf("access log without %s: %s", want, p.logs.String())
			}
		})
	}
}
