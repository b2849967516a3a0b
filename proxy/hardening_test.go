package proxy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
)

// startProxyYAML starts a proxy from a YAML config whose {{eN}} placeholders
// are replaced by the fake engines' addresses.
func startProxyYAML(t *testing.T, yaml string, engines ...*fakeEngine) *testProxy {
	t.Helper()
	for i, e := range engines {
		yaml = strings.ReplaceAll(yaml, fmt.Sprintf("{{e%d}}", i), e.addr)
	}
	return serveYAML(t, yaml, true)
}

// newTestServer builds a server for a configuration, logging to the buffer
// it returns, its health checks off or on; the caller serves it.
func newTestServer(t *testing.T, yaml string, noHealthChecks bool) (*Server, *syncBuffer) {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	s, err := New(cfg, Options{Logger: zerolog.New(logs), DisableHealthChecks: noHealthChecks})
	if err != nil {
		t.Fatal(err)
	}
	return s, logs
}

// serveYAML starts a proxy for a configuration on loopback, its health
// checks off or on.
func serveYAML(t *testing.T, yaml string, noHealthChecks bool) *testProxy {
	t.Helper()
	s, logs := newTestServer(t, yaml, noHealthChecks)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(ln)
	t.Cleanup(func() { s.Shutdown() })
	return &testProxy{s: s, url: "http://" + ln.Addr().String(), logs: logs}
}

// doAuth sends req with the API key: the answer's status and body.
func doAuth(t *testing.T, req *http.Request, key string) (int, string) {
	t.Helper()
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func postAuth(t *testing.T, url, key, body string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b := new(strings.Builder)
	bufio.NewReader(resp.Body).WriteTo(b)
	return resp, b.String()
}

const tenantsYAML = `
models: [{name: m, block_size: 16}]
backends:
  - {id: e0, url: 'http://{{e0}}', model: m, kind: vllm}
auth:
  keys:
    - {key: key-alpha-123, tenant: alpha}
    - {key: key-beta-4567, tenant: beta}
    - {key: key-gamma-890, tenant: gamma}
    - {key: key-delta-890, tenant: delta}
  admin_keys: [admin-key-xyz]
  cache_salt_secret: s3cret
tenants:
  - {name: gamma, shared_cache: true}
  - {name: delta, shared_cache: true, requests_per_second: 2}
`

func TestKeysTenantsAndCacheSalt(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, tenantsYAML, e)
	body := `{"model":"m","cache_salt":"client-chosen","messages":[{"role":"user","content":"` + strings.Repeat("shared words ", 60) + `"}]}`

	if resp, b := postAuth(t, p.url+"/v1/chat/completions", "", body); resp.StatusCode != 401 || !strings.Contains(b, "invalid_api_key") {
		t.Fatalf("no key: %d %s", resp.StatusCode, b)
	}
	if resp, _ := postAuth(t, p.url+"/v1/chat/completions", "wrong-key-000", body); resp.StatusCode != 401 {
		t.Fatalf("wrong key: %d", resp.StatusCode)
	}
	salts := map[string]string{}
	for _, k := range []string{"key-alpha-123", "key-beta-4567", "key-gamma-890", "key-delta-890"} {
		resp, b := postAuth(t, p.url+"/v1/chat/completions", k, body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", k, resp.StatusCode, b)
		}
		salt, _ := e.lastBody()["cache_salt"].(string)
		if len(salt) != 32+len("/client-chosen") || !strings.HasSuffix(salt, "/client-chosen") {
			t.Fatalf("%s: cache_salt %q: the client's must come after the tenant's", k, salt)
		}
		salts[k] = salt
	}
	if salts["key-alpha-123"] == salts["key-beta-4567"] {
		t.Fatal("two tenants got the same cache_salt")
	}
	if salts["key-gamma-890"] != salts["key-delta-890"] {
		t.Fatal("tenants sharing the cache namespace must share the salt")
	}
	for _, s := range salts {
		if strings.Contains(s, "alpha") || strings.Contains(s, "key-") {
			t.Fatal("the salt must not reveal the tenant or key")
		}
	}

	// The index never routes one tenant on another's prefix: a prompt only
	// alpha has sent is cached for alpha and for no one else; tenants that
	// share the cache namespace share its prefixes.
	overlap := func(key, prompt string) decisionJSON {
		t.Helper()
		dry := strings.Replace(prompt, `"model":"m"`, `"model":"m","nvext":{"annotations":["query_instance_id"]}`, 1)
		resp, b := postAuth(t, p.url+"/v1/chat/completions", key, dry)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: dry run %d %s", key, resp.StatusCode, b)
		}
		var d decisionJSON
		json.Unmarshal([]byte(b), &d)
		return d
	}
	for sender, others := range map[string]map[string]bool{
		"key-alpha-123": {"key-alpha-123": true, "key-beta-4567": false, "key-gamma-890": false},
		"key-gamma-890": {"key-delta-890": true, "key-alpha-123": false},
	} {
		// Without a cache_salt of the client's, which would set its own
		// namespace: the tenant's alone keeps the prompt apart.
		prompt := strings.ReplaceAll(strings.Replace(body, `"cache_salt":"client-chosen",`, "", 1), "shared words", sender+" words")
		if resp, b := postAuth(t, p.url+"/v1/chat/completions", sender, prompt); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", sender, resp.StatusCode, b)
		}
		for key, cached := range others {
			if d := overlap(key, prompt); d.TotalBlocks == 0 || (d.OverlapBlocks > 0) != cached {
				t.Errorf("%s's prompt, dry run of %s: %d of %d blocks cached, want cached %v", sender, key, d.OverlapBlocks, d.TotalBlocks, cached)
			}
		}
	}
	if resp, b := postAuth(t, p.url+"/v1/chat/completions", "wrong", strings.Replace(body, `"model":"m"`, `"model":"m","nvext":{"annotations":["query_instance_id"]}`, 1)); resp.StatusCode != 401 {
		t.Fatalf("a dry run with a wrong key: %d %s", resp.StatusCode, b)
	}

	// Admin endpoints take the admin key, not a tenant key: no key or an
	// unknown one is a 401, a client's key a 403.
	for k, want := range map[string]int{"": 401, "no-such-key-99": 401, "key-alpha-123": 403} {
		req, _ := http.NewRequest("GET", p.url+"/admin/backends", nil)
		if k != "" {
			req.Header.Set("Authorization", "Bearer "+k)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		// Admin keys go as bearer tokens only: the 401 does not offer x-api-key.
		if resp.StatusCode != want || want == 401 && !strings.Contains(string(b), "invalid admin key (send Authorization: Bearer ") {
			t.Fatalf("admin with %q: %d %s, want %d", k, resp.StatusCode, b, want)
		}
	}
	req, _ := http.NewRequest("GET", p.url+"/admin/backends", nil)
	req.Header.Set("Authorization", "Bearer admin-key-xyz")
	if resp, _ := http.DefaultClient.Do(req); resp.StatusCode != 200 {
		t.Fatalf("admin key refused: %d", resp.StatusCode)
	}

	// delta is limited to 2 requests/s (burst 2).
	limited := 0
	for i := 0; i < 5; i++ {
		resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-delta-890", body)
		if resp.StatusCode == 429 {
			limited++
			if resp.Header.Get("Retry-After") == "" || !strings.Contains(b, "rate_limit_exceeded") {
				t.Fatalf("429 without Retry-After or code: %v %s", resp.Header, b)
			}
		}
	}
	if limited < 2 {
		t.Fatalf("rate limit let %d of 5 through", 5-limited)
	}
	p.waitIdle(t)
	for _, k := range []string{"key-alpha-123", "key-beta-4567", "admin-key-xyz", "s3cret"} {
		if strings.Contains(p.logs.String(), k) {
			t.Fatalf("a key or secret leaked into the log: %s", k)
		}
	}
}

func TestTenantsNeverShareIndexEntries(t *testing.T) {
	e := startFake(t, "e0", nil)
	e1 := startFake(t, "e1", nil)
	p := startProxyYAML(t, strings.Replace(tenantsYAML, "  - {id: e0, url: 'http://{{e0}}', model: m, kind: vllm}",
		"  - {id: e0, url: 'http://{{e0}}', model: m, kind: vllm}\n  - {id: e1, url: 'http://{{e1}}', model: m, kind: vllm}", 1), e, e1)
	prompt := `{"model":"m","nvext":{"annotations":["query_instance_id"]},"messages":[{"role":"user","content":"` + strings.Repeat("private context ", 80) + `"}]}`
	real := strings.Replace(prompt, `"nvext":{"annotations":["query_instance_id"]},`, "", 1)
	postAuth(t, p.url+"/v1/chat/completions", "key-alpha-123", real)
	overlap := func(key string) int {
		_, b := postAuth(t, p.url+"/v1/chat/completions", key, prompt)
		var d decisionJSON
		if err := json.Unmarshal([]byte(b), &d); err != nil {
			t.Fatal(b)
		}
		return d.OverlapBlocks
	}
	if overlap("key-alpha-123") == 0 {
		t.Fatal("the same tenant must find its cached prefix")
	}
	if n := overlap("key-beta-4567"); n != 0 {
		t.Fatalf("another tenant matched %d blocks of alpha's prompt", n)
	}
	p.waitIdle(t)
}

func TestRequestLimits(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}'}]
limits: {max_messages: 3, max_prompt_tokens: 100, max_header_bytes: 2048, header_timeout: 300ms}
`, e)
	msgs := `[{"role":"user","content":"a"},{"role":"user","content":"b"},{"role":"user","content":"c"},{"role":"user","content":"d"}]`
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":`+msgs+`}`); resp.StatusCode != 400 || !strings.Contains(string(b), `"param":"messages"`) {
		t.Fatalf("too many messages: %d %s", resp.StatusCode, b)
	}
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"`+strings.Repeat("word ", 200)+`"}`); resp.StatusCode != 400 || !strings.Contains(string(b), "context_length_exceeded") {
		t.Fatalf("too many tokens: %d %s", resp.StatusCode, b)
	}
	// A batch names the prompt past the limit, not one estimated after it
	// (found by the session's review: prompt[2], of 80 tokens, was named).
	batch := `{"model":"m","prompt":["hi","` + strings.Repeat("hello ", 200) + `","` + strings.Repeat("hello world ", 40) + `"]}`
	if resp, b := post(t, p.url+"/v1/completions", batch); resp.StatusCode != 400 || !strings.Contains(string(b), `"param":"prompt[1]"`) {
		t.Fatalf("a batch with a prompt too long: %d %s", resp.StatusCode, b)
	}
	// Tokenizing stops at the limit: the count is not known, and not said.
	chat := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("word ", 20000) + `"}]}`
	if resp, b := post(t, p.url+"/v1/chat/completions", chat); resp.StatusCode != 400 || !strings.Contains(string(b), "the prompt has more tokens than the limit of 100") {
		t.Fatalf("too many tokens in a chat: %d %s", resp.StatusCode, b)
	}
	// count_tokens too stops at the limit (TestCountTokensIsBounded).
	count := `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"` + strings.Repeat("word ", 20000) + `"}]}`
	if resp, b := post(t, p.url+"/v1/messages/count_tokens", count); resp.StatusCode != 400 || !strings.Contains(string(b), "prompt is too long") {
		t.Fatalf("count_tokens over the limit: %d %s", resp.StatusCode, b)
	}
	req, _ := http.NewRequest("POST", p.url+"/v1/completions", strings.NewReader(`{}`))
	req.Header.Set("X-Big", strings.Repeat("x", 4096))
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 431 {
		t.Fatalf("oversized header: %v %v", err, resp)
	}
	// Slowloris: headers that never finish are cut off at header_timeout.
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	line, _ := bufio.NewReader(c).ReadString('\n')
	if !strings.Contains(line, "408") && line != "" {
		t.Fatalf("slow header: got %q", line)
	}
	if time.Since(start) > 3*time.Second {
		t.Fatal("a slow client kept its connection past the header timeout")
	}
	if e.requests.Load() != 0 {
		t.Fatal("rejected requests reached the engine")
	}
}

// answeredBy posts a chat body and wants a 200 from the backend named.
func answeredBy(t *testing.T, p *testProxy, body, backend string) {
	t.Helper()
	resp, b := post(t, p.url+"/v1/chat/completions", body)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != backend {
		t.Fatalf("%d via %s, want 200 via %s: %s", resp.StatusCode, resp.Header.Get(WorkerHeader), backend, b)
	}
}

func TestEngine503IsRetriedElsewhere(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) {
		f.status = 503
		f.errBody = `{"error":{"message":"overloaded","type":"server_error"}}`
	})
	good := startFake(t, "good", nil)
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: busy, url: 'http://{{e0}}'}, {id: good, url: 'http://{{e1}}'}]
router: {policy: round_robin}
`, busy, good)
	for range 6 {
		answeredBy(t, p, chatBody, "good")
	}
	if busy.requests.Load() == 0 {
		t.Fatal("round robin should have tried the busy engine")
	}
	p.waitIdle(t)

	if busy.requests.Load() != 1 {
		t.Fatalf("an engine answering 503 gets a break; it saw %d requests", busy.requests.Load())
	}
	// Pinned to the busy (ejected) engine: no retry elsewhere; a 503 with
	// Retry-After in OpenAI's shape.
	resp, b := post(t, p.url+"/v1/chat/completions", strings.Replace(chatBody, `"nvext":{"annotations":[]}`, `"nvext":{"backend_instance_id":"busy"}`, 1))
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" || !strings.Contains(string(b), `{"error":{"message":`) {
		t.Fatalf("pinned 503: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	p.waitIdle(t)
}

// An engine's 500, 502 or 504 before any answer is retried on another
// engine, streamed or not: a client's own retry would be routed back to
// the same cache. When every engine fails it, the client gets the last
// engine's error in OpenAI's shape.
func TestEngine5xxIsRetriedElsewhere(t *testing.T) {
	for _, code := range []int{500, 502, 504} {
		t.Run(strconv.Itoa(code), func(t *testing.T) {
			bad := startFake(t, "bad", func(f *fakeEngine) {
				f.status, f.errBody = code, `{"error":{"message":"CUDA error: an illegal memory access","type":"InternalServerError"}}`
			})
			good := startFake(t, "good", nil)
			p := startProxyYAML(t, "models: [{name: m, aliases: [alias-m]}]\nbackends: [{id: bad, url: 'http://{{e0}}'}, {id: good, url: 'http://{{e1}}'}]\n"+
				"router: {policy: round_robin}\nhealth: {eject_base: 1m, eject_max: 1m}\n", bad, good)
			for _, body := range []string{chatBody, `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`} {
				answeredBy(t, p, body, "good")
			}
			if bad.requests.Load() == 0 {
				t.Fatal("round robin never tried the failing engine")
			}
			p.waitIdle(t)
			if want := `"retried_after":"backend bad answered ` + strconv.Itoa(code) + ` (type InternalServerError)"`; !strings.Contains(p.logs.String(), want) {
				t.Fatalf("the log does not say what the request was retried after (%s):\n%s", want, p.logs.String())
			}
		})
	}
	t.Run("every engine", func(t *testing.T) {
		var es []*fakeEngine
		for _, id := range []string{"a", "b"} {
			es = append(es, startFake(t, id, func(f *fakeEngine) {
				f.status, f.errBody = 500, `{"error":{"message":"boom","type":"InternalServerError"}}`
			}))
		}
		p := startProxyYAML(t, "models: [{name: m, aliases: [alias-m]}]\nbackends: [{id: a, url: 'http://{{e0}}'}, {id: b, url: 'http://{{e1}}'}]\n", es...)
		long := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("tell me more about caches ", 20) + `"}]}`
		resp, b := post(t, p.url+"/v1/chat/completions", long)
		if resp.StatusCode != 500 || !strings.Contains(string(b), `{"error":{"message":"boom"`) || resp.Header.Get("Retry-After") != "" {
			t.Fatalf("every engine failing: %d %v %s", resp.StatusCode, resp.Header, b)
		}
		if es[0].requests.Load() != 1 || es[1].requests.Load() != 1 {
			t.Fatalf("each engine should have been asked once: %d, %d", es[0].requests.Load(), es[1].requests.Load())
		}
		// Routed twice, counted once among the prefixes' requests.
		if n := p.s.st.Load().models["m"].rt.CountedRequests(); n != 1 {
			t.Fatalf("the request tried on both engines was counted %d times", n)
		}
		p.waitIdle(t)
	})
}

func TestFailingBackendIsEjectedAndReturns(t *testing.T) {
	bad := startFake(t, "bad", func(f *fakeEngine) { f.status = 500; f.errBody = "boom" })
	good := startFake(t, "good", nil)
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: bad, url: 'http://{{e0}}'}, {id: good, url: 'http://{{e1}}'}]
router: {policy: round_robin}
health: {eject_base: 300ms, eject_max: 1s}
`, bad, good)
	codes := map[int]int{}
	for i := 0; i < 8; i++ {
		resp, _ := post(t, p.url+"/v1/chat/completions", chatBody)
		codes[resp.StatusCode]++
	}
	// Each of its 500s was retried on good.
	if codes[200] != 8 || bad.requests.Load() != errorAnswerLimit {
		t.Fatalf("after %d 500s in a row the backend must be ejected: codes %v, bad saw %d", errorAnswerLimit, codes, bad.requests.Load())
	}
	// /admin/backends says why (the operator trial had to guess it from
	// the log).
	down := func() map[string]*downJSON {
		r, err := http.Get(p.url + "/admin/backends")
		if err != nil {
			t.Fatal(err)
		}
		defer r.Body.Close()
		var rows []backendJSON
		json.NewDecoder(r.Body).Decode(&rows)
		out := map[string]*downJSON{}
		for _, row := range rows {
			if row.Healthy != (row.Down == nil) {
				t.Fatalf("%s: healthy %v but down %+v", row.ID, row.Healthy, row.Down)
			}
			out[row.ID] = row.Down
		}
		return out
	}
	if d := down(); d["good"] != nil || d["bad"] == nil || d["bad"].EjectedBy != ejectErrorAnswers ||
		!strings.Contains(d["bad"].Reason, "500") || d["bad"].Since == "" {
		t.Fatalf("why the backend is down: %+v", d["bad"])
	}
	bad.status = 0 // it recovers
	deadline := time.Now().Add(3 * time.Second)
	for bad.requests.Load() < errorAnswerLimit+1 {
		if time.Now().After(deadline) {
			t.Fatal("the ejected backend never came back")
		}
		post(t, p.url+"/v1/chat/completions", chatBody)
		time.Sleep(20 * time.Millisecond)
	}
	p.waitIdle(t)
	if d := down(); d["bad"] != nil {
		t.Fatalf("back, and still down: %+v", d["bad"])
	}
}

func TestReloadAddsAndRemovesBackendsDuringStreams(t *testing.T) {
	old := startFake(t, "old", func(f *fakeEngine) { f.tokens = 30; f.pauseAfter = 5; f.pause = 500 * time.Millisecond })
	added := startFake(t, "added", nil)
	yaml := func(ids ...string) *config.Config {
		var b strings.Builder
		b.WriteString("models: [{name: m, aliases: [alias-m]}]\nbackends:\n")
		for _, id := range ids {
			addr := old.addr
			if id == "added" {
				addr = added.addr
			}
			fmt.Fprintf(&b, "  - {id: %s, url: 'http://%s'}\n", id, addr)
		}
		cfg, err := config.Parse([]byte(b.String()))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	p := startProxyYAML(t, "models: [{name: m, aliases: [alias-m]}]\nbackends: [{id: old, url: 'http://{{e0}}'}]\n", old)
	streamDone := make(chan string)
	go func() {
		_, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"`+strings.Repeat("hello ", 40)+`","stream":true}`)
		streamDone <- string(b)
	}()
	for old.requests.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	// Swap the fleet while the stream is running on "old".
	if err := p.s.Reload(yaml("added")); err != nil {
		t.Fatal(err)
	}
	resp, _ := post(t, p.url+"/v1/chat/completions", chatBody)
	if resp.Header.Get(WorkerHeader) != "added" {
		t.Fatalf("after reload new requests must go to the added backend, got %q", resp.Header.Get(WorkerHeader))
	}
	s := <-streamDone
	if !strings.Contains(s, `"t29 "`) || !strings.HasSuffix(s, "data: [DONE]\n\n") {
		t.Fatalf("the stream on the removed backend was cut: %s", s)
	}
	p.waitIdle(t)
	// Once drained, the removed backend's worker and index entries are gone.
	deadline := time.Now().Add(3 * time.Second)
	for {
		pool := p.s.st.Load().pools[0]
		idx := pool.rt.Index().WorkerBlocks(pool.backend(0).worker)
		if ws := pool.rt.Workers(); len(ws) > 0 && !ws[0].Available && idx == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("removed backend still indexed: %+v", pool.rt.Workers())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// An invalid config is rejected and the current one keeps serving.
	bad := yaml("added")
	bad.Router.Policy = "nonsense"
	if err := p.s.Reload(bad); err == nil {
		t.Fatal("invalid config accepted")
	}
	if resp, _ := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 200 {
		t.Fatalf("serving broke after a rejected reload: %d", resp.StatusCode)
	}
	p.waitIdle(t)
}

func TestConcurrencyLimitQueuesThenSheds(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 600 * time.Millisecond })
	var p *testProxy
	var shedMu sync.Mutex
	shed := map[string]int{} // the 503s' error codes
	run := func(yaml string, n int) map[int]int {
		p = startProxyYAML(t, yaml, e)
		codes := make(chan int, n)
		for i := 0; i < n; i++ {
			go func() {
				resp, b := post(t, p.url+"/v1/chat/completions", chatBody)
				if resp.StatusCode == 503 && (resp.Header.Get("Retry-After") == "" || !strings.Contains(string(b), `"error"`)) {
					t.Errorf("503 without Retry-After or error object: %s", b)
				}
				// Retry-After-Ms from 0.5 to 1.5 s: the SDKs wait exactly
				// that, and clients refused together came back together
				// (the twenty-ninth session's SDK trial).
				if ms, err := strconv.Atoi(resp.Header.Get("Retry-After-Ms")); resp.StatusCode == 503 && (err != nil || ms < 500 || ms > 1500) {
					t.Errorf("503 with Retry-After-Ms %q", resp.Header.Get("Retry-After-Ms"))
				}
				if resp.StatusCode == 503 {
					var eb struct{ Error struct{ Code string } }
					json.Unmarshal([]byte(b), &eb)
					shedMu.Lock()
					shed[eb.Error.Code]++
					shedMu.Unlock()
				}
				codes <- resp.StatusCode
			}()
		}
		got := map[int]int{}
		for i := 0; i < n; i++ {
			got[<-codes]++
		}
		p.waitIdle(t)
		if max := inflightPeak(e); max > 2 {
			t.Fatalf("engine saw %d concurrent requests with max_concurrency 2", max)
		}
		return got
	}
	// Short queue timeout: 2 served, 2 wait and time out, 2 shed at once.
	got := run(`
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 2}]
limits: {max_queue: 2, queue_timeout: 200ms}
`, 6)
	if got[200] != 2 || got[503] != 4 {
		t.Fatalf("want 2 served and 4 shed, got %v", got)
	}
	// Saturation, told apart from an outage by the client too (the
	// newcomer trial: both were no_backend_available).
	if shed["queue_full"] != 2 || shed["queue_timeout"] != 2 {
		t.Fatalf("the 503s' codes: %v, want 2 queue_full and 2 queue_timeout", shed)
	}
	// Saturation, told apart from an outage (the operator trial).
	m := p.metrics(t)
	for _, want := range []string{`kvproxy_unavailable_total{reason="queue_full"} 2`, `kvproxy_unavailable_total{reason="queue_timeout"} 2`, `kvproxy_unavailable_total{reason="no_healthy_backend"} 0`} {
		if !strings.Contains(m, want) {
			t.Errorf("want %s:\n%s", want, grepLines(m, "unavailable_total"))
		}
	}
	// A queue timeout longer than a request: waiting requests get served.
	got = run(`
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 2}]
limits: {max_queue: 8, queue_timeout: 5s}
`, 6)
	if got[200] != 6 {
		t.Fatalf("queued requests should all be served, got %v", got)
	}
}

// inflightPeak is the most requests the fake engine had at once.
func inflightPeak(f *fakeEngine) int64 { return f.peak.Load() }

// A reload that changes only router settings keeps the router and all it
// knows of the engines' caches.
func TestReloadKeepsIndex(t *testing.T) {
	e := startFake(t, "e0", nil)
	yaml := "models: [{name: m, aliases: [alias-m]}]\nbackends: [{id: e0, url: 'http://{{e0}}'}]\n"
	p := startProxyYAML(t, yaml, e)
	post(t, p.url+"/v1/chat/completions", chatBody)
	p.waitIdle(t)
	before := p.s.backendRows(p.s.st.Load())[0].IndexedBlocks
	cfg, err := config.Parse([]byte(strings.ReplaceAll(yaml, "{{e0}}", e.addr) + "router: {temperature: 0.1}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if after := p.s.backendRows(p.s.st.Load())[0].IndexedBlocks; before == 0 || after != before {
		t.Fatalf("indexed blocks %d before the reload, %d after", before, after)
	}
	if strings.Contains(p.logs.String(), "backend retired") {
		t.Fatal("an unchanged backend was retired by the reload")
	}
}

// A client that hangs up while its request waits in the queue leaves the
// queue at once (499), long before the queue timeout.
func TestQueuedClientHangsUp(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	p := startProxyYAML(t, `
models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]
limits: {max_queue: 4, queue_timeout: 10s}
`, e)
	first := make(chan int)
	go func() {
		resp, _ := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"first"}`)
		first <- resp.StatusCode
	}()
	waitFor(t, "the first request at the engine", func() bool { return e.requests.Load() == 1 })
	c := rawCompletion(t, p, `{"model":"m","prompt":"second"}`)
	waitFor(t, "the second request in the queue", func() bool { return p.s.queued.Load() == 1 })
	c.Close()
	waitFor(t, "the queue to let the departed client go", func() bool { return p.s.queued.Load() == 0 })
	if code := <-first; code != 200 {
		t.Fatalf("first request: %d", code)
	}
	if !strings.Contains(p.logs.String(), errClientGone.Error()) || e.requests.Load() != 1 {
		t.Fatalf("the departed client's request was not dropped (engine requests %d):\n%s", e.requests.Load(), p.logs.String())
	}
	p.waitIdle(t)
}

// waitFor polls cond for up to 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// A healthy backend at its max_concurrency queues requests; none is told
// that no backend is available, even when a slot frees just as it routes
// (the backend is full when the router looks, and no longer when the
// request decides whether to wait).
func TestFullBackendNeverAnswersNoBackend(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]
limits: {max_queue: 64, queue_timeout: 5s}
`, e)
	const clients, each = 16, 100
	errs := make(chan string, clients*each)
	var wg sync.WaitGroup
	for g := 0; g < clients; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cl := &http.Client{Transport: &http.Transport{}}
			defer cl.CloseIdleConnections()
			for i := 0; i < each; i++ {
				resp, err := cl.Post(p.url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
				if err != nil {
					errs <- err.Error()
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					errs <- fmt.Sprintf("%d: %s", resp.StatusCode, b)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	n := 0
	for msg := range errs {
		if n++; n <= 3 {
			t.Error(msg)
		}
	}
	if n > 0 {
		t.Fatalf("%d of %d requests failed", n, clients*each)
	}
	p.waitIdle(t)
}

// A client that hangs up while its request's second attempt waits for the
// engine (the first was refused with 429) aborts that attempt and frees
// both slots: the router's and the backend's.
func TestHangUpDuringRetriedAttempt(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprint("stream=", stream), func(t *testing.T) {
			busy := startFake(t, "busy", func(f *fakeEngine) { f.status = 429; f.errBody = `{"error":{"message":"busy"}}` })
			slow := startFake(t, "slow", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
			p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: busy, url: 'http://{{e0}}', max_concurrency: 1}, {id: slow, url: 'http://{{e1}}', max_concurrency: 1}]
router: {policy: round_robin}
`, busy, slow)
			for i := int64(1); i <= 2; i++ {
				waitCooled(t, p, "busy") // the first refusal cooled it down
				c := rawCompletion(t, p, fmt.Sprintf(`{"model":"m","prompt":"slow","stream":%v}`, stream))
				deadline := time.Now().Add(3 * time.Second)
				for slow.current.Load() == 0 && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
				if busy.requests.Load() != i || slow.requests.Load() != i {
					t.Fatalf("request %d: busy saw %d, slow %d: want a refused first attempt and a second", i, busy.requests.Load(), slow.requests.Load())
				}
				c.Close()
				for slow.aborted.Load() != i {
					if time.Now().After(deadline) {
						t.Fatal("the engine never saw the abort")
					}
					time.Sleep(time.Millisecond)
				}
				p.waitIdle(t)
				for _, b := range *p.s.st.Load().pools[0].workers.Load() {
					if b != nil && b.slots.held.Load() != 0 {
						t.Fatalf("backend %s still holds %d slots", b.cfg.ID, b.slots.held.Load())
					}
				}
			}
		})
	}
}

// TestCutAtDrainDeadline: requests still in flight when the drain deadline
// passes are answered, not dropped: a stream ends with an OpenAI error event
// and [DONE], a request whose answer has not begun gets a 503, and no slot
// is left behind.
func TestCutAtDrainDeadline(t *testing.T) {
	slowStream := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 5, 2, 10*time.Second })
	slowPrefill := startFake(t, "e1", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	p := startProxy(t, "kv", slowStream, slowPrefill)
	pinned := func(id string, stream bool) string {
		b := strings.Replace(chatBody, `"nvext":{"annotations":[]}`, `"nvext":{"backend_instance_id":"`+id+`"}`, 1)
		if stream {
			b = strings.Replace(b, `"model"`, `"stream":true,"model"`, 1)
		}
		return b
	}
	resp, err := http.Post(p.url+"/v1/chat/completions", "application/json", strings.NewReader(pinned("e0", true)))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("stream: %v %v", err, resp)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	readEvents(t, rd, 3) // the role chunk and two tokens, then the engine pauses
	whole := make(chan string, 1)
	go func() {
		r, b := post(t, p.url+"/v1/chat/completions", pinned("e1", false))
		whole <- fmt.Sprintf("%d %s", r.StatusCode, b)
	}()
	for slowPrefill.requests.Load() == 0 {
		time.Sleep(time.Millisecond)
	}

	start := time.Now()
	if n := p.s.Cut(); n != 2 {
		t.Fatalf("cut %d requests, want 2", n)
	}
	rest, err := io.ReadAll(rd)
	if err != nil {
		t.Fatalf("the stream did not end cleanly: %v", err)
	}
	if !strings.Contains(string(rest), `"code":"shutting_down"`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("stream ending: %q", rest)
	}
	if got := <-whole; !strings.HasPrefix(got, "503 ") || !strings.Contains(got, "shutting down") {
		t.Fatalf("non-streamed request: %s", got)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("answered %v after the cut", took)
	}
	if r, b := post(t, p.url+"/v1/chat/completions", pinned("e0", false)); r.StatusCode != 503 {
		t.Fatalf("a request after the cut: %d %s", r.StatusCode, b)
	}
	p.waitIdle(t)
}

// TestRefusedRequestGoesToTheNextBest: a request an engine refuses (429)
// is retried on another engine, even when the refusing one holds its prefix
// and is still available; when every engine refuses, the client gets the
// refusal (429, Retry-After), not "no healthy backend".
func TestRefusedRequestGoesToTheNextBest(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.status = 429; f.errBody = `{"error":{"message":"busy"}}` })
	ok := startFake(t, "ok", nil)
	p := startProxy(t, "kv", busy, ok)
	pinned := strings.Replace(chatBody, `"nvext":{"annotations":[]}`, `"nvext":{"backend_instance_id":"busy"}`, 1)
	if resp, b := post(t, p.url+"/v1/chat/completions", pinned); resp.StatusCode != 429 {
		t.Fatalf("pinned to busy: %d %s", resp.StatusCode, b) // and the prompt is now busy's, for the router
	}
	for i := 0; i < 3; i++ {
		resp, b := post(t, p.url+"/v1/chat/completions", chatBody)
		if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "ok" {
			t.Fatalf("request %d: %d from %q: %s", i, resp.StatusCode, resp.Header.Get(WorkerHeader), b)
		}
	}
	// One refused attempt: the 429 cooled busy down (for its Retry-After,
	// 1 s by default), so the later requests went straight to ok.
	if n := busy.requests.Load(); n != 2 {
		t.Fatalf("busy saw %d requests, want the pinned one and one refused attempt", n)
	}
	// Once the cooling is over, busy is chosen again (it holds the prefix).
	waitCooled(t, p, "busy")
	if resp, b := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 200 || busy.requests.Load() != 3 {
		t.Fatalf("after cooling: %d %s, busy saw %d", resp.StatusCode, b, busy.requests.Load())
	}
	p.waitIdle(t)

	busy2 := startFake(t, "busy2", func(f *fakeEngine) {
		f.status, f.retryAfter = 429, "7"
		f.errBody = `{"object":"error","message":"engine busy","type":"RateLimitError","param":null,"code":429}`
	})
	p2 := startProxy(t, "kv", busy, busy2)
	before := busy.requests.Load()
	resp, b := post(t, p2.url+"/v1/chat/completions", chatBody)
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" || !strings.Contains(string(b), `"message":"`) {
		t.Fatalf("every engine refuses: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	if busy.requests.Load()-before != 1 || busy2.requests.Load() != 1 {
		t.Fatalf("busy saw %d, busy2 %d attempts; want one each", busy.requests.Load()-before, busy2.requests.Load())
	}
	p2.waitIdle(t)

	// The refusal reaches the client as its engine gave it: message, type
	// (in OpenAI's words) and Retry-After (SDKs wait that long).
	// A model's last available backend is never cooled down: each request
	// still reaches it.
	p3 := startProxy(t, "kv", busy2)
	for i := int64(1); i <= 3; i++ {
		before := busy2.requests.Load()
		resp, b = post(t, p3.url+"/v1/chat/completions", chatBody)
		if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "7" || resp.Header.Get(WorkerHeader) != "busy2" ||
			!strings.Contains(string(b), `{"error":{"message":"engine busy","type":"rate_limit_error","param":null,"code":null}}`) {
			t.Fatalf("the engine's refusal: %d %v %s", resp.StatusCode, resp.Header, b)
		}
		if busy2.requests.Load() != before+1 {
			t.Fatalf("request %d did not reach the only backend", i)
		}
	}
	p3.waitIdle(t)
}

// TestReloadEventsToNoneIsApproximate: a backend reconfigured from pushed
// KV events to none keeps its worker, which must go back to approximate
// mode (the router records its own decisions), or nothing would ever index
// it again.
func TestReloadEventsToNoneIsApproximate(t *testing.T) {
	e := startFake(t, "e0", nil)
	conf := func(mode string) string {
		return "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
			"backends: [{id: e0, url: 'http://" + e.addr + "', model: m, kv_events: {mode: " + mode + "}}]\n"
	}
	p := startProxyYAML(t, conf("http"))
	prompt := `{"model":"m","prompt":"` + strings.Repeat("a long shared prompt ", 20) + `"`
	overlap := func() int {
		t.Helper()
		if resp, b := post(t, p.url+"/v1/completions", prompt+`}`); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		_, b := post(t, p.url+"/v1/completions", prompt+`,"nvext":{"annotations":["query_instance_id"]}}`)
		var d decisionJSON
		if err := json.Unmarshal(b, &d); err != nil || d.TotalBlocks == 0 {
			t.Fatalf("dry run: %s", b)
		}
		return d.OverlapBlocks
	}
	if n := overlap(); n != 0 {
		t.Fatalf("event mode with no events pushed: overlap %d", n)
	}
	cfg, err := config.Parse([]byte(conf("none")))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if n := overlap(); n == 0 {
		t.Fatal("after the reload to kv_events none, the routed prompt is not recorded")
	}
	p.waitIdle(t)
}

// TestForgetClearsThroughTheEventFeed: a backend away longer than
// health.forget_after loses its index entries, and its event feed forgets
// its blocks with them (the feed's counts and engine-hash map must not
// outlive the index entries they describe).
func TestForgetClearsThroughTheEventFeed(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+e.addr+"', model: m, kv_events: {mode: http}}]\n"+
		"health: {forget_after: 50ms}\n")
	tokens := make([]string, 32)
	for i := range tokens {
		tokens[i] = fmt.Sprint(100 + i)
	}
	// Of a hybrid model's full attention group: the rank follows group 1.
	batch := `{"engine_id":"e0","events":[{"type":"block_stored","block_hashes":[11,12],"parent_block_hash":null,"token_ids":[` +
		strings.Join(tokens, ",") + `],"block_size":16,"group_idx":1,"kv_cache_spec_kind":"full_attention"}]}`
	if resp, b := post(t, p.url+"/v1/kv_events", batch); resp.StatusCode != 200 {
		t.Fatalf("push: %d %s", resp.StatusCode, b)
	}
	b := p.s.st.Load().backends["e0"]
	if st := b.feed.Applier().Stats(); st.Blocks[0] != 2 {
		t.Fatalf("feed holds %v blocks, want 2 on the device", st.Blocks)
	}
	e.srv.Close() // the engine goes away; the next request ejects it
	post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
	deadline := time.Now().Add(5 * time.Second)
	for b.feed.Applier().Stats().Blocks[0] != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the feed still counts %v blocks after forget_after", b.feed.Applier().Stats().Blocks)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := p.s.st.Load().pools[0].rt.Index().WorkerBlocks(b.worker); n != 0 {
		t.Fatalf("the index still holds %d blocks", n)
	}
	// The group choice went with the blocks: an engine back with another
	// layout, its events naming no group, is followed.
	plain := strings.Replace(batch, `,"group_idx":1,"kv_cache_spec_kind":"full_attention"`, "", 1)
	if resp, body := post(t, p.url+"/v1/kv_events", plain); resp.StatusCode != 200 || !strings.Contains(string(body), `"applied":1`) {
		t.Fatalf("a push after the forget: %d %s", resp.StatusCode, body)
	}
	p.waitIdle(t)
}

// TestAdminClosedWithoutAdminKeys: with client keys and no admin keys the
// admin endpoints are closed, and the answer says why and what to set.
func TestAdminClosedWithoutAdminKeys(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, strings.Replace(tenantsYAML, "  admin_keys: [admin-key-xyz]\n", "", 1), e)
	req, _ := http.NewRequest("GET", p.url+"/admin/backends", nil)
	req.Header.Set("Authorization", "Bearer key-alpha-123")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 403 || !strings.Contains(string(b), "auth.admin_keys") || !strings.Contains(string(b), `"code":"admin_disabled"`) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}

// TestHTTP10StreamIsCloseDelimited: HTTP/1.0 has no chunked encoding, so a
// stream to an HTTP/1.0 client carries no Transfer-Encoding and ends by
// closing the connection, with every event intact; a whole answer keeps its
// Content-Length.
func TestHTTP10StreamIsCloseDelimited(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens = 20 })
	p := startProxy(t, "kv", e)
	sendTo := func(path, body string) (head, payload string) {
		c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(c, "POST %s HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
		all, err := io.ReadAll(c) // to EOF: the proxy must close
		if err != nil {
			t.Fatalf("reading to the close: %v", err)
		}
		h, b, _ := strings.Cut(string(all), "\r\n\r\n")
		return strings.ToLower(h), b
	}
	send := func(body string) (head, payload string) { return sendTo("/v1/completions", body) }
	head, body := send(`{"model":"m","prompt":"hello","stream":true}`)
	if !strings.Contains(head, " 200 ") || strings.Contains(head, "transfer-encoding") || strings.Contains(head, "content-length") ||
		!strings.Contains(head, "connection: close") || !strings.Contains(head, "x-kvproxy-worker: e0") {
		t.Fatalf("stream head:\n%s", head)
	}
	if n := strings.Count(body, "data: {"); n != 21 || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("stream body (%d events):\n%q", n, body)
	}
	head, body = send(`{"model":"m","prompt":"hello"}`)
	if !strings.Contains(head, " 200 ") || !strings.Contains(head, fmt.Sprintf("content-length: %d", len(body))) {
		t.Fatalf("whole answer head:\n%s\n%s", head, body)
	}
	// Anthropic's SDKs read the request's id from request-id, which
	// handle used to set after the hijacked stream's head had gone.
	head, _ = sendTo("/v1/messages", `{"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if !strings.Contains(head, " 200 ") || !strings.Contains(head, "\r\nrequest-id: ") {
		t.Fatalf("Messages stream head:\n%s", head)
	}
	p.waitIdle(t)
}

// TestAdminReloadCallsTheReloaderOnce: POST /admin/reload is the command's
// reload, applied once (it used to apply the loaded configuration a second
// time itself); its refusal is a 400 that keeps the running configuration.
func TestAdminReloadCallsTheReloaderOnce(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	if resp, b := post(t, p.url+"/admin/reload", ""); resp.StatusCode != 501 {
		t.Fatalf("without a reloader: %d %s", resp.StatusCode, b)
	}
	var calls atomic.Int64
	var fail atomic.Bool
	p.s.SetReloader(func() error {
		calls.Add(1)
		if fail.Load() {
			return fmt.Errorf("backends[0].url: bad")
		}
		return nil
	})
	if resp, b := post(t, p.url+"/admin/reload", ""); resp.StatusCode != 200 || calls.Load() != 1 {
		t.Fatalf("reload: %d %s, %d calls", resp.StatusCode, b, calls.Load())
	}
	fail.Store(true)
	if resp, b := post(t, p.url+"/admin/reload", ""); resp.StatusCode != 400 || calls.Load() != 2 || !strings.Contains(string(b), "backends[0].url: bad") {
		t.Fatalf("refused reload: %d %s, %d calls", resp.StatusCode, b, calls.Load())
	}
	if !strings.Contains(p.logs.String(), "backends[0].url: bad") {
		t.Fatal("the refused reload is not logged")
	}
	if strings.Count(p.logs.String(), "configuration reloaded") != 0 {
		t.Fatal("the endpoint applied a configuration itself")
	}
}

// waitCooled waits until backend id is no longer cooling down after a 429.
func waitCooled(t *testing.T, p *testProxy, id string) {
	t.Helper()
	b := p.s.st.Load().backends[id]
	deadline := time.Now().Add(5 * time.Second)
	for {
		b.mu.Lock()
		cooling := b.cooling
		b.mu.Unlock()
		if !cooling {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never came back from cooling down", id)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestReloadSaysWhatWaitsForARestart: a reload that changes the listen
// address or router settings keeps the running ones, and the admin answer
// says so instead of a bare "reloaded".
func TestReloadSaysWhatWaitsForARestart(t *testing.T) {
	e := startFake(t, "e0", nil)
	conf := func(listen, policy string) *config.Config {
		c, err := config.Parse([]byte("listen: " + listen + "\nmodels: [{name: m}]\nbackends: [{id: e0, url: 'http://" + e.addr + "', model: m}]\nrouter: {policy: " + policy + "}\n"))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	p := startProxyYAML(t, "listen: 127.0.0.1:8080\nmodels: [{name: m}]\nbackends: [{id: e0, url: 'http://"+e.addr+"', model: m}]\nrouter: {policy: kv}\n")
	var next atomic.Pointer[config.Config]
	p.s.SetReloader(func() error { return p.s.Reload(next.Load()) })
	for _, c := range []struct {
		cfg  *config.Config
		want string
	}{
		{conf("127.0.0.1:8080", "kv"), `{"status":"reloaded"}`},
		{conf("127.0.0.1:9999", "round_robin"), `{"restart_needed":["router (model m)","listen"],"status":"reloaded"}`},
	} {
		next.Store(c.cfg)
		if resp, b := post(t, p.url+"/admin/reload", ""); resp.StatusCode != 200 || string(b) != c.want {
			t.Fatalf("reload: %d %s, want %s", resp.StatusCode, b, c.want)
		}
	}
	if got := p.s.st.Load().cfg.Listen; got != "127.0.0.1:8080" {
		t.Fatalf("listen became %q", got)
	}
}

// readEvents reads n SSE data lines of a stream.
func readEvents(t *testing.T, rd *bufio.Reader, n int) {
	t.Helper()
	for seen := 0; seen < n; {
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(line, "data: ") {
			seen++
		}
	}
}

// rawHead sends head (request line and headers, and any body bytes) on a
// new connection and returns the first answer's status line and body, or
// fails if none comes within wait.
func rawHead(t *testing.T, p *testProxy, head string, wait time.Duration) (status, body string) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(wait))
	if _, err := io.WriteString(c, head); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no answer to %q within %v: %v", head[:min(len(head), 60)], wait, err)
	}
	b, _ := io.ReadAll(resp.Body)
	return resp.Status, string(b)
}

// With keys configured, a request without a known key is refused at its
// headers: fasthttp allocates a body's declared length before reading it,
// and each connection of anyone who could reach the port held up to
// max_request_body_bytes (32 MB) until body_timeout (found by the twelfth
// session's abuse trial: 30 sockets took 1 GB). Known keys keep the limit.
func TestStrangersBodiesAreNotRead(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, tenantsYAML, e)
	// Declared bodies at the limit (32 MB), one byte of them sent.
	head := "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n{"
	for _, tc := range []struct {
		path, headers string
		length        int
		want          string
	}{
		{"/v1/chat/completions", "", 32 << 20, `"code":"invalid_api_key"`},
		{"/v1/chat/completions", "Authorization: Bearer wrong-key-000\r\n", 32 << 20, `"code":"invalid_api_key"`},
		{"/v1/messages", "x-api-key: wrong-key-000\r\n", 32 << 20, `"type":"authentication_error"`},
		{"/admin/index/lookup", "", 32 << 20, `"code":"invalid_api_key"`},
		{"/v1/chat/completions", "Expect: 100-continue\r\n", 32 << 20, `"code":"invalid_api_key"`},
		// A known key over the limit: refused before its body too.
		{"/v1/chat/completions", "Authorization: Bearer key-alpha-123\r\nExpect: 100-continue\r\n", 32<<20 + 1, `"code":"request_too_large"`},
	} {
		status, body := rawHead(t, p, fmt.Sprintf(head, tc.path, tc.length, tc.headers), 3*time.Second)
		if strings.Contains(status, "100") || !strings.Contains(body, tc.want) {
			t.Fatalf("%s %q: %s %s", tc.path, tc.headers, status, body)
		}
	}
	// The refusal at the headers and at Expect is logged as the handler's is.
	if logs := p.logs.String(); !strings.Contains(logs, `"status":413,"error":"body too large"`) || strings.Count(logs, `"error":"invalid api key"`) < 5 {
		t.Fatalf("the refusals are not all in the log:\n%s", logs)
	}
	// A client that sends its whole body before reading (Go's, the SDKs')
	// gets the 401, not a reset from a connection closed on unread data,
	// and a page gets it with its CORS headers (found by the review).
	req, _ := http.NewRequest("POST", p.url+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"`+strings.Repeat("hello world ", 300000)+`"}]}`))
	req.Header.Set("Authorization", "Bearer wrong-key-000")
	req.Header.Set("Origin", "https://app.example.com")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("a 3.6 MB body with a wrong key: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 || resp.Header.Get("Access-Control-Allow-Origin") != "*" {
		t.Fatalf("a 3.6 MB body with a wrong key: %d %v", resp.StatusCode, resp.Header)
	}
	// Known keys may send bodies up to the limit.
	prompt := strings.Repeat("many words ", 10000) // 110 KB
	if resp, b := postAuth(t, p.url+"/v1/completions", "key-alpha-123", `{"model":"m","prompt":"`+prompt+`"}`); resp.StatusCode != 200 {
		t.Fatalf("a client key's 110 KB body: %d %s", resp.StatusCode, b)
	}
	req, _ = http.NewRequest("POST", p.url+"/admin/index/lookup", strings.NewReader(`{"model":"m","hashes":["`+strings.Repeat("1", 100000)+`"]}`))
	req.Header.Set("Authorization", "Bearer admin-key-xyz")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode == 401 || resp.StatusCode == 413 {
		t.Fatalf("an admin key's 100 KB body: %d", resp.StatusCode)
	}
	p.waitIdle(t)
}

// failingListener's connections fail every write once failWrites is set: a
// client whose socket takes nothing more.
type failingListener struct {
	net.Listener
	failWrites *atomic.Bool
}

func (l failingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return failingConn{c, l.failWrites}, nil
}

type failingConn struct {
	net.Conn
	failWrites *atomic.Bool
}

func (c failingConn) Write(p []byte) (int, error) {
	if c.failWrites.Load() {
		return 0, syscall.EPIPE
	}
	return c.Conn.Write(p)
}

// TestHTTP10StreamEndsWhenItsHijackNeverStarts: an HTTP/1.0 stream is
// relayed on the hijacked connection, but fasthttp first flushes the
// answers it still holds for the client (pipelined requests before it), and
// when that fails it closes the connection without calling the hijack
// handler. The stream's slots then leaked for good: router, backend and
// tenant (found by the thirteenth session's review, with a client that
// pipelined thousands of requests and read nothing).
func TestHTTP10StreamEndsWhenItsHijackNeverStarts(t *testing.T) {
	var failWrites atomic.Bool
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 300 * time.Millisecond })
	cfg, err := config.Parse([]byte(strings.ReplaceAll("models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m, max_concurrency: 4}]\n"+
		"limits: {drain_timeout: 1s}\n", "{{e0}}", e.addr)))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(cfg, Options{Logger: zerolog.New(io.Discard), DisableHealthChecks: true})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(failingListener{ln, &failWrites})

	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// A request whose answer fasthttp holds back while the next one is
	// already read, then the stream, of a body over 1 MiB: its room in
	// the budget goes too.
	body := `{"model":"m","prompt":"hello","stream":true,"user":"` + strings.Repeat("u", 3<<19) + `"}`
	fmt.Fprintf(c, "GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\nPOST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	deadline := time.Now().Add(5 * time.Second)
	for e.requests.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the stream never reached the engine")
		}
		time.Sleep(5 * time.Millisecond)
	}
	failWrites.Store(true) // before the engine answers, so before the hijack
	for deadline := time.Now().Add(5 * time.Second); !s.Idle(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			// Not shut down: it would wait for the leaked request for ever.
			t.Fatalf("the stream's slots leaked: %+v", s.backendRows(s.st.Load()))
		}
	}
	for deadline := time.Now().Add(5 * time.Second); s.bodyMem.Used() != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the stream's body holds %d bytes of the budget for good", s.bodyMem.Used())
		}
	}
	s.Shutdown()
}

// A request fasthttp cannot parse is logged without its bytes: they hold
// the client's key (the twenty-sixth session's security review found keys
// in the debug log, which README says they never are).
func TestUnparsableRequestLogsNoKey(t *testing.T) {
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://127.0.0.1:1'}]\n")
	c, err := net.Dial("tcp", p.url[len("http://"):])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-secret-0123456789\r\nContent-Length: 12x\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	answer, _ := io.ReadAll(c)
	if !strings.HasPrefix(string(answer), "HTTP/1.1 400") {
		t.Fatalf("answer %q", answer)
	}
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(p.logs.String(), "error when reading request headers"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the parse error was not logged:\n%s", p.logs.String())
		}
	}
	if logs := p.logs.String(); strings.Contains(logs, "sk-secret") {
		t.Fatalf("the key is in the log:\n%s", logs)
	}
}

// /v1/%2e%2e/metrics was served as /metrics, past a proxy in front that
// lets only /v1/ through (the security review): it is a 400 now.
func TestDotSegmentPathIsRefused(t *testing.T) {
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://127.0.0.1:1'}]\n")
	for _, target := range []string{"/v1/%2e%2e/metrics", "/v1/..%2fmetrics", "/v1/../metrics"} {
		c, err := net.Dial("tcp", p.url[len("http://"):])
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(c, "GET "+target+" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		answer, _ := io.ReadAll(c)
		c.Close()
		if !strings.HasPrefix(string(answer), "HTTP/1.1 400") || !strings.Contains(string(answer), `"code":"invalid_path"`) {
			t.Errorf("GET %s: %q", target, answer)
		}
	}
}
