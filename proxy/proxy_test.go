package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/internal/testutil"
)

// fakeEngine is an OpenAI-compatible server on a real loopback socket whose
// behaviour each test sets. It records what it received.
type fakeEngine struct {
	id       string
	srv      *http.Server
	addr     string
	mu       sync.Mutex
	bodies   []map[string]any
	ids      []string // X-Request-Id of each request
	paths    []string // the path of each request
	headers  []http.Header
	aborted  atomic.Int64
	requests atomic.Int64
	current  atomic.Int64
	peak     atomic.Int64
	// behaviour
	prefillDelay time.Duration
	tokens       int
	pauseAfter   int           // stream: stop after this many tokens for pause
	pause        time.Duration // ...
	pingEvery    time.Duration // ... sending a comment this often meanwhile, as sse-starlette does
	dieAfter     int           // stream: drop the connection after this many tokens
	dropRequests bool          // drop the connection once a completion request is read, unanswered
	errorAfter   int           // stream: send an error frame after this many tokens
	errorFrame   string        // ... this one (default: older vLLM's flat one, compact)
	status       int           // non-200 answer
	errBody      string
	retryAfter   string        // Retry-After of the non-200 answer
	modelList    string        // GET /v1/models (default: the base model alone); not recorded
	modelsDelay  time.Duration // before answering GET /v1/models
	notServed    string        // a model it answers vLLM's 404 for (under mu)
	tokenEvery   time.Duration // stream: between tokens
	forceUsage   bool          // stream: the usage chunk unasked (vLLM --enable-force-include-usage)
	unhealthy    atomic.Bool   // GET /health answers 503
	probes       atomic.Int64  // GET /health asked
	metricsPage  string        // GET /metrics (under mu; "": 404); not recorded
}

func startFake(t *testing.T, id string, setup func(*fakeEngine)) *fakeEngine {
	t.Helper()
	f := &fakeEngine{id: id, tokens: 5}
	if setup != nil {
		setup(f)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.addr = ln.Addr().String()
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {
		f.probes.Add(1)
		if f.unhealthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok"))
	})
	mux.HandleFunc("/v1/", f.serve)
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		page := f.metricsPage
		f.mu.Unlock()
		if page == "" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(page))
	})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(f.modelsDelay)
		list := f.modelList
		if list == "" {
			list = `{"object":"list","data":[{"id":"engine-m","object":"model","root":"engine-m","parent":null}]}`
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(list))
	})
	for path := range passthroughPaths {
		if !strings.HasPrefix(path, "/v1/") {
			mux.HandleFunc(path, f.serve)
		}
	}
	f.srv = &http.Server{Handler: mux}
	go f.srv.Serve(ln)
	t.Cleanup(func() { f.srv.Close() })
	return f
}

func (f *fakeEngine) serve(w http.ResponseWriter, r *http.Request) {
	f.requests.Add(1)
	if c := f.current.Add(1); c > f.peak.Load() {
		f.peak.Store(c)
	}
	defer f.current.Add(-1)
	var body map[string]any
	json.NewDecoder(r.Body).Decode(&body)
	f.mu.Lock()
	f.bodies = append(f.bodies, body)
	f.ids = append(f.ids, r.Header.Get("X-Request-Id"))
	f.paths = append(f.paths, r.URL.Path)
	f.headers = append(f.headers, r.Header.Clone())
	f.mu.Unlock()
	f.mu.Lock()
	notServed := f.notServed
	f.mu.Unlock()
	if notServed != "" && body["model"] == notServed {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprintf(w, `{"error":{"message":"The model %s does not exist.","type":"NotFoundError","param":"model","code":404}}`, notServed)
		return
	}
	if f.dropRequests && strings.HasSuffix(r.URL.Path, "completions") {
		hj, _ := w.(http.Hijacker)
		c, _, _ := hj.Hijack()
		c.Close()
		return
	}
	if f.status != 0 {
		if f.retryAfter != "" {
			w.Header().Set("Retry-After", f.retryAfter)
		}
		w.WriteHeader(f.status)
		w.Write([]byte(f.errBody))
		return
	}
	select {
	case <-time.After(f.prefillDelay):
	case <-r.Context().Done():
		f.aborted.Add(1)
		return
	}
	if stream, _ := body["stream"].(bool); stream && strings.HasSuffix(r.URL.Path, "/messages") {
		w.Header().Set("Content-Type", "text/event-stream")
		for _, ev := range []string{"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"} {
			fmt.Fprintf(w, "event: %s\ndata: {\"type\":%q}\n\n", ev, ev)
		}
		return
	}
	if !strings.HasSuffix(r.URL.Path, "completions") {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","path":%q,"model":%q,"served_by":%q}`, r.URL.Path, body["model"], f.id)
		return
	}
	stream, _ := body["stream"].(bool)
	if !stream {
		extra := ""
		if kvp, _ := body["kv_transfer_params"].(map[string]any); kvp["do_remote_decode"] == true {
			// A disaggregated prefill, as vLLM's NixlConnector answers it.
			extra = fmt.Sprintf(`,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":%q,"remote_block_ids":[1,2,3],"remote_host":"127.0.0.1","remote_port":5600}`, f.id)
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"x","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":3}},"served_by":%q%s}`, body["model"], f.id, extra)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n")
	fl.Flush()
	for i := 0; i < f.tokens; i++ {
		if f.dieAfter > 0 && i == f.dieAfter {
			hj, _ := w.(http.Hijacker)
			c, _, _ := hj.Hijack()
			c.Close()
			return
		}
		if f.errorAfter > 0 && i == f.errorAfter {
			frame := f.errorFrame
			if frame == "" {
				frame = `{"object":"error","message":"CUDA out of memory","type":"InternalServerError","param":null,"code":500}`
			}
			fmt.Fprintf(w, "data: %s\n\n", frame)
			fmt.Fprintf(w, "data: [DONE]\n\n")
			fl.Flush()
			return
		}
		if f.pauseAfter > 0 && i == f.pauseAfter {
			var ping <-chan time.Time
			if f.pingEvery > 0 {
				tick := time.NewTicker(f.pingEvery)
				defer tick.Stop()
				ping = tick.C
			}
		paused:
			for end := time.After(f.pause); ; {
				select {
				case <-end:
					break paused
				case <-ping:
					fmt.Fprintf(w, ": ping - %s\n\n", time.Now().UTC().Format(time.RFC3339))
					fl.Flush()
				case <-r.Context().Done():
					f.aborted.Add(1)
					return
				}
			}
		}
		fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d \"}}]}\n\n", i)
		fl.Flush()
		time.Sleep(f.tokenEvery)
	}
	if so, _ := body["stream_options"].(map[string]any); so["include_usage"] == true || f.forceUsage {
		// Two tokens a chunk, as vLLM's --stream-interval 2 sends them.
		fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":%d,\"total_tokens\":%d,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n", 2*f.tokens, 10+2*f.tokens)
	}
	fmt.Fprintf(w, "data: [DONE]\n\n")
	fl.Flush()
}

func (f *fakeEngine) lastBody() map[string]any {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.bodies) == 0 {
		return nil
	}
	return f.bodies[len(f.bodies)-1]
}

type testProxy struct {
	s    *Server
	url  string
	logs *syncBuffer
}

// syncBuffer is the log sink the tests read while servers write.
type syncBuffer = testutil.SyncBuffer

func startProxy(t *testing.T, policy string, engines ...*fakeEngine) *testProxy {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "models:\n  - name: m\n    aliases: [alias-m]\n    tokenizer: cl100k_base\n    template: chatml\n    block_size: 16\n")
	fmt.Fprintf(&b, "backends:\n")
	for i, e := range engines {
		fmt.Fprintf(&b, "  - {id: %s, url: 'http://{{e%d}}', model: m, served_model: engine-m}\n", e.id, i)
	}
	fmt.Fprintf(&b, "router: {policy: %s}\nlimits: {max_request_body_bytes: 65536}\n", policy)
	return startProxyYAML(t, b.String(), engines...)
}

// waitIdle waits until every load counter is zero: Free runs just after the
// client has its last byte, so it is awaited, not assumed.
func (p *testProxy) waitIdle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	// InFlight too: a request frees its slots before it writes its access
	// line and counts itself in the metrics, and only then leaves it.
	for !p.s.Idle() || p.s.InFlight() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("load counters not zero (%d in flight): %+v", p.s.InFlight(), p.s.backendRows(p.s.st.Load()))
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// rawCompletion opens a raw connection to the proxy and sends one
// /v1/completions request with body on it, leaving the answer unread: for
// tests that hang up mid-request.
func rawCompletion(t *testing.T, p *testProxy, body string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	return c
}

func post(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

const chatBody = `{"model":"alias-m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hi to the whole wide world, please, in many words."}],"temperature":0.5,"x_vendor_param":{"k":1},"nvext":{"annotations":[]}}`

func TestNonStreamingForwardsAndRewrites(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	resp, body := post(t, p.url+"/v1/chat/completions", chatBody)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if got := resp.Header.Get(WorkerHeader); got != "e0" {
		t.Fatalf("worker header %q", got)
	}
	if !bytes.Contains(body, []byte(`"served_by":"e0"`)) {
		t.Fatalf("body not relayed: %s", body)
	}
	fwd := e.lastBody()
	if fwd["model"] != "engine-m" {
		t.Fatalf("model not rewritten to the served name: %v", fwd["model"])
	}
	if _, ok := fwd["nvext"]; ok {
		t.Fatal("nvext must be stripped before forwarding")
	}
	if fwd["temperature"] != 0.5 || fwd["x_vendor_param"] == nil {
		t.Fatalf("unknown fields must pass untouched: %v", fwd)
	}
	e.mu.Lock()
	engineID := e.ids[len(e.ids)-1]
	e.mu.Unlock()
	if id := resp.Header.Get("X-Request-Id"); !strings.HasPrefix(id, "req-") || id != engineID {
		t.Fatalf("request id %q to the client, %q to the engine", id, engineID)
	}
	p.waitIdle(t)
	if !strings.Contains(p.logs.String(), `"cached_tokens":3`) {
		t.Fatalf("access log lacks cached tokens: %s", p.logs.String())
	}

	// The client's own request id is kept when it is a plain one; the
	// engine gets an id unique in flight (two clients may send the same id,
	// and vLLM keys requests by it) that ends with the client's.
	seen := map[string]bool{}
	for _, id := range []string{"trace-42:a.b_c", "trace-42:a.b_c", "has space", strings.Repeat("x", 129)} {
		kept := id == "trace-42:a.b_c"
		req, _ := http.NewRequest("POST", p.url+"/v1/chat/completions", strings.NewReader(chatBody))
		req.Header.Set("X-Request-Id", id)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		e.mu.Lock()
		engineID := e.ids[len(e.ids)-1]
		e.mu.Unlock()
		got := resp.Header.Get("X-Request-Id")
		ours, theirs, _ := strings.Cut(engineID, ".")
		if kept && (got != id || theirs != id) || !kept && (got != engineID || theirs != "") ||
			!strings.HasPrefix(ours, "req-") || seen[engineID] {
			t.Fatalf("client id %q: %q to the client, %q to the engine", id, got, engineID)
		}
		seen[engineID] = true
	}
}

func TestStreamingRelaysEveryEventAndFrees(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens = 40 })
	p := startProxy(t, "kv", e)
	resp, err := http.Post(p.url+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"m","prompt":"Once upon a time","stream":true,"max_tokens":40}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	sc := bufio.NewScanner(resp.Body)
	var data []string
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, "data: ") {
			data = append(data, strings.TrimPrefix(l, "data: "))
		}
	}
	if len(data) != 42 || data[41] != "[DONE]" || !strings.Contains(data[40], `"t39 "`) {
		t.Fatalf("want role chunk + 40 tokens + [DONE], got %d events, last %q", len(data), data[len(data)-1])
	}
	p.waitIdle(t)
}

// Mid-stream, the worker holds the prompt blocks plus one block per
// block_size generated tokens.
func TestOutputBlocksTrackedDuringStream(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens = 40; f.pauseAfter = 35; f.pause = 2 * time.Second })
	p := startProxy(t, "kv", e)
	prompt := make([]string, 64) // 64 token ids → 4 full blocks
	for i := range prompt {
		prompt[i] = fmt.Sprint(1000 + i)
	}
	resp, err := http.Post(p.url+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"m","stream":true,"prompt":[`+strings.Join(prompt, ",")+`]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for n := 0; n < 36; { // role chunk + 35 tokens
		l, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(l, "data: ") {
			n++
		}
	}
	rows := p.s.backendRows(p.s.st.Load())
	if rows[0].Inflight != 1 || rows[0].ActiveBlocks != 4+2 || rows[0].PrefillTokens != 0 {
		t.Fatalf("mid-stream load: want 1 in flight, 4 prompt + 2 output blocks, no prefill left; got %+v", rows[0])
	}
	io.Copy(io.Discard, br)
	p.waitIdle(t)
	// The stream's inter-token latency: the 2 s pause over its 79 gaps
	// (the engine's usage, which kvproxy asked for, says two tokens a
	// chunk; observed with the access line, which may follow the last
	// byte).
	waitFor(t, "the access line", func() bool { return strings.Contains(p.logs.String(), `"message":"request"`) })
	m := p.metrics(t)
	sum := regexp.MustCompile(`kvproxy_time_per_output_token_seconds_sum\{backend="e0"\} (\S+)`).FindStringSubmatch(m)
	if !strings.Contains(m, `kvproxy_time_per_output_token_seconds_count{backend="e0"} 1`) || sum == nil {
		t.Fatalf("no time per output token:\n%s", grepLines(m, "per_output"))
	}
	if v, _ := strconv.ParseFloat(sum[1], 64); v < 1.8/79 || v > 3.0/79 {
		t.Fatalf("time per output token %v s, want about 2 s / 79", v)
	}
}

func TestErrorsAreOpenAIShaped(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	cases := []struct {
		name, path, body string
		status           int
		param, code      string
	}{
		{"malformed json", "/v1/chat/completions", `{"model":`, 400, "", ""},
		{"not an object", "/v1/chat/completions", `[1,2]`, 400, "", ""},
		{"model not a string", "/v1/chat/completions", `{"model":7,"messages":[{"role":"user","content":"x"}]}`, 400, "model", ""},
		{"missing messages", "/v1/chat/completions", `{"model":"m"}`, 400, "messages", ""},
		{"empty messages", "/v1/chat/completions", `{"model":"m","messages":[]}`, 400, "messages", ""},
		{"no role", "/v1/chat/completions", `{"model":"m","messages":[{"role":"","content":"x"}]}`, 400, "messages[0].role", ""},
		{"bad content", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":42}]}`, 400, "messages[0].content", ""},
		{"missing prompt", "/v1/completions", `{"model":"m"}`, 400, "prompt", ""},
		{"negative token", "/v1/completions", `{"model":"m","prompt":[1,-2]}`, 400, "prompt", ""},
		{"bad nvext", "/v1/completions", `{"model":"m","prompt":"x","nvext":{"token_data":"nope"}}`, 400, "nvext", ""},
		{"unknown pin", "/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"zz"}}`, 400, "nvext.backend_instance_id", ""},
		{"unknown model", "/v1/chat/completions", `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`, 404, "model", "model_not_found"},
		{"too large", "/v1/completions", `{"model":"m","prompt":"` + strings.Repeat("a", 70000) + `"}`, 413, "", "request_too_large"},
		{"unknown path", "/v2/whatever", `{}`, 404, "", "not_found"},
	}
	// An oversized body is refused while the client is still sending it:
	// the client must get the 413, not a connection reset, every time.
	for i := 0; i < 20; i++ {
		cases = append(cases, cases[len(cases)-2])
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := post(t, p.url+tc.path, tc.body)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
			}
			if resp.Header.Get("X-Request-Id") == "" {
				t.Errorf("no X-Request-Id")
			}
			var eb struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Param   *string `json:"param"`
					Code    *string `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(body, &eb); err != nil || eb.Error.Message == "" || eb.Error.Type == "" {
				t.Fatalf("not an OpenAI error object: %s", body)
			}
			if tc.param != "" && (eb.Error.Param == nil || *eb.Error.Param != tc.param) {
				t.Fatalf("param %v, want %q", eb.Error.Param, tc.param)
			}
			if tc.code != "" && (eb.Error.Code == nil || *eb.Error.Code != tc.code) {
				t.Fatalf("code %v, want %q", eb.Error.Code, tc.code)
			}
		})
	}
	if e.requests.Load() != 0 {
		t.Fatalf("bad requests must not reach the engine, it saw %d", e.requests.Load())
	}
	p.waitIdle(t)
}

func TestNoHealthyBackendIs503(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	for _, b := range p.s.st.Load().backends {
		b.setProbe(false, "")
	}
	resp, body := post(t, p.url+"/v1/chat/completions", chatBody)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" || !bytes.Contains(body, []byte(`"error"`)) {
		t.Fatalf("want 503 with Retry-After, got %d %v %s", resp.StatusCode, resp.Header, body)
	}
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_unavailable_total{reason="no_healthy_backend"} 1`) {
		t.Errorf("the outage is not counted:\n%s", grepLines(m, "unavailable_total"))
	}
	resp, err := http.Get(p.url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Fatalf("/health with no healthy backend: %d", resp.StatusCode)
	}
}

func TestEngineErrorsAreNormalized(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) {
		f.status = 400
		f.errBody = `{"object":"error","message":"max_tokens is too large","type":"BadRequestError","param":null,"code":400}`
	})
	p := startProxy(t, "kv", e)
	resp, body := post(t, p.url+"/v1/chat/completions", chatBody)
	// vLLM's exception name and numeric code become OpenAI's type and no
	// code (the SDK trial: clients test type == "invalid_request_error").
	if resp.StatusCode != 400 || string(body) != `{"error":{"message":"max_tokens is too large","type":"invalid_request_error","param":null,"code":null}}` {
		t.Fatalf("flat vLLM error not normalized: %d %s", resp.StatusCode, body)
	}
	p.waitIdle(t)
}

// A dry run says which policy chose and each candidate's score under it:
// under least_load the kv cost model's cost_ms does not explain the choice
// (the newcomer trial took it for a disagreement with the real request).
func TestDryRunShowsThePolicysScores(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.prefillDelay = time.Second })
	idle := startFake(t, "idle", nil)
	p := startProxy(t, "least_load", busy, idle)
	go func() {
		resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"long","max_tokens":1,"nvext":{"backend_instance_id":"busy"}}`))
		if err == nil {
			resp.Body.Close()
		}
	}()
	waitFor(t, "the request at busy", func() bool { return busy.requests.Load() == 1 })
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"nvext":{"annotations":["query_instance_id"]}}`)
	var d decisionJSON
	if err := json.Unmarshal(body, &d); err != nil || resp.StatusCode != 200 || len(d.Candidates) != 2 {
		t.Fatalf("dry-run answer: %d %s", resp.StatusCode, body)
	}
	score := map[string]float64{}
	for _, c := range d.Candidates {
		score[c.WorkerID] = c.Score
	}
	if d.Policy != "least_load" || d.WorkerID != "idle" || !(score["idle"] < score["busy"]) {
		t.Fatalf("dry run: policy %q chose %s, scores %v; want least_load choosing idle, the lower score", d.Policy, d.WorkerID, score)
	}
}

func TestDryRunMatchesRealDecision(t *testing.T) {
	engines := []*fakeEngine{startFake(t, "e0", nil), startFake(t, "e1", nil), startFake(t, "e2", nil)}
	p := startProxy(t, "kv", engines...)
	long := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 40)
	// Warm one worker with the prefix, then ask where the next turn goes.
	first := `{"model":"m","messages":[{"role":"user","content":"` + long + `"}]}`
	resp, _ := post(t, p.url+"/v1/chat/completions", first)
	warm := resp.Header.Get(WorkerHeader)
	next := `{"model":"m","messages":[{"role":"user","content":"` + long + `"},{"role":"assistant","content":"ok"},{"role":"user","content":"more"}]`
	resp, body := post(t, p.url+"/v1/chat/completions", next+`,"nvext":{"annotations":["query_instance_id"]}}`)
	var d decisionJSON
	if err := json.Unmarshal(body, &d); err != nil || resp.StatusCode != 200 {
		t.Fatalf("dry-run answer: %d %s", resp.StatusCode, body)
	}
	if d.WorkerID != warm || resp.Header.Get(WorkerHeader) != warm {
		t.Fatalf("dry-run chose %s, the prefix is on %s", d.WorkerID, warm)
	}
	if d.Policy != "kv" {
		t.Fatalf("dry run names policy %q, want kv", d.Policy)
	}
	if d.OverlapBlocks == 0 || d.TotalBlocks <= d.OverlapBlocks-1 || len(d.TokenIDs) < 16*d.TotalBlocks || len(d.Candidates) != 3 {
		t.Fatalf("dry-run decision incomplete: %+v", d)
	}
	before := engines[0].requests.Load() + engines[1].requests.Load() + engines[2].requests.Load()
	if before != 1 {
		t.Fatalf("dry-run must not reach an engine")
	}
	// Its block hashes are what /admin/index/lookup takes: the warm worker
	// holds the shared ones.
	if len(d.BlockHashes) != d.TotalBlocks {
		t.Fatalf("dry run: %d block hashes for %d blocks", len(d.BlockHashes), d.TotalBlocks)
	}
	lookup, _ := json.Marshal(map[string]any{"model": "m", "hashes": d.BlockHashes})
	resp, body = post(t, p.url+"/admin/index/lookup", string(lookup))
	var held struct{ Held map[string]int }
	if json.Unmarshal(body, &held) != nil || resp.StatusCode != 200 || held.Held[warm] != d.OverlapBlocks {
		t.Fatalf("lookup of the dry run's hashes: %d %s, want %s holding %d", resp.StatusCode, body, warm, d.OverlapBlocks)
	}
	// Plain integers work too; anything else is a 400.
	lookup = []byte(`{"model":"m","hashes":[` + strings.Join(d.BlockHashes, ",") + `]}`)
	resp, body = post(t, p.url+"/admin/index/lookup", string(lookup))
	if json.Unmarshal(body, &held) != nil || resp.StatusCode != 200 || held.Held[warm] != d.OverlapBlocks {
		t.Fatalf("lookup with integer hashes: %d %s", resp.StatusCode, body)
	}
	for _, bad := range []string{`{}`, `{"hashes":["x1"]}`, `{"hashes":[-1]}`, `{"hashes":[1.5]}`} {
		if resp, body = post(t, p.url+"/admin/index/lookup", bad); resp.StatusCode != 400 {
			t.Fatalf("lookup %s: %d %s", bad, resp.StatusCode, body)
		}
	}
	resp, _ = post(t, p.url+"/v1/chat/completions", next+`}`)
	if got := resp.Header.Get(WorkerHeader); got != d.WorkerID {
		t.Fatalf("real request went to %s, dry-run said %s", got, d.WorkerID)
	}

	// Streaming dry-run: Dynamo's annotated events, then [DONE].
	resp, body = post(t, p.url+"/v1/chat/completions", next+`,"stream":true,"nvext":{"annotations":["query_instance_id"]}}`)
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("streaming dry-run: %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	want := fmt.Sprintf("event: worker_instance_id\n: \"%d\"\n\nevent: token_data\n: [", d.InstanceID)
	if !strings.HasPrefix(string(body), want) || !strings.HasSuffix(string(body), "]\n\ndata: [DONE]\n\n") {
		t.Fatalf("streaming dry-run format:\n%s", body)
	}
	p.waitIdle(t)
}

func TestPinnedBackend(t *testing.T) {
	engines := []*fakeEngine{startFake(t, "e0", nil), startFake(t, "e1", nil)}
	p := startProxy(t, "round_robin", engines...)
	for i := 0; i < 3; i++ {
		resp, _ := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"e1"}}`)
		if resp.Header.Get(WorkerHeader) != "e1" {
			t.Fatalf("pin by id ignored: %s", resp.Header.Get(WorkerHeader))
		}
	}
	inst := p.s.backendRows(p.s.st.Load())[0].InstanceID
	resp, _ := post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"x","nvext":{"backend_instance_id":%d}}`, inst))
	if resp.Header.Get(WorkerHeader) != "e0" {
		t.Fatalf("pin by instance id ignored: %s", resp.Header.Get(WorkerHeader))
	}
	p.waitIdle(t)
}

// slowPrefill starts an engine that takes 10 s to prefill, a proxy before
// it, and a completion on a raw connection, and returns once the engine
// has the request.
func slowPrefill(t *testing.T, stream bool) (*fakeEngine, *testProxy, net.Conn) {
	t.Helper()
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	p := startProxy(t, "kv", e)
	c := rawCompletion(t, p, fmt.Sprintf(`{"model":"m","prompt":"slow","stream":%v}`, stream))
	for deadline := time.Now().Add(3 * time.Second); e.requests.Load() == 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	return e, p, c
}

// A client that leaves during a silent prefill: the engine sees the abort
// and the slot is freed long before the prefill would have ended.
func TestClientDisconnectDuringPrefillAbortsUpstream(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprint("stream=", stream), func(t *testing.T) {
			e, p, c := slowPrefill(t, stream)
			if p.s.Idle() {
				t.Fatal("request should hold a slot during prefill")
			}
			start := time.Now()
			c.Close()
			for e.aborted.Load() == 0 {
				if time.Since(start) > 3*time.Second {
					t.Fatal("engine never saw the abort")
				}
				time.Sleep(time.Millisecond)
			}
			p.waitIdle(t)
			if time.Since(start) > 3*time.Second {
				t.Fatalf("slot freed only after %v", time.Since(start))
			}
		})
	}
}

func TestBackendDyingMidStreamEndsStreamCleanly(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens = 20; f.dieAfter = 5 })
	p := startProxy(t, "kv", e)
	_, body := post(t, p.url+"/v1/chat/completions", strings.Replace(chatBody, `"nvext"`, `"stream":true,"nvext"`, 1))
	s := string(body)
	if !strings.Contains(s, `"t4 "`) || !strings.Contains(s, `data: {"error":{`) || !strings.HasSuffix(s, "data: [DONE]\n\n") {
		t.Fatalf("want tokens, an error event and [DONE]:\n%s", s)
	}
	p.waitIdle(t)
}

func TestConnectRefusedReroutes(t *testing.T) {
	good := startFake(t, "good", nil)
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	deadAddr := ln.Addr().String()
	ln.Close()
	dead := &fakeEngine{id: "dead", addr: deadAddr}
	p := startProxy(t, "round_robin", dead, good)
	for i := 0; i < 4; i++ {
		resp, body := post(t, p.url+"/v1/chat/completions", chatBody)
		if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "good" {
			t.Fatalf("request %d: %d from %s: %s", i, resp.StatusCode, resp.Header.Get(WorkerHeader), body)
		}
	}
	p.waitIdle(t)
}

func TestModelsHealthAdminMetrics(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 20 * time.Millisecond })
	p := startProxy(t, "kv", e)
	post(t, p.url+"/v1/chat/completions", chatBody)
	post(t, p.url+"/v1/chat/completions", strings.Replace(chatBody, `"temperature"`, `"stream":true,"temperature"`, 1))
	get := func(path string) []byte {
		resp, err := http.Get(p.url + path)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("GET %s: %v %v", path, err, resp)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return b
	}
	var models struct {
		Object string `json:"object"`
		Data   []struct{ ID, Object string }
	}
	json.Unmarshal(get("/v1/models"), &models)
	if models.Object != "list" || len(models.Data) != 2 || models.Data[0].ID != "m" || models.Data[1].ID != "alias-m" {
		t.Fatalf("/v1/models: %+v", models)
	}
	var one struct{ ID, Object, Root string }
	json.Unmarshal(get("/v1/models/alias-m"), &one)
	if one.ID != "alias-m" || one.Object != "model" || one.Root != "m" {
		t.Fatalf("/v1/models/alias-m: %+v", one)
	}
	for _, path := range []string{"/v1/models", "/v1/models/alias-m", "/v1/models/nosuch"} {
		req, _ := http.NewRequest("GET", p.url+path, nil)
		req.Header.Set("X-Request-Id", "client-id-7")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.Header.Get("X-Request-Id") != "client-id-7" {
			t.Fatalf("GET %s: x-request-id %q", path, resp.Header.Get("X-Request-Id"))
		}
	}
	if resp, b := post(t, p.url+"/v1/models/m", ""); resp.StatusCode != 405 {
		t.Fatalf("POST /v1/models/m: %d %s", resp.StatusCode, b)
	}
	for _, c := range []struct {
		method, path string
		status       int
	}{
		{"DELETE", "/v1/models", 405}, {"POST", "/health", 405}, {"POST", "/metrics", 405}, {"PUT", "/admin/backends", 405},
		{"HEAD", "/health", 200}, {"HEAD", "/v1/models", 200}, {"GET", "/v1/chat/completions", 405},
	} {
		req, _ := http.NewRequest(c.method, p.url+c.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.status || c.status == 405 && resp.Header.Get("Allow") == "" {
			t.Fatalf("%s %s: %d (Allow %q), want %d", c.method, c.path, resp.StatusCode, resp.Header.Get("Allow"), c.status)
		}
	}
	if resp, err := http.Get(p.url + "/v1/models/nope"); err != nil || resp.StatusCode != 404 {
		t.Fatalf("GET /v1/models/nope: %v %v", err, resp)
	} else {
		resp.Body.Close()
	}
	var rows []backendJSON
	json.Unmarshal(get("/admin/backends"), &rows)
	if len(rows) != 1 || rows[0].ID != "e0" || !rows[0].Healthy || rows[0].IndexedBlocks == 0 {
		t.Fatalf("/admin/backends: %+v", rows)
	}
	if rows[0].Pending != 0 || rows[0].MeanLifetimeMs < 15 {
		t.Fatalf("/admin/backends: pending %d, mean lifetime %.0f ms; want 0 and the request's ≥ 20 ms", rows[0].Pending, rows[0].MeanLifetimeMs)
	}
	m := string(get("/metrics"))
	for _, name := range []string{"kvproxy_requests_total{backend=\"e0\",code=\"200\"} 2", "kvproxy_inflight_requests{backend=\"e0\"} 0", "kvproxy_route_seconds_count", "kvproxy_prefix_hit_ratio_count", "kvproxy_ttft_seconds_count{backend=\"e0\"} 1",
		// LLM latencies: a TTFT of a minute, a generation of ten, still in a bucket.
		"kvproxy_ttft_seconds_bucket{backend=\"e0\",le=\"163.84\"} 1", "kvproxy_request_duration_seconds_bucket{backend=\"e0\",le=\"655.36\"} 2"} {
		if !strings.Contains(m, name) {
			t.Fatalf("/metrics lacks %q", name)
		}
	}
	get("/health")
}

func TestLogsNeverCarryPromptText(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	secret := "SECRET-PROMPT-TEXT-4711"
	post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"`+secret+`"}]}`)
	post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"","content":"`+secret+`"}]}`)
	p.waitIdle(t)
	if strings.Contains(p.logs.String(), secret) {
		t.Fatal("prompt text leaked into the log")
	}
	if !strings.Contains(p.logs.String(), `"request_id":"req-`) {
		t.Fatal("access log line missing")
	}
}

// An engine's error frame mid-stream, in each shape vLLM versions write it
// (flat or nested, compact or spaced by Python's json.dumps), reaches the
// client in OpenAI's shape (the type the engine's numeric code says, no
// code), and is logged as an error.
func TestEngineErrorFramesAreNormalized(t *testing.T) {
	want := `data: {"error":{"message":"CUDA out of memory","type":"server_error","param":null,"code":null}}`
	for _, c := range []struct{ frame, want string }{
		{"", want}, // flat, compact
		{`{"object": "error", "message": "CUDA out of memory", "type": "InternalServerError", "param": null, "code": 500}`, want},
		{`{"error": {"object": "error", "message": "CUDA out of memory", "type": "InternalServerError", "param": null, "code": 500}}`, want},
		{`{"error":{"message":"CUDA out of memory","type":"InternalServerError","param":null,"code":500}}`, want},
		// complete already: passed on as it is
		{`{"error": {"message": "CUDA out of memory", "type": "server_error", "param": null, "code": "oom"}}`,
			`data: {"error": {"message": "CUDA out of memory", "type": "server_error", "param": null, "code": "oom"}}`},
		// an exception's name is not OpenAI's type; a word of a code stays
		{`{"error": {"message": "CUDA out of memory", "type": "InternalServerError", "param": null, "code": "oom"}}`,
			`data: {"error":{"message":"CUDA out of memory","type":"server_error","param":null,"code":"oom"}}`},
		// a client's error in the engine's code: its type
		{`{"error":{"message":"bad logprobs","type":"BadRequestError","param":null,"code":400}}`,
			`data: {"error":{"message":"bad logprobs","type":"invalid_request_error","param":null,"code":null}}`},
	} {
		e := startFake(t, "e0", func(f *fakeEngine) { f.tokens = 10; f.errorAfter = 3; f.errorFrame = c.frame })
		p := startProxy(t, "kv", e)
		_, body := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
		s := string(body)
		if !strings.Contains(s, c.want+"\n\n") || strings.Count(s, "error") != strings.Count(c.want, "error") || !strings.HasSuffix(s, "data: [DONE]\n\n") {
			t.Errorf("frame %s:\n%s\nwant the event %s", c.frame, s, c.want)
		}
		p.waitIdle(t)
		if !strings.Contains(p.logs.String(), `"error":"engine error frame"`) {
			t.Errorf("frame %s: the access log does not say so:\n%s", c.frame, p.logs.String())
		}
	}
}

func TestFirstMember(t *testing.T) {
	for data, want := range map[string]string{
		`{"id":"x"}`: "id|\"x\"}", ` { "error" :  {}}`: "error|{}}", `{"a\"b":1}`: "", `[1]`: "", `{"x"`: "", `{"x" 1}`: "", ``: "",
	} {
		got := ""
		if k, v, ok := firstMember([]byte(data)); ok {
			got = string(k) + "|" + string(v)
		}
		if got != want {
			t.Errorf("firstMember(%q) = %q, want %q", data, got, want)
		}
	}
}

// The watcher registers a keep-alive connection once: a hang-up during the
// connection's second request is still noticed.
func TestDisconnectOnKeepAliveConnection(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	send := func(body string) {
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	}
	send(`{"model":"m","prompt":"quick"}`)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("first request: %v %v", err, resp)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	e.prefillDelay = 10 * time.Second
	send(`{"model":"m","prompt":"slow"}`)
	for e.requests.Load() < 2 {
		time.Sleep(time.Millisecond)
	}
	c.Close()
	deadline := time.Now().Add(3 * time.Second)
	for e.aborted.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("hang-up on a reused connection not noticed")
		}
		time.Sleep(time.Millisecond)
	}
	p.waitIdle(t)
}

func TestNormalizeEngineError(t *testing.T) {
	cases := map[string]string{
		`{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}`:         `{"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}}`,
		`{"error":{"message":"ok","type":"x","param":"p","code":"c"}}`:                         `{"error":{"message":"ok","type":"x","param":"p","code":"c"}}`,
		`{"object":"error","message":"flat","type":"BadRequestError","param":null,"code":400}`: `{"error":{"message":"flat","type":"invalid_request_error","param":null,"code":null}}`,
		`{"error":{"message":"slow down"}}`:                                                    `{"error":{"message":"slow down","type":"server_error","param":null,"code":null}}`,
		`{"error":{"message":"m","type":"t","code":"c"}}`:                                      `{"error":{"message":"m","type":"t","param":null,"code":"c"}}`,
		`{"error":{"type":"t","param":"p","code":null}}`:                                       `{"error":{"message":"the engine answered with status 500","type":"t","param":"p","code":null}}`,
		`Internal Server Error`:                                                                `{"error":{"message":"Internal Server Error","type":"server_error","param":null,"code":null}}`,
		// A gateway's page, or bytes, are not quoted: a page named its
		// upstream's address (the chaos trial).
		"\n<html><body>nginx upstream at 10.1.2.3:8000 failed</body></html>": `{"error":{"message":"the engine answered with status 500 and a page","type":"server_error","param":null,"code":null}}`,
		"\x00\xff\xfe junk":            `{"error":{"message":"the engine answered with status 500 and bytes that are no text","type":"server_error","param":null,"code":null}}`,
		"x" + strings.Repeat("é", 300): `{"error":{"message":"x` + strings.Repeat("é", 255) + `","type":"server_error","param":null,"code":null}}`, // cut between characters
		`{"detail":"Not Found"}`:       `{"error":{"message":"engine error: \"Not Found\"","type":"server_error","param":null,"code":null}}`,
		// TGI's: the message in "error", its kind in "error_type"; a
		// validation error is the request's fault even in a stream's frame.
		`{"error":"Request failed during generation: CUDA OOM","error_type":"generation"}`: `{"error":{"message":"Request failed during generation: CUDA OOM","type":"server_error","param":null,"code":null}}`,
		`{"error":"Input validation error: bad","error_type":"validation"}`:                `{"error":{"message":"Input validation error: bad","type":"invalid_request_error","param":null,"code":null}}`,
		// Gateways (Spring Boot, Fastify, NestJS) put the reason phrase in
		// "error" and their words in "message" (the re-review).
		`{"statusCode":429,"error":"Too Many Requests","message":"Rate limit exceeded, retry in 1 minute"}`: `{"error":{"message":"Rate limit exceeded, retry in 1 minute","type":"server_error","param":null,"code":null}}`,
	}
	for in, want := range cases {
		if got := string(normalizeEngineError(500, []byte(in))); got != want {
			t.Errorf("%s\n got %s\nwant %s", in, got, want)
		}
	}
	// A prompt too long for the model, in vLLM's words, gets OpenAI's code.
	tooLong := map[string]string{
		`{"error":{"message":"'max_tokens' or 'max_completion_tokens' is too large: 131000. This model's maximum context length is 131072 tokens and your request has 200 input tokens (131000 > 131072 - 200).","type":"BadRequestError","param":"max_tokens","code":400}}`: `"param":"max_tokens","code":"context_length_exceeded"}}`,
		`{"object":"error","message":"This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please reduce the length of the input messages.","type":"BadRequestError","param":null,"code":400}`:                                   `"param":null,"code":"context_length_exceeded"}}`,
		`{"error":{"message":"The decoder prompt (length 9000) is longer than the maximum model length of 8192.","type":"BadRequestError","param":null,"code":400}}`:                                                                                                         `"code":"context_length_exceeded"}}`,
		`{"error":{"message":"This model's maximum context length is 4096 tokens.","type":"invalid_request_error","param":null,"code":"prompt_too_long"}}`:                                                                                                                   `"code":"prompt_too_long"}}`,
		"{\"error\":\"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`\",\"error_type\":\"validation\"}":                                                                                     `"code":"context_length_exceeded"}}`,
		`{"timestamp":"2024-01-01T00:00:00.000+00:00","status":400,"error":"Bad Request","message":"This model's maximum context length is 4096 tokens","path":"/v1/chat/completions"}`:                                                                                      `"code":"context_length_exceeded"}}`,
	}
	// The same wordings when the prompt is what overflows.
	tooLong[`{"object":"error","message":"Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 5010 tokens: 4810 tokens from the input messages and 200 tokens for the completion.","type":"BadRequestError","param":null,"code":400}`] = `"code":"context_length_exceeded"}}`
	tooLong[`{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5010 tokens (4810 in the messages, 200 in the completion).","type":"BadRequestError","param":null,"code":400}`] = `"code":"context_length_exceeded"}}`
	for in, want := range tooLong {
		if got := string(normalizeEngineError(400, []byte(in))); !strings.HasSuffix(got, want) {
			t.Errorf("%s\n got %s\nwant …%s", in, got, want)
		}
	}
	// More output asked for than the whole context holds: no shorter
	// prompt mends it, so it is not that code (an agent would compact its
	// conversation and fail again; the differential trial).
	for _, in := range []string{
		`{"error":{"message":"'max_tokens' or 'max_completion_tokens' is too large: 1000000000. This model's maximum context length is 4096 tokens and your request has 27 input tokens (1000000000 > 4096 - 27).","type":"BadRequestError","param":null,"code":400}}`,
		`{"error":{"message":"'max_tokens' or 'max_completion_tokens' is too large: 4096. This model's maximum context length is 4096 tokens and your request has 1 input tokens (4096 > 4096 - 1).","type":"BadRequestError","param":null,"code":400}}`,
		"{\"error\":\"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 10 `inputs` tokens and 5000 `max_new_tokens`\",\"error_type\":\"validation\"}",
		`{"object":"error","message":"Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 5010 tokens: 10 tokens from the input messages and 5000 tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.","type":"BadRequestError","param":null,"code":400}`,
		`{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5010 tokens (10 in the messages, 5000 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}`,
	} {
		if got := string(normalizeEngineError(400, []byte(in))); !strings.HasSuffix(got, `"type":"invalid_request_error","param":null,"code":null}}`) {
			t.Errorf("%s\n got %s", in, got)
		}
	}
	// TGI answers a prompt too long 422 unstreamed: the same code.
	tgi := "{\"error\":\"Input validation error: `inputs` must have less than 4096 tokens. Given: 5000\",\"error_type\":\"validation\"}"
	if got := string(normalizeEngineError(422, []byte(tgi))); !strings.HasSuffix(got, `"type":"invalid_request_error","param":null,"code":"context_length_exceeded"}}`) {
		t.Errorf("TGI's 422: %s", got)
	}
	// The same words with another status are not that.
	if got := string(normalizeEngineError(500, []byte(`{"error":{"message":"maximum context length","type":"x","param":null,"code":500}}`))); !strings.HasSuffix(got, `"code":null}}`) {
		t.Errorf("a 500: %s", got)
	}
}

// An engine silent for longer than limits.stream_idle_timeout before its
// headers is a gateway timeout in OpenAI's shape, and the slot comes back.
func TestSilentEngineIsGatewayTimeout(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {stream_idle_timeout: 300ms}\n", e)
	start := time.Now()
	resp, body := post(t, p.url+"/v1/chat/completions", strings.Replace(chatBody, "alias-m", "m", 1))
	if resp.StatusCode != 504 || !bytes.Contains(body, []byte(`"type":"timeout_error"`)) || resp.Header.Get(WorkerHeader) != "e0" ||
		!bytes.Contains(body, []byte("sent nothing for 300ms (limits.stream_idle_timeout)")) {
		t.Fatalf("want 504 timeout_error from e0, got %d %s %v", resp.StatusCode, body, resp.Header)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("answered after %v", took)
	}
	// A whole answer may just be long: the engine is not ejected for it.
	b := p.s.st.Load().backends["e0"]
	b.mu.Lock()
	ejected := b.ejected
	b.mu.Unlock()
	if ejected {
		t.Fatal("one long non-streamed answer ejected the engine")
	}
	p.waitIdle(t)
}

// A non-streamed request is in flight but never "awaiting its first token"
// for the router (it cannot see that token): streamed ones are.
func TestOnlyStreamedRequestsCountAsPending(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 400 * time.Millisecond })
	p := startProxy(t, "kv", e)
	rt := p.s.st.Load().pools[0].rt
	for _, stream := range []bool{false, true} {
		body := chatBody
		if stream {
			body = strings.Replace(chatBody, `"temperature"`, `"stream":true,"temperature"`, 1)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			post(t, p.url+"/v1/chat/completions", body)
		}()
		deadline := time.Now().Add(3 * time.Second)
		for rt.Workers()[0].Inflight == 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		st := rt.Workers()[0]
		want := int64(0)
		if stream {
			want = 1
		}
		if st.Inflight != 1 || st.Pending != want {
			t.Fatalf("stream %v: inflight %d pending %d, want 1 and %d", stream, st.Inflight, st.Pending, want)
		}
		<-done
		p.waitIdle(t)
	}
}

// A non-streamed request stops counting as queued prefill once its
// predicted TTFT has passed, though its answer is still being generated.
func TestUnstreamedPrefillEndsAtPredictedTTFT(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	p := startProxy(t, "kv", e)
	rt := p.s.st.Load().pools[0].rt
	// A prompt of some 15k tokens: its predicted TTFT (about 0.015 ms a
	// token) is a few hundred ms, long enough to see it queued right after
	// routing, and well before the engine answers.
	body := strings.Replace(chatBody, "Say hi", strings.Repeat("hi ", 15000), 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		post(t, p.url+"/v1/chat/completions", body)
	}()
	deadline := time.Now().Add(5 * time.Second)
	for rt.Workers()[0].Inflight == 0 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	if st := rt.Workers()[0]; st.PrefillTokens == 0 {
		t.Fatalf("no queued prefill right after routing: %+v", st)
	}
	for rt.Workers()[0].PrefillTokens != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if st := rt.Workers()[0]; st.PrefillTokens != 0 || st.Inflight != 1 {
		t.Fatalf("want the prefill ended and the request still in flight: %+v", st)
	}
	<-done
	p.waitIdle(t)
}

// The proxy reads member names as the engines do (exactly, escapes decoded,
// the last one wins) and sends the engine the stream flag it read as
// "stream": the engine answers in the form the proxy relays, whatever the
// client spelt, so a client's "Stream" neither breaks its answer nor ejects
// the backend. Other spellings reach the engine unread, as they came.
func TestStreamFlagReachesEngineAsRead(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	for _, tc := range []struct{ members, want, passed string }{
		{`"Stream":true,`, "whole", "Stream"},
		{`"stream":false,"STREAM":true,`, "whole", "STREAM"},
		{`"stream":true,"Stream":false,`, "stream", "Stream"},
		{`"\u0073tream":true,`, "stream", ""},
		{`"stream":true,"stream":null,`, "whole", ""},
	} {
		resp, b := post(t, p.url+"/v1/chat/completions", strings.Replace(chatBody, `"nvext"`, tc.members+`"nvext"`, 1))
		got := "whole"
		if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			got = "stream"
		}
		if resp.StatusCode != 200 || got != tc.want || strings.Contains(string(b), `"error"`) {
			t.Fatalf("%s: %d, %s answer, want %s: %s", tc.members, resp.StatusCode, got, tc.want, b)
		}
		e.mu.Lock()
		fwd := e.bodies[len(e.bodies)-1]
		e.mu.Unlock()
		if s, _ := fwd["stream"].(bool); s != (tc.want == "stream") {
			t.Fatalf("%s: the engine got stream %v: %v", tc.members, fwd["stream"], fwd)
		}
		for k := range fwd {
			if k != "stream" && strings.EqualFold(k, "stream") && k != tc.passed {
				t.Fatalf("%s: the engine got %q", tc.members, k)
			}
		}
		if _, ok := fwd[tc.passed]; tc.passed != "" && !ok {
			t.Fatalf("%s: %q did not reach the engine: %v", tc.members, tc.passed, fwd)
		}
	}
	p.waitIdle(t)
}

// rawPost opens a connection to the proxy and sends one POST of body to
// path in proto (HTTP/1.0 or HTTP/1.1), for tests that read the answer
// raw or hang up midway; the connection is closed when the test ends.
func rawPost(t *testing.T, p *testProxy, proto, path, body string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	host := ""
	if proto == "HTTP/1.1" {
		host = "Host: x\r\n"
	}
	fmt.Fprintf(c, "POST %s %s\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, proto, host, len(body), body)
	return c
}

// A client that shuts its side down (or hangs up) before its answer began
// gets no answer and a closed connection, as from nginx, while its engine
// is asked to stop: fasthttp's default, an empty 200, read as a success (the
// HTTP trial). Both while the engine computes and while the request waits
// in the queue for a slot.
func TestHalfClosedClientGetsNoAnswer(t *testing.T) {
	readAll := func(t *testing.T, c net.Conn) string {
		t.Helper()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		b, err := io.ReadAll(c)
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("the connection stayed open after the client's half-close (read %q)", b)
		}
		return string(b)
	}
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprint("stream=", stream), func(t *testing.T) {
			e, p, c := slowPrefill(t, stream)
			c.(*net.TCPConn).CloseWrite()
			if got := readAll(t, c); got != "" {
				t.Fatalf("a client that half-closed got %q", got)
			}
			p.waitIdle(t)
			for end := time.Now().Add(3 * time.Second); e.aborted.Load() == 0; { // the engine sees its connection close in its own time
				if time.Now().After(end) {
					t.Fatal("the engine was not told to stop")
				}
				time.Sleep(time.Millisecond)
			}
		})
	}
	t.Run("queued", func(t *testing.T) {
		e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]\nlimits: {max_queue: 4, queue_timeout: 20s}\n", e)
		first := rawCompletion(t, p, `{"model":"m","prompt":"slow"}`)
		deadline := time.Now().Add(3 * time.Second)
		for e.requests.Load() == 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		c := rawCompletion(t, p, `{"model":"m","prompt":"waits"}`)
		for p.s.st.Load().models["m"].waiting.Load() == 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		c.(*net.TCPConn).CloseWrite()
		if got := readAll(t, c); got != "" {
			t.Fatalf("a queued client that half-closed got %q", got)
		}
		first.Close()
		p.waitIdle(t)
	})
}

// /health is readiness, for the whole proxy or one model (?model=, by name
// or alias), and names each model's healthy backends; /live is liveness,
// 200 whatever the engines' health, so that a probe on it does not restart
// kvproxy (and lose its index) during an engine outage (the migrating-
// operator trial).
func TestHealthPerModelAndLiveness(t *testing.T) {
	big, small := startFake(t, "big-0", nil), startFake(t, "small-0", nil)
	p := startProxyYAML(t, "models: [{name: big, aliases: [b]}, {name: small}]\n"+
		"backends: [{id: big-0, url: 'http://{{e0}}', model: big}, {id: small-0, url: 'http://{{e1}}', model: small}]\n", big, small)
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get(p.url + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	p.s.st.Load().backends["big-0"].setProbe(false, "")
	for path, want := range map[string]string{
		"/health":             `200 {"healthy_backends":1,"models":{"big":0,"small":1},"status":"ok"}`,
		"/health?model=small": `200 {"healthy_backends":1,"models":{"big":0,"small":1},"status":"ok"}`,
		"/health?model=b":     `503 {"healthy_backends":0,"models":{"big":0,"small":1},"status":"unavailable"}`,
		"/live":               `200 {"status":"live"}`,
	} {
		if code, body := get(path); fmt.Sprint(code, " ", body) != want {
			t.Errorf("%s: %d %s, want %s", path, code, body, want)
		}
	}
	if code, body := get("/health?model=nope"); code != 404 || !strings.Contains(body, "model_not_found") {
		t.Errorf("/health of an unknown model: %d %s", code, body)
	}
	p.s.st.Load().backends["small-0"].setProbe(false, "")
	if code, _ := get("/health"); code != 503 {
		t.Errorf("/health with every engine down: %d", code)
	}
	if code, _ := get("/livez"); code != 200 {
		t.Errorf("/livez with every engine down: %d", code)
	}
	// With keys, the models are named to whom /v1/models names them.
	keyed := startProxyYAML(t, "models: [{name: big}, {name: small}]\n"+
		"backends: [{id: big-0, url: 'http://{{e0}}', model: big}, {id: small-0, url: 'http://{{e1}}', model: small}]\n"+
		"tenants: [{name: t, models: [small]}]\nauth: {keys: [{key: client-key-1, tenant: t}], admin_keys: [admin-key-1]}\n", big, small)
	for _, tc := range []struct{ path, key, want string }{
		{"/health", "", `200 {"healthy_backends":2,"status":"ok"}`},
		{"/health", "client-key-1", `200 {"healthy_backends":2,"models":{"small":1},"status":"ok"}`},
		{"/health", "admin-key-1", `200 {"healthy_backends":2,"models":{"big":1,"small":1},"status":"ok"}`},
		{"/health?model=small", "client-key-1", `200 {"healthy_backends":1,"models":{"small":1},"status":"ok"}`},
		{"/health?model=big", "admin-key-1", `200 {"healthy_backends":1,"models":{"big":1,"small":1},"status":"ok"}`},
	} {
		req, _ := http.NewRequest("GET", keyed.url+tc.path, nil)
		if tc.key != "" {
			req.Header.Set("Authorization", "Bearer "+tc.key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if got := fmt.Sprint(resp.StatusCode, " ", string(b)); got != tc.want {
			t.Errorf("%s with %q: %s, want %s", tc.path, tc.key, got, tc.want)
		}
	}
	for key, want := range map[string]int{"": 401, "client-key-1": 404} { // big is not the tenant's
		req, _ := http.NewRequest("GET", keyed.url+"/health?model=big", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		// Any key may ask: the 401 does not say an admin's is needed (the README trial).
		if resp.StatusCode != want || want == 401 && !strings.Contains(string(b), "missing or invalid API key") {
			t.Errorf("/health?model=big with %q: %d %s, want %d", key, resp.StatusCode, b, want)
		}
	}
	// The per-backend series break down by model through the info series.
	wantMetrics(t, p.metrics(t),
		`kvproxy_backend_info{backend="big-0",kind="vllm",model="big",role="both"} 1`,
		`kvproxy_backend_info{backend="small-0",kind="vllm",model="small",role="both"} 1`)
}

// A body starting with a UTF-8 byte order mark (a file saved by a Windows
// tool, sent with curl -d @file) is served, as vLLM serves it; the engine
// gets it without (the HTTP trial).
func TestBodyWithByteOrderMark(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	resp, b := post(t, p.url+"/v1/chat/completions", "\xef\xbb\xbf"+chatBody)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if got := e.lastBody(); got == nil || got["messages"] == nil {
		t.Fatalf("the engine got %v", got)
	}
}

// The engines' own model name (served_model) names their model too: a
// client that used the engines directly keeps its model name (the
// migrating-operator trial: the answers named a model kvproxy refused).
// Not when the engines of two models answer to it, nor over a configured
// name.
func TestServedModelNamesItsModel(t *testing.T) {
	a, b, c := startFake(t, "a", nil), startFake(t, "b", nil), startFake(t, "c", nil)
	p := startProxyYAML(t, "models: [{name: m}, {name: n}, {name: o}]\nbackends:\n"+
		"  - {id: a, url: 'http://{{e0}}', model: m, served_model: org/Model-M}\n"+
		"  - {id: b, url: 'http://{{e1}}', model: n, served_model: shared}\n"+
		"  - {id: c, url: 'http://{{e2}}', model: o, served_model: shared}\n", a, b, c)
	body := func(model string) string {
		return `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`
	}
	resp, out := post(t, p.url+"/v1/chat/completions", body("org/Model-M"))
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "a" || a.lastBody()["model"] != "org/Model-M" {
		t.Fatalf("by the engine's name: %d via %s: %s", resp.StatusCode, resp.Header.Get(WorkerHeader), out)
	}
	if resp, out := post(t, p.url+"/v1/chat/completions", body("shared")); resp.StatusCode != 404 {
		t.Fatalf("a name the engines of two models answer to: %d %s", resp.StatusCode, out)
	}
	if resp, out := post(t, p.url+"/v1/chat/completions", body("m")); resp.StatusCode != 200 {
		t.Fatalf("by the configured name: %d %s", resp.StatusCode, out)
	}
	r, err := http.Get(p.url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	list, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if strings.Contains(string(list), "org/Model-M") {
		t.Fatalf("/v1/models lists the engine's name: %s", list)
	}
	// Retrieved, and looked up in the index, as the name requests take
	// (the third review).
	for path, want := range map[string]string{"GET /v1/models/org/Model-M": `"id":"org/Model-M"`, "POST /admin/index/lookup": `{"held":`} {
		method, url, _ := strings.Cut(path, " ")
		req, _ := http.NewRequest(method, p.url+url, strings.NewReader(`{"model":"org/Model-M","hashes":["1"]}`))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), want) {
			t.Errorf("%s: %d %s", path, resp.StatusCode, b)
		}
	}
	p.waitIdle(t)

	// An adapter another model's engines list goes first (the second
	// review: the served name took its requests).
	x := startFake(t, "x", nil)
	y := startFake(t, "y", func(f *fakeEngine) {
		f.modelList = `{"object":"list","data":[{"id":"engine-n","object":"model","root":"engine-n","parent":null},{"id":"base-x","object":"model","root":"/adapters/x","parent":"engine-n"}]}`
	})
	q := startProxyYAML(t, "models: [{name: m}, {name: n}]\nbackends:\n"+
		"  - {id: x, url: 'http://{{e0}}', model: m, served_model: base-x}\n"+
		"  - {id: y, url: 'http://{{e1}}', model: n, served_model: engine-n}\n", x, y)
	if resp, out := post(t, q.url+"/v1/chat/completions", body("base-x")); resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "y" {
		t.Fatalf("an adapter of n's engines that m's engines are named: %d via %s: %s", resp.StatusCode, resp.Header.Get(WorkerHeader), out)
	}
	q.s.st.Load().backends["y"].setProbe(false, "") // /health?model= takes it for n's too
	if r, err := http.Get(q.url + "/health?model=base-x"); err != nil || r.StatusCode != 503 {
		t.Fatalf("/health of an adapter whose model is down: %v %v", r.StatusCode, err)
	}
	q.waitIdle(t)
}

// Dynamo's sampling members of nvext reach the engine: greed_sampling as
// temperature 0 (over the client's), and ignore_eos, top_k,
// repetition_penalty and min_p as the request's own where it has none, to
// engines that take them (not kind openai). They were dropped with nvext:
// a greedy request was sampled at the client's temperature (the
// migrating-operator trial).
func TestNvextSamplingReachesTheEngine(t *testing.T) {
	v, o := startFake(t, "v", nil), startFake(t, "o", nil)
	p := startProxyYAML(t, "models: [{name: m}, {name: n}]\nbackends:\n"+
		"  - {id: v, url: 'http://{{e0}}', model: m}\n  - {id: o, url: 'http://{{e1}}', model: n, kind: openai}\n", v, o)
	nv := `"nvext":{"greed_sampling":true,"ignore_eos":true,"top_k":5,"repetition_penalty":1.1,"min_p":null,"agent_hints":{"osl":10}}`
	for _, tc := range []struct {
		model, extra string
		engine       *fakeEngine
		want         map[string]any
	}{
		{"m", "", v, map[string]any{"temperature": 0.0, "ignore_eos": true, "top_k": 5.0, "repetition_penalty": 1.1}},
		{"m", `"top_k":3,`, v, map[string]any{"temperature": 0.0, "ignore_eos": true, "top_k": 3.0, "repetition_penalty": 1.1}},
		{"n", "", o, map[string]any{"temperature": 0.0}},
	} {
		body := `{"model":"` + tc.model + `","temperature":0.9,` + tc.extra + `"messages":[{"role":"user","content":"hi"}],` + nv + `}`
		if resp, b := post(t, p.url+"/v1/chat/completions", body); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		got := tc.engine.lastBody()
		for _, k := range []string{"temperature", "ignore_eos", "top_k", "repetition_penalty", "min_p", "nvext"} {
			if w, ok := tc.want[k]; got[k] != w || ok != (got[k] != nil) {
				t.Errorf("%s%s: the engine got %s = %v, want %v", tc.model, tc.extra, k, got[k], w)
			}
		}
	}
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"nvext":{"greed_sampling":"yes"}}`)
	if resp.StatusCode != 400 || !strings.Contains(string(b), "greed_sampling (a boolean)") {
		t.Fatalf("greed_sampling not a boolean: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// /health?model= finds an adapter the engines list as the tenant's
// request would: that of the model the tenant may use (the fourth review:
// the first listing model's, which the tenant may not use, made it 404).
func TestHealthOfAnAdapterForARestrictedTenant(t *testing.T) {
	list := `{"object":"list","data":[{"id":"engine-m","object":"model","root":"engine-m","parent":null},{"id":"lora-a","object":"model","root":"/a","parent":"engine-m"}]}`
	x := startFake(t, "x", func(f *fakeEngine) { f.modelList = list })
	y := startFake(t, "y", func(f *fakeEngine) { f.modelList = list })
	p := startProxyYAML(t, "models: [{name: m}, {name: n}]\nbackends:\n"+
		"  - {id: x, url: 'http://{{e0}}', model: m, served_model: engine-m}\n  - {id: y, url: 'http://{{e1}}', model: n, served_model: engine-m}\n"+
		"tenants: [{name: t, models: [n]}]\nauth: {keys: [{key: client-key-1, tenant: t}]}\n", x, y)
	// It answers at once, before the engines' lists are read (a probe
	// must): a 404 until then.
	for end := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		req, _ := http.NewRequest("GET", p.url+"/health?model=lora-a", nil)
		req.Header.Set("Authorization", "Bearer client-key-1")
		start := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if took := time.Since(start); took > 500*time.Millisecond {
			t.Fatalf("/health?model= took %v", took)
		}
		if resp.StatusCode == 200 && strings.Contains(string(b), `"healthy_backends":1`) {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("/health?model=lora-a for a tenant of n: %d %s", resp.StatusCode, b)
		}
	}
}
