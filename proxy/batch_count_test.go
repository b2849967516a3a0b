package proxy

import (
	"fmt"
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
		if resp, b := postAuth(t, p.url+c.path, c.key, c.body); resp.StatusCode != c.status {
			t.Fatalf("%s: %d %s, want %d", c.name, resp.StatusCode, b, c.status)
		}
	}
	p.waitIdle(t)
}
