package proxy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/router"
)

func parsedRequest(t *testing.T, body string, chat bool) *apiRequest {
	t.Helper()
	var req apiRequest
	if pe := req.parse([]byte(body), chat); pe != nil {
		t.Fatalf("parse %s: %v", body, pe)
	}
	return &req
}

func TestMigratableRequests(t *testing.T) {
	for _, c := range []struct {
		body string
		kind api
		want bool
	}{
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`, apiChat, true},
		{`{"model":"m","stream":true,"prompt":"hi","max_tokens":9}`, apiCompletions, true},
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"response_format":{"type": "text"}}`, apiChat, true},
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"n":1,"best_of":1}`, apiChat, true},
		{`{"model":"m","messages":[{"role":"user","content":"hi"}]}`, apiChat, false}, // not streamed
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"n":2}`, apiChat, false},
		{`{"model":"m","stream":true,"prompt":[1,2,3]}`, apiCompletions, false},
		{`{"model":"m","stream":true,"prompt":["a","b"]}`, apiCompletions, false},
		{`{"model":"m","stream":true,"prompt":"hi","echo":true}`, apiCompletions, false},
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"}}`, apiChat, false},
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"guided_json":{"type":"object"}}`, apiChat, false},
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"structured_outputs":{"regex":"a+"}}`, apiChat, false},
		{`{"model":"m","stream":true,"prompt":"hi","prompt_logprobs":1}`, apiCompletions, false},
		{`{"model":"m","stream":true,"messages":[{"role":"assistant","content":"Once"}],"add_generation_prompt":false,"continue_final_message":true}`, apiChat, false},
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`, apiResponses, false},
		{`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`, apiMessages, false},
	} {
		req := parsedRequest(t, c.body, c.kind != apiCompletions)
		if got := migratable(req, c.kind, &router.Request{}); got != c.want {
			t.Errorf("migratable(%s) = %v, want %v", c.body, got, c.want)
		}
	}
	req := parsedRequest(t, `{"model":"m","stream":true,"prompt":"hi"}`, false)
	if migratable(req, apiCompletions, &router.Request{Pinned: true}) {
		t.Error("a request pinned to an engine was migratable")
	}
}

// note reads the text relayed so far, and gives up on output that is not
// text, or an answer already finished.
func TestMigrationNotesTheOutput(t *testing.T) {
	m := &migration{chat: true}
	for _, c := range []string{
		`{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
		`{"id":"c","choices":[{"index":0,"delta":{"content":"Say \"hi\""},"logprobs":null,"finish_reason":null}]}`,
		`{"id": "c", "choices": [{"index": 0, "delta": {"content": "\n\u00e9"}, "logprobs": {"content": [{"token": "x"}]}, "finish_reason": null}]}`,
	} {
		note(m, c)
	}
	if got := string(m.partial); got != `Say \"hi\"\n\u00e9` || m.off || m.finished {
		t.Fatalf("partial %q off %v finished %v", got, m.off, m.finished)
	}
	note(m, `{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}}]},"finish_reason":null}]}`)
	if !m.off {
		t.Fatal("a tool call left the stream continuable")
	}
	m = &migration{chat: true}
	note(m, `{"choices":[{"index":0,"delta":{"reasoning_content":"hmm"},"finish_reason":null}]}`)
	if !m.off {
		t.Fatal("reasoning left the stream continuable")
	}
	m = &migration{}
	note(m, `{"choices":[{"index":0,"text":" once","logprobs":null,"finish_reason":null}]}`)
	note(m, `{"choices":[{"index":0,"text":" upon","logprobs":null,"finish_reason":"length"}]}`)
	if string(m.partial) != " once upon" || !m.finished {
		t.Fatalf("completions: partial %q finished %v", m.partial, m.finished)
	}
}

func note(m *migration, chunk string) {
	k, v := outputOf([]byte(chunk))
	m.note([]byte(chunk), k, v)
}

func TestContinuationBodies(t *testing.T) {
	for _, c := range []struct {
		chat          bool
		body, partial string
		emitted       int
		want          string
	}{
		{true, `{"model":"m","stream":true,"max_tokens":100,"min_tokens":10,"messages":[{"role":"user","content":"hi"} ]}`, `Say \"hi\"`, 12,
			`{"model":"m","stream":true,"max_tokens":88,"min_tokens":0,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Say \"hi\""}],"add_generation_prompt":false,"continue_final_message":true}`},
		{true, `{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true,"max_completion_tokens":5,"model":"m"}`, `ab`, 5,
			`{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"ab"}],"add_generation_prompt":false,"continue_final_message":true,"max_completion_tokens":1,"model":"m"}`},
		{true, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, ``, 0, // nothing relayed yet: the request as it came
			`{"model":"m","messages":[{"role":"user","content":"hi"}]}`},
		{false, `{"model":"m","prompt":"Once upon","max_tokens":50}`, ` a time`, 2,
			`{"model":"m","prompt":"Once upon a time","max_tokens":48}`},
		{false, `{"model":"m","prompt":[ "Once upon" ],"max_tokens":30}`, ` a`, 1,
			`{"model":"m","prompt":"Once upon a","max_tokens":29}`},
		// Completions default to 16 tokens: the continuation asks for the rest.
		{false, `{"model":"m","prompt":"Once upon"}`, ` a time`, 2,
			`{"model":"m","prompt":"Once upon a time","max_tokens":14}`},
		{false, `{"model":"m","max_tokens":null,"prompt":"Once upon"}`, ` a time`, 2,
			`{"model":"m","prompt":"Once upon a time","max_tokens":14}`},
	} {
		m := &migration{chat: c.chat, body: []byte(c.body), partial: []byte(c.partial), defaultMax: !c.chat && !strings.Contains(c.body, `"max_tokens":3`)}
		got := m.continuation(c.emitted)
		if string(got) != c.want {
			t.Errorf("continuation of %s after %q:\n got %s\nwant %s", c.body, c.partial, got, c.want)
		}
		if !json.Valid(got) {
			t.Errorf("not JSON: %s", got)
		}
	}
}

func TestContinuedChunks(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{"choices":[{"index":0,"delta":{"role":"assistant","content":" the"},"finish_reason":null}]}`,
			`{"choices":[{"index":0,"delta":{"content":" the"},"finish_reason":null}]}`},
		{`{"choices":[{"index":0,"delta":{"content":" the", "role": "assistant"},"finish_reason":null}]}`,
			`{"choices":[{"index":0,"delta":{"content":" the"},"finish_reason":null}]}`},
		{`{"choices":[{"index":0,"delta":{"content":" the"}}]}`, ``},
	} {
		if got := string(withoutRole([]byte(c.in))); got != c.want {
			t.Errorf("withoutRole(%s) = %s, want %s", c.in, got, c.want)
		}
	}
	usage := []byte(`{"choices":[],"usage":{"prompt_tokens":63,"total_tokens":363,"completion_tokens":280,"prompt_tokens_details":{"cached_tokens":48}}}`)
	got := shiftInt(shiftInt(usage, promptKey, -20), completionKey, 20)
	var u struct {
		Usage map[string]any `json:"usage"`
	}
	if err := json.Unmarshal(got, &u); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"prompt_tokens": 43.0, "total_tokens": 363.0, "completion_tokens": 300.0, "prompt_tokens_details": map[string]any{"cached_tokens": 48.0}}
	if !reflect.DeepEqual(u.Usage, want) {
		t.Fatalf("usage shifted: %s", got)
	}
}

const migrateYAML = `models: [{name: m}]
backends:
  - {id: dies, url: 'http://{{e0}}', model: m, served_model: engine-m}
  - {id: next, url: 'http://{{e1}}', model: m, served_model: engine-m, kind: %s}
router: {policy: round_robin}
limits:
  migration_limit: %d
`

const migrateBody = `{"model":"m","stream":true,"max_tokens":10,"min_tokens":5,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`

// A stream whose engine drops its connection mid-answer goes on from
// another engine: the client gets all the tokens, one role, no error, and
// usage as its request has it; the engine is asked to continue the
// assistant's message with the output still due, under the request's id.
func TestStreamMovesToAnotherEngineMidAnswer(t *testing.T) {
	for _, c := range []struct {
		name  string
		fails func(*fakeEngine)
	}{
		{"drops its connection", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 3 }},
		{"goes silent", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 10, 3, 20*time.Second }},
		{"pings and sends nothing else", func(f *fakeEngine) {
			f.tokens, f.pauseAfter, f.pause, f.pingEvery = 10, 3, 20*time.Second, 50*time.Millisecond
		}},
		// In its own words, as vLLM says its engine core died: the frame
		// ended the stream (the twenty-ninth session's review).
		{"says it failed", func(f *fakeEngine) {
			f.tokens, f.errorAfter = 10, 3
			f.errorFrame = engineCoreDied
		}},
	} {
		t.Run(c.name, func(t *testing.T) { testStreamMoves(t, c.fails) })
	}
}

func testStreamMoves(t *testing.T, fails func(*fakeEngine)) {
	dies := startFake(t, "dies", fails)
	next := startFake(t, "next", func(f *fakeEngine) { f.tokens = 7 })
	p := startProxyYAML(t, fmt.Sprintf(migrateYAML, "vllm", 1)+"  stream_idle_timeout: 300ms\n", dies, next)
	resp, body := post(t, p.url+"/v1/chat/completions", migrateBody)
	got := string(body)
	if resp.StatusCode != 200 || strings.Contains(got, "error") || !strings.HasSuffix(got, "data: [DONE]\n\n") ||
		strings.Count(got, `"content":"t`) != 10 || strings.Count(got, `"role"`) != 1 {
		t.Fatalf("status %d, stream:\n%s", resp.StatusCode, got)
	}
	// The engine counted its 7 tokens as 14 (two a chunk) and a prompt of
	// 10; the tokens carried over (3 chunks, or more by the model's
	// tokenizer) move from prompt to output.
	carried := max(3, len(p.s.st.Load().models["m"].enc.EncodeText(nil, "t0 t1 t2 ")))
	if !strings.Contains(got, fmt.Sprintf(`"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":24`, 10-carried, 14+carried)) {
		t.Fatalf("usage not restated:\n%s", got)
	}
	if dies.requests.Load() != 1 || next.requests.Load() != 1 {
		t.Fatalf("requests: dies %d, next %d", dies.requests.Load(), next.requests.Load())
	}
	next.mu.Lock()
	b, id := next.bodies[0], next.ids[0]
	next.mu.Unlock()
	msgs, _ := b["messages"].([]any)
	last, _ := msgs[len(msgs)-1].(map[string]any)
	if len(msgs) != 2 || last["role"] != "assistant" || last["content"] != "t0 t1 t2 " || b["continue_final_message"] != true ||
		b["add_generation_prompt"] != false || b["max_tokens"] != float64(10-carried) || b["min_tokens"] != float64(max(5-carried, 0)) || b["model"] != "engine-m" || b["stream"] != true {
		t.Fatalf("continuation request: %v", b)
	}
	dies.mu.Lock()
	first := dies.ids[0]
	dies.mu.Unlock()
	if id != first {
		t.Fatalf("the continuation's X-Request-Id %q is not the request's %q", id, first)
	}
	p.waitIdle(t)
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_stream_migrations_total{backend="dies",result="ok"} 1`) {
		t.Fatalf("metrics:\n%s", m)
	}
}

// No engine able to continue (an OpenAI-compatible server of unknown
// kind), or the one chosen refusing: the stream ends as it did before
// migration, with the error event and [DONE], and nothing stays held.
func TestStreamMigrationThatCannotHappen(t *testing.T) {
	for _, c := range []struct {
		kind, why string
		status    int
	}{
		{"openai", "no backend could continue it", 0},
		{"vllm", "backend next could not continue it: it answered 503", 503},
	} {
		dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 3 })
		next := startFake(t, "next", func(f *fakeEngine) { f.status, f.errBody = c.status, `{"error":{"message":"busy"}}` })
		p := startProxyYAML(t, fmt.Sprintf(migrateYAML, c.kind, 1), dies, next)
		_, body := post(t, p.url+"/v1/chat/completions", migrateBody)
		got := string(body)
		if !strings.Contains(got, `"code":"backend_failed"`) || !strings.HasSuffix(got, "data: [DONE]\n\n") || strings.Count(got, `"content":"t`) != 3 {
			t.Fatalf("%s: stream:\n%s", c.kind, got)
		}
		p.waitIdle(t)
		waitFor(t, "the log naming why", func() bool { return strings.Contains(p.logs.String(), c.why) })
		// The request's line names the engine that failed it, not the
		// one that refused to continue it.
		if line := requestLine(t, p.logs.String()); line["backend"] != "dies" || line["status"] != 502.0 {
			t.Fatalf("%s: request line %v", c.kind, line)
		}
		if m := p.metrics(t); !strings.Contains(m, `kvproxy_stream_migrations_total{backend="dies",result="failed"} 1`) {
			t.Fatalf("%s: metrics:\n%s", c.kind, m)
		}
	}
}

// An engine that takes a request and drops it before answering anything:
// with migration_limit, the request goes to the next engine, streamed or
// not, whatever it asks for (n = 2 here); without, it is a 502.
func TestRequestWhoseEngineDropsItBeforeAnsweringMoves(t *testing.T) {
	for _, limit := range []int{1, 0} {
		for _, stream := range []bool{false, true} {
			dies := startFake(t, "dies", func(f *fakeEngine) { f.dropRequests = true })
			next := startFake(t, "next", nil)
			p := startProxyYAML(t, fmt.Sprintf(migrateYAML, "vllm", limit), dies, next)
			resp, body := post(t, p.url+"/v1/chat/completions", fmt.Sprintf(`{"model":"m","stream":%v,"n":2,"messages":[{"role":"user","content":"hi"}]}`, stream))
			want := 200
			if limit == 0 {
				want = 502
			}
			if resp.StatusCode != want || dies.requests.Load() != 1 || next.requests.Load() != int64(limit) {
				t.Fatalf("limit %d, stream %v: status %d (want %d), requests dies %d next %d: %s", limit, stream, resp.StatusCode, want, dies.requests.Load(), next.requests.Load(), body)
			}
			if limit == 1 && resp.Header.Get("X-Kvproxy-Worker") != "next" {
				t.Fatalf("answered by %q", resp.Header.Get("X-Kvproxy-Worker"))
			}
			p.waitIdle(t)
		}
	}
}

// requestLine is the access log's last request line, decoded.
func requestLine(t *testing.T, logs string) map[string]any {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(logs), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		var m map[string]any
		if json.Unmarshal([]byte(lines[i]), &m) == nil && m["message"] == "request" {
			return m
		}
	}
	t.Fatalf("no request line in:\n%s", logs)
	return nil
}

// A stream moving when the drain deadline comes (its new engine still
// computing the prompt) is cut as the streams still running are: the
// shutting_down error event and [DONE], counted in flight and cut.
func TestStreamMovingAtTheDrainDeadlineIsCut(t *testing.T) {
	dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 3 })
	next := startFake(t, "next", func(f *fakeEngine) { f.prefillDelay = 30 * time.Second })
	p := startProxyYAML(t, fmt.Sprintf(migrateYAML, "vllm", 1), dies, next)
	done := make(chan string, 1)
	go func() {
		_, body := post(t, p.url+"/v1/chat/completions", migrateBody)
		done <- string(body)
	}()
	waitFor(t, "the continuation to reach the next engine", func() bool { return next.requests.Load() == 1 })
	// What kvproxy does at SIGTERM: drain, and cut what is left at the
	// deadline.
	drained := make(chan struct{})
	go func() {
		p.s.Shutdown()
		close(drained)
	}()
	if n := p.s.InFlight(); n != 1 {
		t.Fatalf("in flight while draining: %d, want the moving stream", n)
	}
	if n := p.s.Cut(); n != 1 {
		t.Fatalf("cut %d requests, want the moving stream", n)
	}
	select {
	case <-drained:
	case <-time.After(5 * time.Second):
		t.Fatal("the drain did not end after the cut")
	}
	select {
	case got := <-done:
		if !strings.Contains(got, `"code":"shutting_down"`) || !strings.HasSuffix(got, "data: [DONE]\n\n") || strings.Count(got, `"content":"t`) != 3 {
			t.Fatalf("stream:\n%s", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the stream did not end")
	}
}

// A reload that rebuilds the model's pool (a new router: its block size
// changed) while a stream runs: the stream still moves, on the new pool.
func TestStreamMovesAfterItsPoolWasRebuilt(t *testing.T) {
	dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 10, 3, 20*time.Second })
	next := startFake(t, "next", func(f *fakeEngine) { f.tokens = 7 })
	yaml := fmt.Sprintf(migrateYAML, "vllm", 1) + "  stream_idle_timeout: 500ms\n"
	p := startProxyYAML(t, yaml, dies, next)
	done := make(chan string, 1)
	go func() {
		_, body := post(t, p.url+"/v1/chat/completions", migrateBody)
		done <- string(body)
	}()
	waitFor(t, "the stream to start", func() bool { return dies.requests.Load() == 1 })
	yaml = strings.NewReplacer("{{e0}}", dies.addr, "{{e1}}", next.addr, "models: [{name: m}]", "models: [{name: m, block_size: 32}]").Replace(yaml)
	p.reloadYAML(t, yaml)
	got := <-done
	if strings.Contains(got, "error") || strings.Count(got, `"content":"t`) != 10 || next.requests.Load() != 1 {
		t.Fatalf("stream:\n%s\nlog:\n%s", got, p.logs.String())
	}
	p.waitIdle(t)
}

// emitted counts the output carried over by the model's tokenizer when an
// engine sent several tokens a chunk.
func TestEmittedCountsTokensNotChunks(t *testing.T) {
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e, url: 'http://127.0.0.1:9', model: m}]\n")
	x := &exchange{p: p.s.st.Load().models["m"], outputTokens: 2}
	m := &migration{partial: []byte(` the river runs to the sea, and the sea \"is\" wide`)}
	if n := m.emitted(x); n < 12 {
		t.Fatalf("emitted %d for 2 chunks of 12+ tokens", n)
	}
	x.outputTokens = 40
	if n := m.emitted(x); n != 40 {
		t.Fatalf("emitted %d, want the 40 chunks", n)
	}
}

// A client that leaves while its stream moves (the new engine still
// computing the prompt): a 499, the new engine's request aborted, nothing
// held, and no failed migration counted.
func TestClientLeavingWhileItsStreamMoves(t *testing.T) {
	dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 3 })
	next := startFake(t, "next", func(f *fakeEngine) { f.prefillDelay = 30 * time.Second })
	p := startProxyYAML(t, fmt.Sprintf(migrateYAML, "vllm", 1), dies, next)
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(migrateBody), migrateBody)
	waitFor(t, "the continuation to reach the next engine", func() bool { return next.requests.Load() == 1 })
	c.Close()
	waitFor(t, "the next engine's request to be aborted", func() bool { return next.aborted.Load() == 1 })
	p.waitIdle(t)
	waitFor(t, "the request line", func() bool { return strings.Contains(p.logs.String(), `"message":"request"`) })
	if line := requestLine(t, p.logs.String()); line["status"] != 499.0 || line["backend"] != "dies" {
		t.Fatalf("request line %v", line)
	}
	if m := p.metrics(t); strings.Contains(m, `result="failed"`) {
		t.Fatalf("a client's hang-up counted as a failed migration:\n%s", m)
	}
}

// A decode engine that takes a request with a disaggregated prefill's KV
// and drops it: the next decode engine is sent the request without that
// KV (the first may have pulled and freed it), and computes the prompt.
func TestResentRequestDropsThePrefillsKV(t *testing.T) {
	pre := startFake(t, "pre", nil)
	dec1 := startFake(t, "dec1", func(f *fakeEngine) { f.dropRequests = true })
	dec2 := startFake(t, "dec2", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends:\n"+
		"  - {id: pre, url: 'http://{{e0}}', model: m, role: prefill}\n"+
		"  - {id: dec1, url: 'http://{{e1}}', model: m, kind: vllm}\n"+
		"  - {id: dec2, url: 'http://{{e2}}', model: m, kind: vllm}\n"+
		"router: {policy: round_robin}\nlimits: {migration_limit: 1}\n", pre, dec1, dec2)
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello there"}]}`)
	if resp.StatusCode != 200 || pre.requests.Load() != 1 || dec1.requests.Load() != 1 || dec2.requests.Load() != 1 {
		t.Fatalf("status %d (requests pre %d dec1 %d dec2 %d): %s", resp.StatusCode, pre.requests.Load(), dec1.requests.Load(), dec2.requests.Load(), body)
	}
	dec1.mu.Lock()
	first := dec1.bodies[0]["kv_transfer_params"]
	dec1.mu.Unlock()
	if first == nil {
		t.Fatal("the first decode engine got no kv_transfer_params: the test sets nothing up")
	}
	if kvp := dec2.lastBody()["kv_transfer_params"]; kvp != nil {
		t.Fatalf("the second decode engine was sent the first's KV: %v", kvp)
	}
	p.waitIdle(t)
}

// A continuation whose engine refuses the connection spends a retry, not
// the migration: the stream moves on to the next engine (the README
// trial: an engine down took migration_limit 1, with four others well).
func TestMigrationPastAnEngineThatIsDown(t *testing.T) {
	dies, down := startMigrationPastDown(t)
	next := startFake(t, "next", nil)
	p := startProxyYAML(t, `models: [{name: m}]
backends:
  - {id: dies, url: 'http://{{e0}}', model: m, served_model: engine-m}
  - {id: down, url: 'http://{{e1}}', model: m, served_model: engine-m, kind: vllm}
  - {id: next, url: 'http://{{e2}}', model: m, served_model: engine-m, kind: vllm}
router: {policy: round_robin}
limits: {migration_limit: 1}
`, dies, down, next)
	_, body := post(t, p.url+"/v1/chat/completions", migrateBody)
	got := string(body)
	if strings.Contains(got, `"error"`) || strings.Count(got, `"content":"t`) <= 3 || !strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Fatalf("stream:\n%s", got)
	}
	p.waitIdle(t)
	if logs := p.logs.String(); !strings.Contains(logs, `"to":"next"`) || !strings.Contains(logs, `"backend":"down","reason":"connect:`) {
		t.Fatalf("the log does not show the move past the engine that is down:\n%s", p.logs.String())
	}
}

// The retry a continuation refused a connection spent is given back when
// no engine is left to try: none was made.
func TestMigrationRefundsTheRetryNoEngineTook(t *testing.T) {
	dies, down := startMigrationPastDown(t)
	p := startProxyYAML(t, `models: [{name: m}]
backends:
  - {id: dies, url: 'http://{{e0}}', model: m, served_model: engine-m}
  - {id: down, url: 'http://{{e1}}', model: m, served_model: engine-m, kind: vllm}
router: {policy: round_robin}
limits: {migration_limit: 1, retry_budget: 0.2}
`, dies, down)
	// One retry in the budget, and no time to earn more.
	b := p.s.retries
	b.mu.Lock()
	b.balance, b.last = 1, time.Now().Add(time.Hour)
	b.mu.Unlock()
	_, body := post(t, p.url+"/v1/chat/completions", migrateBody)
	if !strings.Contains(string(body), `"error"`) {
		t.Fatalf("the stream ended well with no engine to continue it:\n%s", body)
	}
	p.waitIdle(t)
	if logs := p.logs.String(); !strings.Contains(logs, `"backend":"down","reason":"connect:`) {
		t.Fatalf("the continuation did not meet the engine that is down:\n%s", logs)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.balance < 1 {
		t.Fatalf("retry budget %.2f after the retry no engine took, want it back (1 and the request's 0.2)", b.balance)
	}
}

// startMigrationPastDown starts an engine whose stream dies after 3 of 10
// tokens, and gives an engine that refuses connections (its port closed).
func startMigrationPastDown(t *testing.T) (dies, down *fakeEngine) {
	t.Helper()
	dies = startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 3 })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down = &fakeEngine{id: "down", addr: ln.Addr().String()}
	ln.Close() // refuses connections
	return dies, down
}

// An engine's error frame ends its stream as before when the stream cannot
// move: the client gets the frame and one [DONE]; and a frame that blames
// the request (vLLM's BadRequestError) is passed on, not moved.
func TestErrorFrameOfAStreamThatDoesNotMove(t *testing.T) {
	const refused = `{"error":{"message":"guided decoding failed","type":"BadRequestError","param":null,"code":400}}`
	for _, c := range []struct {
		name, kind, frame, says string
		moves                   int64
	}{
		{"no engine can continue it", "openai", engineCoreDied, "EngineCore encountered an issue.", 0},
		{"the request's fault", "vllm", refused, "guided decoding failed", 0},
	} {
		dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.errorAfter, f.errorFrame = 10, 3, c.frame })
		next := startFake(t, "next", nil)
		p := startProxyYAML(t, fmt.Sprintf(migrateYAML, c.kind, 1), dies, next)
		_, body := post(t, p.url+"/v1/chat/completions", migrateBody)
		got := string(body)
		if !strings.Contains(got, c.says) || strings.Count(got, "data: [DONE]") != 1 || !strings.HasSuffix(got, "data: [DONE]\n\n") ||
			strings.Count(got, `"content":"t`) != 3 || next.requests.Load() != c.moves {
			t.Fatalf("%s: %d requests moved, stream:\n%s", c.name, next.requests.Load(), got)
		}
		p.waitIdle(t)
	}
}

// A stream that fails again once its moves are spent counts as a failed
// migration, whether its engine drops it or says it failed: only its move
// was counted, as ok (the reviews).
func TestStreamFailingPastItsMovesIsCounted(t *testing.T) {
	for _, c := range []struct {
		name  string
		fails func(*fakeEngine)
	}{
		{"drops its connection", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 2 }},
		{"says it failed", func(f *fakeEngine) { f.tokens, f.errorAfter, f.errorFrame = 10, 2, engineCoreDied }},
	} {
		dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 3 })
		dies2 := startFake(t, "dies2", c.fails)
		p := startProxyYAML(t, `models: [{name: m}]
backends:
  - {id: dies, url: 'http://{{e0}}', model: m, served_model: engine-m}
  - {id: dies2, url: 'http://{{e1}}', model: m, served_model: engine-m, kind: vllm}
router: {policy: round_robin}
limits: {migration_limit: 1}
`, dies, dies2)
		_, body := post(t, p.url+"/v1/chat/completions", strings.Replace(migrateBody, `"max_tokens":10`, `"max_tokens":100`, 1))
		if !strings.Contains(string(body), `"error"`) || strings.Count(string(body), "data: [DONE]") != 1 {
			t.Fatalf("%s: stream:\n%s", c.name, body)
		}
		p.waitIdle(t)
		m := p.metrics(t)
		for _, want := range []string{`kvproxy_stream_migrations_total{backend="dies",result="ok"} 1`, `kvproxy_stream_migrations_total{backend="dies2",result="failed"} 1`} {
			if !strings.Contains(m, want) {
				t.Fatalf("%s: no %s in:\n%s", c.name, want, grepLines(m, "kvproxy_stream_migrations_total{"))
			}
		}
	}
}

// engineCoreDied is the error event vLLM sends when its engine core dies.
const engineCoreDied = `{"error":{"message":"EngineCore encountered an issue.","type":"InternalServerError","param":null,"code":500}}`

// sseEngine is an engine that answers every request with the events of
// send, flushed as it writes them.
func sseEngine(t *testing.T, send func(w io.Writer, flush func())) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		send(w, w.(http.Flusher).Flush)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// An engine's error event as a stream's very first, on a stream that
// cannot move: the client gets it, as a stream, and one [DONE]. Held for a
// move, it was answered as a 200 with a JSON error of kvproxy's (the
// twenty-ninth session's second review).
func TestErrorFrameFirstOfAStreamThatCannotMove(t *testing.T) {
	addr := sseEngine(t, func(w io.Writer, flush func()) { fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", engineCoreDied) })
	p := serveYAML(t, "models: [{name: m}]\nbackends:\n  - {id: dies, url: 'http://"+addr+"', model: m, served_model: engine-m, kind: vllm}\nlimits: {migration_limit: 1}\n", true)
	for path, body := range map[string]string{"/v1/chat/completions": migrateBody, "/v1/completions": `{"model":"m","stream":true,"max_tokens":10,"prompt":"hi"}`} {
		resp, b := post(t, p.url+path, body)
		if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") ||
			!strings.Contains(string(b), "EngineCore encountered an issue.") || strings.Count(string(b), "data: [DONE]") != 1 {
			t.Fatalf("%s: %d %s %s", path, resp.StatusCode, resp.Header.Get("Content-Type"), b)
		}
	}
	p.waitIdle(t)
}

// An engine's error event that ends its body, without its blank line:
// moved as any other (it was taken for a stream ended without [DONE], and
// the next engine's first read found it still held and moved again), or
// passed on when it cannot move (the second review).
func TestErrorFrameEndingTheBody(t *testing.T) {
	addr := sseEngine(t, func(w io.Writer, flush func()) {
		for i := range 3 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d \"}}]}\n\n", i)
			flush()
		}
		time.Sleep(20 * time.Millisecond)
		fmt.Fprintf(w, "data: %s\n", engineCoreDied) // the body ends there
	})
	next := startFake(t, "next", func(f *fakeEngine) { f.tokens = 7 })
	p := serveYAML(t, "models: [{name: m}]\nbackends:\n  - {id: dies, url: 'http://"+addr+"', model: m, served_model: engine-m}\n"+
		"  - {id: next, url: 'http://"+next.addr+"', model: m, served_model: engine-m, kind: vllm}\nrouter: {policy: round_robin}\nlimits: {migration_limit: 2}\n", true)
	if _, body := post(t, p.url+"/v1/chat/completions", migrateBody); strings.Contains(string(body), "error") || next.requests.Load() != 1 {
		t.Fatalf("%d continuations, stream:\n%s", next.requests.Load(), body)
	}
	p.waitIdle(t)

	alone := serveYAML(t, "models: [{name: m}]\nbackends:\n  - {id: dies, url: 'http://"+addr+"', model: m, served_model: engine-m, kind: vllm}\nlimits: {migration_limit: 1}\n", true)
	if _, body := post(t, alone.url+"/v1/chat/completions", migrateBody); !strings.Contains(string(body), "EngineCore encountered an issue.") {
		t.Fatalf("not moved, the engine's event is lost:\n%s", body)
	}
	alone.waitIdle(t)
}

// A stream moved for its engine's error event logs the event's kind, never
// its message, which may quote the prompt (the third review: the "stream
// migrated" line had it).
func TestMovedErrorEventKeepsItsMessageOutOfTheLog(t *testing.T) {
	const frame = `{"error":{"message":"EngineCore failed on input (value=MY SECRET PROMPT)","type":"InternalServerError","param":null,"code":500}}`
	addr := sseEngine(t, func(w io.Writer, flush func()) {
		fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t0 \"}}]}\n\n")
		flush()
		fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", frame)
	})
	next := startFake(t, "next", func(f *fakeEngine) { f.tokens = 7 })
	p := serveYAML(t, "models: [{name: m}]\nbackends:\n  - {id: dies, url: 'http://"+addr+"', model: m, served_model: engine-m}\n"+
		"  - {id: next, url: 'http://"+next.addr+"', model: m, served_model: engine-m, kind: vllm}\nrouter: {policy: round_robin}\nlimits: {migration_limit: 1}\n", true)
	_, body := post(t, p.url+"/v1/chat/completions", migrateBody)
	p.waitIdle(t)
	if next.requests.Load() != 1 {
		t.Fatalf("not moved: %s", body)
	}
	if logs := p.logs.String(); strings.Contains(logs, "SECRET") || !strings.Contains(logs, `"reason":"sent an error event (type server_error`) {
		t.Fatalf("the log:\n%s", grepLines(logs, "migrat"))
	}
}

// A stream whose engine takes it and sends nothing, not even its headers,
// for stream_idle_timeout is sent whole to another engine within
// migration_limit: nothing reached the client (the chaos trial: a stopped
// engine's streams got 504s, while those it had begun moved). Without the
// limit it is a 504, as before.
func TestStreamStuckBeforeItsHeadersIsResent(t *testing.T) {
	for _, limit := range []int{1, 0} {
		stuck := startFake(t, "dies", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
		next := startFake(t, "next", func(f *fakeEngine) { f.tokens = 7 })
		p := startProxyYAML(t, fmt.Sprintf(migrateYAML, "vllm", limit)+"  stream_idle_timeout: 300ms\n", stuck, next)
		resp, body := post(t, p.url+"/v1/chat/completions", migrateBody)
		got := string(body)
		if limit == 0 {
			if resp.StatusCode != 504 || stuck.requests.Load() != 1 || next.requests.Load() != 0 {
				t.Fatalf("without migration: %d, requests %d and %d\n%s", resp.StatusCode, stuck.requests.Load(), next.requests.Load(), got)
			}
		} else if resp.StatusCode != 200 || strings.Contains(got, "error") || !strings.HasSuffix(got, "data: [DONE]\n\n") ||
			strings.Count(got, `"content":"t`) != 7 || stuck.requests.Load() != 1 || next.requests.Load() != 1 || resp.Header.Get("X-Kvproxy-Worker") != "next" {
			t.Fatalf("%d, requests %d and %d, worker %q\n%s", resp.StatusCode, stuck.requests.Load(), next.requests.Load(), resp.Header.Get("X-Kvproxy-Worker"), got)
		}
		p.waitIdle(t)
	}
}

// So is one cut because its engine's health probe failed while it held
// the stream's headers back: the next engine's attempt is not cut with it.
func TestStreamCutBeforeItsHeadersByAFailingProbeIsResent(t *testing.T) {
	stuck := startFake(t, "dies", func(f *fakeEngine) { f.prefillDelay = 30 * time.Second })
	next := startFake(t, "next", func(f *fakeEngine) { f.tokens = 7 })
	yaml := strings.NewReplacer("{{e0}}", stuck.addr, "{{e1}}", next.addr).Replace(fmt.Sprintf(migrateYAML, "vllm", 1) +
		"  stream_idle_timeout: 60s\nhealth: {interval: 200ms, timeout: 100ms, fall: 2}\n")
	p := serveYAML(t, yaml, false)
	go func() {
		waitFor(t, "the stream at the stuck engine", func() bool { return stuck.requests.Load() == 1 })
		stuck.unhealthy.Store(true)
	}()
	start := time.Now()
	resp, body := post(t, p.url+"/v1/chat/completions", migrateBody)
	got := string(body)
	if resp.StatusCode != 200 || strings.Contains(got, "error") || strings.Count(got, `"content":"t`) != 7 || next.requests.Load() != 1 ||
		time.Since(start) > 10*time.Second {
		t.Fatalf("after %v: %d, requests %d and %d\n%s", time.Since(start), resp.StatusCode, stuck.requests.Load(), next.requests.Load(), got)
	}
	p.waitIdle(t)
	if l := p.logs.String(); !strings.Contains(l, `"retried_after":"backend dies sent nothing`) {
		t.Fatalf("log: %s", l)
	}
}

// A stream whose first event is over 1 MiB (the relay's buffer grew for
// it, and was charged; its output short, as a first chunk with prompt
// logprobs) and whose engine then dies moves with that buffer:
// the charge goes with it, and is given back when the moved stream ends
// (a framer made anew kept the charge for good: the review).
func TestLargeEventThenMoveGivesBackItsRoom(t *testing.T) {
	big := strings.Repeat("x", 3<<20)
	dies := rawEngine(t, func(c net.Conn, _ *bufio.Reader) {
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"+
			"data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"engine-m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":null}],\"pad\":\"%s\"}\n\n", big)
		time.Sleep(100 * time.Millisecond) // then the connection drops
	})
	next := startFake(t, "next", func(f *fakeEngine) { f.tokens = 7 })
	p := startProxyYAML(t, fmt.Sprintf(migrateYAML, "vllm", 1), dies, next)
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if got := string(body); resp.StatusCode != 200 || strings.Contains(got, "error") || next.requests.Load() != 1 || !strings.Contains(got, big) {
		t.Fatalf("%d, %d bytes, next %d requests: %.300s", resp.StatusCode, len(body), next.requests.Load(), got[max(0, len(got)-300):])
	}
	p.waitIdle(t)
	if used := p.s.bodyMem.Used(); used != 0 {
		t.Fatalf("%d bytes still charged after the moved stream ended", used)
	}
}

// A stream that has relayed more output than maxMovedOutput is not moved,
// and keeps none of it: what it relayed stayed in memory, uncounted, for
// the stream's whole life (the chaos trial: 8 streams of 100 MB held 1.7
// GB with migration_limit on).
func TestLongAnswerIsNotKeptForAMove(t *testing.T) {
	m := &migration{chat: true}
	piece := []byte(`"` + strings.Repeat("x", 64<<10) + `"`)
	for range maxMovedOutput / (64 << 10) {
		m.note(nil, 0, piece)
	}
	if m.off || len(m.partial) != maxMovedOutput {
		t.Fatalf("at the bound: off %v, %d kept", m.off, len(m.partial))
	}
	m.note(nil, 0, piece)
	if !m.off || m.partial != nil {
		t.Fatalf("past the bound: off %v, %d kept", m.off, len(m.partial))
	}
}

// An engine that sends nothing but comments (pings: a hung generation
// while sse-starlette's ping task goes on) for stream_idle_timeout is
// silent: with nowhere to move the stream, the client gets the timeout's
// error event and [DONE], the engine's connection is closed and the slot
// freed. The pings before that reach the client.
func TestStreamOfPingsOnlyTimesOut(t *testing.T) {
	e := startFake(t, "pings", func(f *fakeEngine) {
		f.tokens, f.pauseAfter, f.pause, f.pingEvery = 10, 3, 30*time.Second, 40*time.Millisecond
	})
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: pings, url: 'http://{{e0}}', model: m}]\nlimits: {stream_idle_timeout: 400ms}\n", e)
	t0 := time.Now()
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	got := string(body)
	if resp.StatusCode != 200 || strings.Count(got, `"content":"t`) != 3 || !strings.Contains(got, ": ping - ") ||
		!strings.Contains(got, `sent only SSE comments for 400ms (limits.stream_idle_timeout)`) || !strings.Contains(got, `"code":"backend_timeout"`) ||
		!strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Fatalf("status %d, stream:\n%s", resp.StatusCode, got)
	}
	if d := time.Since(t0); d > 10*time.Second {
		t.Fatalf("the stream ended %v after it began, its engine pinging for 30 s", d)
	}
	p.waitIdle(t)
	for deadline := time.Now().Add(5 * time.Second); e.aborted.Load() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the pinging engine's request was not cut")
		}
	}
}

// An event that comes in pieces for longer than stream_idle_timeout is no
// silence: the stream is relayed whole.
func TestSlowLargeEventIsNotSilence(t *testing.T) {
	h := func(w http.ResponseWriter, fl http.Flusher, r *http.Request) {
		io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n")
		io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"content":"`)
		fl.Flush()
		for range 12 {
			time.Sleep(100 * time.Millisecond)
			io.WriteString(w, strings.Repeat("x", 1000))
			fl.Flush()
		}
		io.WriteString(w, "\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n")
	}
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: slow, url: 'http://"+streamEngine(t, h)+"', model: m}]\nlimits: {stream_idle_timeout: 400ms}\n")
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if got := string(body); resp.StatusCode != 200 || strings.Contains(got, "error") || strings.Count(got, strings.Repeat("x", 12000)) != 1 || !strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Fatalf("status %d, %d bytes, stream:\n%.300s\n...%s", resp.StatusCode, len(got), got, got[max(0, len(got)-400):])
	}
	p.waitIdle(t)
}

// A stream moved after its engine went silent gives the next engine its own
// stream_idle_timeout: its first bytes, a ping or half an event, are not
// taken for the silence of the engine before it (the review: the healthy
// engine was cut at once and ejected).
func TestMovedStreamCountsSilenceAnew(t *testing.T) {
	for _, first := range []string{"ping", "split event"} {
		t.Run(first, func(t *testing.T) {
			dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 10, 3, 20*time.Second })
			next := &fakeEngine{addr: streamEngine(t, func(w http.ResponseWriter, fl http.Flusher, r *http.Request) {
				if first == "ping" {
					io.WriteString(w, ": ping\n\n")
					fl.Flush()
					time.Sleep(50 * time.Millisecond)
					io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`+"\n\n")
				} else {
					io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"role":"assis`)
					fl.Flush()
					time.Sleep(50 * time.Millisecond)
					io.WriteString(w, `tant","content":""}}]}`+"\n\n")
				}
				for i := 3; i < 10; i++ {
					fmt.Fprintf(w, `data: {"choices":[{"index":0,"delta":{"content":"t%d "}}]}`+"\n\n", i)
				}
				io.WriteString(w, `data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
			})}
			p := startProxyYAML(t, fmt.Sprintf(migrateYAML, "vllm", 1)+"  stream_idle_timeout: 300ms\n", dies, next)
			resp, body := post(t, p.url+"/v1/chat/completions", migrateBody)
			if got := string(body); resp.StatusCode != 200 || strings.Contains(got, "error") || strings.Count(got, `"content":"t`) != 10 {
				t.Fatalf("status %d, stream:\n%s", resp.StatusCode, got)
			}
			p.waitIdle(t)
			if ejected(p, "next") {
				t.Fatal("the engine the stream moved to is ejected")
			}
		})
	}
}

// Once a stream can no longer move (more than maxMovedOutput relayed), the
// copy of its request kept for a move is let go, and its share of
// limits.body_memory_mb given back, while the stream goes on.
func TestMigrationCopyLetGoOnceItCannotMove(t *testing.T) {
	more, end := make(chan struct{}), make(chan struct{})
	letMore, letEnd := sync.OnceFunc(func() { close(more) }), sync.OnceFunc(func() { close(end) })
	h := func(w http.ResponseWriter, fl http.Flusher, r *http.Request) {
		io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`+"\n\n")
		fl.Flush()
		<-more
		for range 12 {
			io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"content":"`+strings.Repeat("y", 100_000)+`"}}]}`+"\n\n")
		}
		fl.Flush()
		<-end
		io.WriteString(w, `data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
	}
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://"+streamEngine(t, h)+"', model: m}]\nlimits: {migration_limit: 1}\n")
	t.Cleanup(func() { letMore(); letEnd() }) // before the proxy's: a failure leaves no stream waiting
	body := `{"model":"m","stream":true,"user":"` + strings.Repeat("u", 3<<20) + `","messages":[{"role":"user","content":"hi"}]}`
	done := make(chan string, 1)
	go func() {
		resp, b := post(t, p.url+"/v1/chat/completions", body)
		done <- fmt.Sprint(resp.StatusCode, " ", len(b))
	}()
	settled := func(cond func(int64) bool) int64 {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if u := p.s.bodyMem.Used(); cond(u) || time.Now().After(deadline) {
				return u
			}
		}
	}
	before := settled(func(u int64) bool { return u >= 6<<20 }) // the body, and the copy for a move
	letMore()
	after := settled(func(u int64) bool { return u <= before-3<<20 })
	if after > before-3<<20 {
		t.Fatalf("%d bytes charged once the stream could no longer move, %d before", after, before)
	}
	letEnd()
	if got := <-done; !strings.HasPrefix(got, "200 ") {
		t.Fatal(got)
	}
	p.waitIdle(t)
}

// An engine that sends pings and nothing else failed before its first
// event, as one silent from the start did: pings are no event of the answer.
func TestStreamOfPingsFromTheStart(t *testing.T) {
	h := func(w http.ResponseWriter, fl http.Flusher, r *http.Request) {
		for {
			if _, err := io.WriteString(w, ": ping\n\n"); err != nil {
				return
			}
			fl.Flush()
			select {
			case <-r.Context().Done():
				return
			case <-time.After(40 * time.Millisecond):
			}
		}
	}
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: pings, url: 'http://"+streamEngine(t, h)+"', model: m}]\nlimits: {stream_idle_timeout: 300ms}\n")
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if got := string(body); resp.StatusCode != 200 || !strings.Contains(got, "went silent before its first event: backend pings sent only SSE comments") {
		t.Fatalf("status %d, stream:\n%s", resp.StatusCode, got)
	}
	p.waitIdle(t)
}

// streamEngine is an engine whose completions answer is the event stream
// send writes (its probes get "ok"); its address.
func streamEngine(t *testing.T, send func(w http.ResponseWriter, fl http.Flusher, r *http.Request)) string {
	return startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "completions") {
			w.Write([]byte("ok"))
			return
		}
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		send(w, w.(http.Flusher), r)
	})
}
