package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// tokenizeEngine answers /tokenize with ids for what it got (the request
// bodies are kept) and every other path with an empty completion.
type tokenizeEngine struct {
	mu     sync.Mutex
	bodies []map[string]any
	ids    func(body map[string]any) string // the JSON array to answer
	stuck  bool
	calls  atomic.Int64
}

func (e *tokenizeEngine) serve(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	if r.URL.Path != "/tokenize" {
		io.Copy(io.Discard, r.Body)
		w.Write([]byte(`{"choices":[]}`))
		return
	}
	e.calls.Add(1)
	if e.stuck {
		<-r.Context().Done()
		return
	}
	var body map[string]any
	json.NewDecoder(r.Body).Decode(&body)
	e.mu.Lock()
	e.bodies = append(e.bodies, body)
	e.mu.Unlock()
	w.Write([]byte(`{"tokens":` + e.ids(body) + `}`))
}

func few(map[string]any) string { return "[1,2,3]" }

// With tokenizer: engine, what the engine's template renders besides the
// messages (tools, the template and its arguments, special tokens) goes to
// its /tokenize, and tells cached answers apart: a tool-calling request is
// hashed on the engine's own tokens.
func TestEngineTokenizerSendsWhatTheTemplateRenders(t *testing.T) {
	e := &tokenizeEngine{ids: func(b map[string]any) string {
		if b["tools"] != nil {
			return "[1,2,3,4]"
		}
		return "[1,2,3]"
	}}
	p := startProxyYAML(t, "models: [{name: m, tokenizer: engine, block_size: 2}]\nbackends: [{id: e0, url: 'http://"+startRawEngine(t, e.serve)+"', model: m}]\n")
	msgs := `"messages":[{"role":"user","content":"weather?"}]`
	tools := `"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]`
	dry := func(extra string) []int {
		t.Helper()
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m",`+msgs+extra+`,"nvext":{"annotations":["query_instance_id"]}}`)
		var d struct {
			TokenIDs []int `json:"token_ids"`
		}
		if resp.StatusCode != 200 || json.Unmarshal(b, &d) != nil {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return d.TokenIDs
	}
	if n := len(dry("")); n != 3 {
		t.Fatalf("without tools: %d tokens", n)
	}
	if n := len(dry("," + tools + `,"chat_template_kwargs":{"enable_thinking":false},"add_special_tokens":false,"continue_final_message":null`)); n != 4 {
		t.Fatalf("with tools: %d tokens, want the engine's 4 (a cached answer without tools?)", n)
	}
	e.mu.Lock()
	last := e.bodies[len(e.bodies)-1]
	e.mu.Unlock()
	if last["tools"] == nil || last["chat_template_kwargs"] == nil || last["add_special_tokens"] != false {
		t.Fatalf("the engine's /tokenize got %v", last)
	}
	if _, sent := last["continue_final_message"]; sent {
		t.Fatalf("a null member was sent: %v", last)
	}
	if calls := e.calls.Load(); calls != 2 {
		t.Fatalf("%d /tokenize calls for two distinct requests", calls)
	}
	dry("," + tools + `,"chat_template_kwargs":{"enable_thinking":false},"add_special_tokens":false`)
	if calls := e.calls.Load(); calls != 2 {
		t.Fatalf("a repeated request asked the engine again (%d calls)", calls)
	}
}

// Token ids of a prompt refused as too long are not cached, and the cache
// is bounded in ids, not only in entries (found by the sixth session's
// review: 40 refused requests held 8M ids).
func TestEngineTokenCacheKeepsNoRefusedPrompts(t *testing.T) {
	const n = 200_000
	ids := "[" + strings.TrimSuffix(strings.Repeat("7,", n), ",") + "]"
	e := &tokenizeEngine{ids: func(map[string]any) string { return ids }}
	p := startProxyYAML(t, "models: [{name: m, tokenizer: engine, block_size: 16}]\n"+
		"limits: {max_prompt_tokens: 1000}\nbackends: [{id: e0, url: 'http://"+startRawEngine(t, e.serve)+"', model: m}]\n")
	for i := 0; i < 10; i++ {
		if resp, b := post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"distinct prompt %d"}`, i)); resp.StatusCode != 400 {
			t.Fatalf("want 400 context_length_exceeded, got %d %s", resp.StatusCode, b)
		}
	}
	c := &p.s.st.Load().pools[0].engineTok.cache
	c.mu.Lock()
	entries, held := len(c.m), c.ids
	c.mu.Unlock()
	if entries != 0 || held != 0 {
		t.Fatalf("refused prompts cached: %d entries, %d ids", entries, held)
	}

	var tc tokenCache
	big := make([]uint32, tokenCacheIDs/8)
	for k := uint64(0); k < 20; k++ {
		tc.put(k, big)
		if tc.ids > tokenCacheIDs {
			t.Fatalf("the cache holds %d ids, over its %d", tc.ids, tokenCacheIDs)
		}
	}
	sum := 0
	for _, v := range tc.m {
		sum += len(v)
	}
	if sum != tc.ids || len(tc.m) == 0 {
		t.Fatalf("cache count %d, held %d in %d entries", tc.ids, sum, len(tc.m))
	}
}

// An engine whose /tokenize never answers costs one request at most
// engineTokenizeTimeout, and is not asked again for a while: the requests
// after it are tokenized by the other engine at once.
func TestStuckEngineTokenizerIsSkipped(t *testing.T) {
	stuck := &tokenizeEngine{stuck: true, ids: few}
	ok := &tokenizeEngine{ids: few}
	p := startProxyYAML(t, "models: [{name: m, tokenizer: engine, block_size: 16}]\n"+
		"backends: [{id: stuck, url: 'http://"+startRawEngine(t, stuck.serve)+"', model: m}, {id: ok, url: 'http://"+startRawEngine(t, ok.serve)+"', model: m}]\n")
	var slow int
	for i := 0; i < 6; i++ {
		t0 := time.Now()
		if resp, b := post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"p%d"}`, i)); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
		if took := time.Since(t0); took > engineTokenizeTimeout/2 {
			slow++
			if took > engineTokenizeTimeout+2*time.Second {
				t.Fatalf("request %d waited %v for a stuck /tokenize", i, took)
			}
		}
	}
	if slow > 1 || stuck.calls.Load() > 1 {
		t.Fatalf("%d slow requests, %d calls to the stuck /tokenize: it should be asked once", slow, stuck.calls.Load())
	}
	if ok.calls.Load() != 6 {
		t.Fatalf("the working engine tokenized %d of 6 requests", ok.calls.Load())
	}
}

// An engine refusing one request's /tokenize (a template error, a
// chat_template it does not trust: 400) is the request's fault: the next
// requests are tokenized as before, and their limits hold (found by the
// sixth session's review: every engine was skipped for 30 s).
func TestTokenizeRefusalIsTheRequestsAlone(t *testing.T) {
	ids := "[" + strings.TrimSuffix(strings.Repeat("7,", 100), ",") + "]"
	var refused atomic.Int64
	h := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/tokenize" {
			if strings.Contains(string(b), "chat_template") {
				refused.Add(1)
				w.WriteHeader(400)
				w.Write([]byte(`{"error":{"message":"Chat template is passed with request, but --trust-request-chat-template is not set."}}`))
				return
			}
			w.Write([]byte(`{"tokens":` + ids + `}`))
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"choices":[]}`))
	}
	p := startProxyYAML(t, "models: [{name: m, tokenizer: engine, block_size: 16}]\nlimits: {max_prompt_tokens: 50}\n"+
		"backends: [{id: e0, url: 'http://"+startRawEngine(t, h)+"', model: m}, {id: e1, url: 'http://"+startRawEngine(t, h)+"', model: m}]\n")
	long := `{"model":"m","messages":[{"role":"user","content":"a prompt of 100 engine tokens"}]}`
	if resp, b := post(t, p.url+"/v1/chat/completions", long); resp.StatusCode != 400 {
		t.Fatalf("before: %d %s", resp.StatusCode, b)
	}
	post(t, p.url+"/v1/chat/completions", `{"model":"m","chat_template":"{{ messages }}","messages":[{"role":"user","content":"x"}]}`)
	if n := refused.Load(); n != 1 {
		t.Fatalf("the refused /tokenize was asked of %d engines", n)
	}
	if resp, b := post(t, p.url+"/v1/chat/completions", long); resp.StatusCode != 400 || !strings.Contains(string(b), "context_length_exceeded") {
		t.Fatalf("after another request's refused /tokenize: %d %s, want the 400 of a prompt over max_prompt_tokens", resp.StatusCode, b)
	}
}

// One engine without a usable /tokenize (404: not vLLM, or an older one;
// 401: it refuses kvproxy's key there) and one with: every request should
// still be tokenized (by the working engine), and the broken one should
// not be asked on every request (found by the sixth session's review).
func TestEngineWithoutTokenizeIsSkipped(t *testing.T) {
	for _, code := range []int{404, 401} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			var badCalls, goodCalls atomic.Int64
			bad := func(w http.ResponseWriter, r *http.Request) {
				io.ReadAll(r.Body)
				if r.URL.Path == "/tokenize" {
					badCalls.Add(1)
					w.WriteHeader(code)
					w.Write([]byte(`{"detail":"Not Found"}`))
					return
				}
				w.Header().Set("Content-Type", "application/json")
				w.Write([]byte(`{"choices":[]}`))
			}
			good := func(w http.ResponseWriter, r *http.Request) {
				io.ReadAll(r.Body)
				if r.URL.Path == "/tokenize" {
					goodCalls.Add(1)
					w.Write([]byte(`{"tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`))
					return
				}
				w.Header().Set("Content-Type", "application/json")
				w.Write([]byte(`{"choices":[]}`))
			}
			p := startProxyYAML(t, "models: [{name: m, tokenizer: engine, block_size: 16}]\n"+
				"backends: [{id: e0, url: 'http://"+startRawEngine(t, bad)+"', model: m}, {id: e1, url: 'http://"+startRawEngine(t, good)+"', model: m}]\n")
			for i := 0; i < 10; i++ {
				post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"distinct prompt %d"}`, i))
			}
			if badCalls.Load() > 1 || goodCalls.Load() < 9 {
				t.Fatalf("bad engine's /tokenize asked %d times, good one %d times (10 distinct requests)", badCalls.Load(), goodCalls.Load())
			}
		})
	}
}

// The engine's /tokenize answers are cached per cache namespace, as the KV
// index is: a cached answer comes without an engine call, so its speed
// would tell a tenant that another one sent the same conversation (found
// by a security review). Tenants with shared_cache share them, and a
// client's own cache_salt is a namespace of its own.
func TestEngineTokenCacheIsPerTenant(t *testing.T) {
	e := &tokenizeEngine{ids: few}
	yaml := strings.Replace(tenantsYAML, "models: [{name: m, block_size: 16}]", "models: [{name: m, block_size: 16, tokenizer: engine}]", 1)
	yaml = strings.Replace(yaml, "http://{{e0}}", "http://"+startRawEngine(t, e.serve), 1)
	p := startProxyYAML(t, yaml)
	body := `{"model":"m","messages":[{"role":"user","content":"a secret of alpha's"}],"nvext":{"annotations":["query_instance_id"]}}`
	for i, step := range []struct {
		key   string
		salt  string
		calls int64
	}{
		{"key-alpha-123", "", 1},
		{"key-alpha-123", "", 1}, // alpha's own repeat: cached
		{"key-beta-4567", "", 2}, // not alpha's answer
		{"key-gamma-890", "", 3},
		{"key-delta-890", "", 3}, // shares gamma's namespace
		{"key-alpha-123", "user-1", 4},
		{"key-alpha-123", "user-1", 4},
	} {
		b := body
		if step.salt != "" {
			b = strings.Replace(b, `"model":"m",`, `"model":"m","cache_salt":"`+step.salt+`",`, 1)
		}
		if resp, got := postAuth(t, p.url+"/v1/chat/completions", step.key, b); resp.StatusCode != 200 {
			t.Fatalf("step %d: %d %s", i, resp.StatusCode, got)
		}
		if calls := e.calls.Load(); calls != step.calls {
			t.Fatalf("step %d (%s, salt %q): %d /tokenize calls, want %d", i, step.key, step.salt, calls, step.calls)
		}
	}
}

// count_tokens with tokenizer: engine and no engine reachable is a 503 that
// says so without the engine's address (it quoted the dial error, which
// names it; the security review). The log keeps the detail.
func TestCountTokensFailureKeepsEngineAddressesOut(t *testing.T) {
	addr := deadAddr(t)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: engine, block_size: 16}]\nbackends: [{id: e0, url: 'http://"+addr+"', model: m}]\n")
	resp, b := post(t, p.url+"/v1/messages/count_tokens", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	host, _, _ := strings.Cut(addr, ":")
	if resp.StatusCode != 503 || strings.Contains(string(b), host) || !strings.Contains(string(b), "no engine's /tokenize answered") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
	if !strings.Contains(p.logs.String(), addr) {
		t.Fatalf("the log lost why: %s", p.logs.String())
	}
}
