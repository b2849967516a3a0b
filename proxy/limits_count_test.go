package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

// A tenant's token budget and max_prompt_tokens never take the client's
// word for a prompt's size: nvext.token_data steers routing, but a tenant
// with tokens_per_minute has its prompt counted by kvproxy (found by the
// seventh session's trial: token_data [1] let a 2,000-word prompt through a
// 100-token budget five times a second). Tenants without a budget keep
// token_data's saving: their prompts are not tokenized.
func TestTokenDataDoesNotBypassTheTokenBudget(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, block_size: 16, tokenizer: cl100k_base, template: chatml}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
auth:
  keys:
    - {key: key-small-123, tenant: small}
    - {key: key-free-4567, tenant: free}
tenants:
  - {name: small, tokens_per_minute: 100}
`, e)
	long := strings.Repeat("many words of a long prompt ", 400)
	body := `{"model":"m","messages":[{"role":"user","content":"` + long + `"}],"nvext":{"token_data":[1]}}`
	if resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-small-123", body); resp.StatusCode != 200 {
		t.Fatalf("first request (a full bucket): %d %s", resp.StatusCode, b)
	}
	resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-small-123", body)
	if resp.StatusCode != 429 || !strings.Contains(b, "rate_limit_exceeded") {
		t.Fatalf("second ~2,400-token prompt claiming 1 token: %d %s, want 429", resp.StatusCode, b)
	}
	if !strings.Contains(p.logs.String(), `"model":"m","tenant":"small","status":429`) {
		t.Errorf("the 429's log line lacks the model:\n%s", p.logs.String())
	}
	for range 3 {
		if resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-free-4567", body); resp.StatusCode != 200 {
			t.Fatalf("a tenant without a budget: %d %s", resp.StatusCode, b)
		}
	}
	p.waitIdle(t)
}

// A prompt the engine could not tokenize counts at 4 bytes a token for
// max_prompt_tokens and the tenant's budget, not as none.
func TestUntokenizedPromptStillCounts(t *testing.T) {
	engine := func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		if r.URL.Path == "/tokenize" {
			w.WriteHeader(500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"choices":[]}`))
	}
	p := startProxyYAML(t, "models: [{name: m, tokenizer: engine, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+startRawEngine(t, engine)+"', model: m}]\n"+
		"limits: {max_prompt_tokens: 1000}\n")
	body := `{"model":"m","prompt":"` + strings.Repeat("x", 8000) + `"}`
	resp, b := post(t, p.url+"/v1/completions", body)
	if resp.StatusCode != 400 || !strings.Contains(string(b), "context_length_exceeded") {
		t.Fatalf("8,000 bytes the engine did not tokenize, limit 1,000 tokens: %d %s, want 400", resp.StatusCode, b)
	}
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"short"}`); resp.StatusCode != 200 {
		t.Fatalf("a short prompt: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// A dry run (nvext.annotations: ["query_instance_id"]) computes nothing on
// an engine, so it spends none of the tenant's token budget (found by the
// eighth session's trial: three dry runs took a 300-token budget and the
// next real request got 429). It is still a request: requests_per_second
// counts it.
func TestDryRunsSpendNoTokens(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, block_size: 16, tokenizer: cl100k_base, template: chatml}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
auth:
  keys: [{key: key-small-123, tenant: small}]
tenants:
  - {name: small, tokens_per_minute: 300}
`, e)
	body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("word ", 100) + `"}]`
	for i := range 10 {
		resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-small-123", body+`,"nvext":{"annotations":["query_instance_id"]}}`)
		if resp.StatusCode != 200 || !strings.Contains(b, "worker_id") {
			t.Fatalf("dry run %d: %d %s", i, resp.StatusCode, b)
		}
	}
	for i, want := range []int{200, 200, 429} { // ~110 tokens each against 300
		if resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-small-123", body+`}`); resp.StatusCode != want {
			t.Fatalf("real request %d after 10 dry runs: %d %s, want %d", i, resp.StatusCode, b, want)
		}
	}
	p.waitIdle(t)
}

// A request refused for a malformed nvext.backend_instance_id has its
// access-log line like every other refusal.
func TestBadPinIsLogged(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":true}}`)
	if resp.StatusCode != 400 || !strings.Contains(string(b), "backend_instance_id") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if !strings.Contains(p.logs.String(), `"status":400,`) || !strings.Contains(p.logs.String(), "bad backend_instance_id") {
		t.Fatalf("no access-log line for the refusal:\n%s", p.logs.String())
	}
}

// A reload that changes a tenant's limits keeps what the tenant has spent
// (up to the new burst) instead of refilling its bucket (found by the
// eighth session's trial: a throttled tenant got a full bucket back).
func TestReloadKeepsWhatATenantSpent(t *testing.T) {
	e := startFake(t, "e0", nil)
	yaml := func(tpm int) string {
		return fmt.Sprintf(`
models: [{name: m, block_size: 16, tokenizer: cl100k_base, template: chatml}]
backends: [{id: e0, url: 'http://%s', model: m}]
auth:
  keys: [{key: key-small-123, tenant: small}]
tenants:
  - {name: small, tokens_per_minute: %d}
`, e.addr, tpm)
	}
	p := startProxyYAML(t, yaml(300))
	body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("word ", 100) + `"}]}` // ~110 tokens
	for i := range 2 {
		if resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-small-123", body); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	cfg, err := config.Parse([]byte(yaml(310)))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-small-123", body); resp.StatusCode != 429 {
		t.Fatalf("after a reload to 310 tokens/min with ~80 left: %d %s, want 429", resp.StatusCode, b)
	}
	// Raised to 600, with ~240 spent: ~360 left, not the ~60 it had.
	if cfg, err = config.Parse([]byte(yaml(600))); err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-small-123", body)
	left, _ := strconv.Atoi(resp.Header.Get("X-Ratelimit-Remaining-Tokens"))
	if resp.StatusCode != 200 || left < 200 || left > 300 {
		t.Fatalf("after a reload to 600 tokens/min with ~240 spent: %d, %d left (want ~240 after this one): %s", resp.StatusCode, left, b)
	}
	p.waitIdle(t)
}

// A key naming a tenant that tenants does not list is logged as a warning
// at start and on every reload that still has it.
func TestUnlistedTenantIsLogged(t *testing.T) {
	e := startFake(t, "e0", nil)
	yaml := "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n" +
		"auth: {keys: [{key: key-typo-1234, tenant: team-bb}]}\ntenants: [{name: team-b, requests_per_second: 1}]\n"
	p := startProxyYAML(t, yaml, e)
	want := `config: auth.keys[0].tenant: \"team-bb\" is not in tenants, so it has no limits`
	if n := strings.Count(p.logs.String(), want); n != 1 {
		t.Fatalf("%d warnings at start, want 1:\n%s", n, p.logs.String())
	}
	cfg, err := config.Parse([]byte(strings.ReplaceAll(yaml, "{{e0}}", e.addr)))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(p.logs.String(), want); n != 2 {
		t.Fatalf("%d warnings after a reload, want 2:\n%s", n, p.logs.String())
	}
}

// count_tokens is bounded by max_prompt_tokens: it counted without a
// bound, so one tenant's 30 MB prompts (29 KB gzipped) took both cores for
// half a minute (found by a security review). Over the limit it is
// Anthropic's 400 "prompt is too long", without tokenizing the rest. It
// spends none of the tenant's token budget, as Anthropic's counts do not.
func TestCountTokensIsBounded(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, block_size: 16, tokenizer: cl100k_base, template: chatml}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
limits: {max_prompt_tokens: 1000}
auth:
  keys: [{key: key-small-123, tenant: small}, {key: key-free-4567, tenant: free}]
tenants:
  - {name: small, tokens_per_minute: 300}
`, e)
	count := func(key, content string) (int, string) {
		t.Helper()
		resp, b := postAuth(t, p.url+"/v1/messages/count_tokens", key,
			`{"model":"m","messages":[{"role":"user","content":"`+content+`"}],"nvext":{"annotations":["query_instance_id"]}}`)
		return resp.StatusCode, b
	}
	code, b := count("key-free-4567", strings.Repeat("word ", 200_000))
	var ae struct {
		Type  string
		Error struct{ Message string }
	}
	json.Unmarshal([]byte(b), &ae)
	if code != 400 || ae.Type != "error" || !regexp.MustCompile(`^prompt is too long: at least \d+ tokens > 1000 maximum$`).MatchString(ae.Error.Message) {
		t.Fatalf("count_tokens of 200,000 words, limit 1,000 tokens: %d %s, want Anthropic's 400", code, b)
	}
	if code, b := count("key-free-4567", strings.Repeat("word ", 900)); code != 200 || !strings.Contains(b, `"input_tokens":9`) {
		t.Fatalf("count_tokens within the limit: %d %s", code, b)
	}
	for i := 0; i < 4; i++ { // ~110 tokens each against 300: none spent
		if code, b := count("key-small-123", strings.Repeat("word ", 100)); code != 200 {
			t.Fatalf("count %d against a 300-token budget: %d %s", i, code, b)
		}
	}
}

// A prompt whose size in bytes alone puts it over max_prompt_tokens is
// refused without being tokenized (the tokenizer stops with fewer ids than
// the limit, and says it stopped): chat, completions, a batch's prompt and
// count_tokens alike. 30 MB of spaces (29 KB gzipped) took 6.5 s of CPU to
// refuse (found by a security review).
func TestPromptOverTheLimitBySizeIsRefused(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, block_size: 16, tokenizer: cl100k_base, template: chatml}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
limits: {max_prompt_tokens: 1000}
`, e)
	spaces := strings.Repeat(" ", 200_000) + "x" // at least 1,563 tokens of 128 bytes
	for _, c := range []struct{ path, body, want string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"` + spaces + `"}]}`, "more tokens than the limit of 1000"},
		{"/v1/completions", `{"model":"m","prompt":"` + spaces + `"}`, "more tokens than the limit of 1000"},
		{"/v1/completions", `{"model":"m","prompt":["hi","` + spaces + `"]}`, `"param":"prompt[1]"`},
		{"/v1/messages/count_tokens", `{"model":"m","messages":[{"role":"user","content":"` + spaces + `"}]}`, "prompt is too long"},
	} {
		if resp, b := post(t, p.url+c.path, c.body); resp.StatusCode != 400 || !strings.Contains(string(b), c.want) {
			t.Fatalf("%s, 200 kB of spaces, limit 1,000 tokens: %d %s, want 400 %s", c.path, resp.StatusCode, b, c.want)
		}
	}
	p.waitIdle(t)
}

// A reload's new limits against what a tenant had left: raised, it keeps
// what it spent and gets the difference; lowered, it keeps what it had
// left up to the new burst, not a debt of what it spent above it (the
// review: 800 of 1,000 tokens spent, lowered to 100, was 7 minutes of 429s).
func TestReloadedBucketLevels(t *testing.T) {
	for _, tc := range []struct {
		name                      string
		requests                  bool
		oldBurst, level, newBurst float64
		wantLevel                 float64
	}{
		{"tokens raised", false, 300, 60, 600, 360},
		{"tokens lowered below what was left", false, 1000, 200, 100, 100},
		{"tokens lowered above what was left", false, 1000, 50, 100, 50},
		{"requests lowered", true, 50, 5, 5, 5},
		{"tokens in debt, raised", false, 100, -50, 200, 50},
	} {
		old := &tenant{}
		b := newBucket(tc.oldBurst/60, tc.oldBurst, &tokenLimitHeaders)
		b.level, b.last = tc.level, time.Now()
		if tc.requests {
			old.requests = b
		} else {
			old.tokens = b
		}
		nb := reuseBucket(old, tc.requests, tc.newBurst/60, tc.newBurst)
		if nb.level < tc.wantLevel-0.01 || nb.level > tc.wantLevel+0.01 {
			t.Errorf("%s: level %.2f, want %.0f", tc.name, nb.level, tc.wantLevel)
		}
	}
}
