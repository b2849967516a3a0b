package proxy

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
)

// A completions batch (prompt as an array of prompts) is routed by its
// first prompt, but every prompt must fit max_prompt_tokens and all of
// them count for the tenant's token budget (found by the eighth session's
// review: ["hi", big, big] went through five times out of five). So do
// the tools of a chat request, which the template renders into the prompt.
func TestBatchesAndToolsCountWhole(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
auth: {keys: [{key: key-budget-123, tenant: small}, {key: key-free-45678, tenant: free}]}
tenants: [{name: small, tokens_per_minute: 1500}]
limits: {max_prompt_tokens: 1000}
`, e)
	big := strings.Repeat("hello ", 3000)   // 3,000 tokens
	mid := strings.Repeat("hello ", 600)    // 600 tokens
	ids := strings.Repeat("11,", 599) + "1" // 600 token ids
	for _, c := range []struct {
		name, key, path, body string
		status                int
	}{
		{"a batch with a prompt over the limit", "key-free-45678", "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":["hi",%q]}`, big), 400},
		{"a token batch with a prompt over the limit", "key-free-45678", "/v1/completions", `{"model":"m","prompt":[[1],[` + strings.Repeat("7,", 1000) + `7]]}`, 400},
		{"tools over the limit", "key-free-45678", "/v1/chat/completions",
			fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","description":%q}}]}`, big), 400},
		{"a batch within the limit, one prompt at a time", "key-free-45678", "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":["hi",%q,%q]}`, mid, mid), 200},
		{"a batch of 1,200 tokens against a 1,500 budget", "key-budget-123", "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":["hi",%q,%q]}`, mid, mid), 200},
		{"a token batch of 1,200 more", "key-budget-123", "/v1/completions", `{"model":"m","prompt":[[1],[` + ids + `],[` + ids + `]]}`, 429},
	} {
		resp, b := postAuth(t, p.url+c.path, c.key, c.body)
		if resp.StatusCode != c.status {
			t.Fatalf("%s: %d %s, want %d", c.name, resp.StatusCode, b, c.status)
		}
		if c.name == "a batch with a prompt over the limit" && !strings.Contains(string(b), `"param":"prompt[1]"`) {
			t.Fatalf("%s: the error does not name the prompt: %s", c.name, b)
		}
	}
	p.waitIdle(t)
}

// A request larger than the tenant's whole budget (a batch here) waits for
// a full bucket and is then charged in full: the tenant waits the debt out
// (found by the eighth session's trial: a batch of 8,000 tokens cost a
// 100-token budget 100, and the next request waited a second).
func TestOversizedRequestsAreChargedInFull(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
auth: {keys: [{key: key-budget-123, tenant: small}]}
tenants: [{name: small, tokens_per_minute: 100}]
`, e)
	ids := strings.Repeat("11,", 99) + "1" // 100 token ids
	batch := `{"model":"m","prompt":[[` + ids + `],[` + ids + `],[` + ids + `],[` + ids + `]]}`
	if resp, b := postAuth(t, p.url+"/v1/completions", "key-budget-123", batch); resp.StatusCode != 200 {
		t.Fatalf("a 400-token batch on a full 100-token bucket: %d %s", resp.StatusCode, b)
	}
	resp, b := postAuth(t, p.url+"/v1/completions", "key-budget-123", `{"model":"m","prompt":"hi"}`)
	wait, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != 429 || wait < 150 { // 300 tokens of debt at 100 a minute: 3 minutes
		t.Fatalf("the next request: %d, Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), b)
	}
	p.waitIdle(t)
}
