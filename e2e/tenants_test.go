package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
)

// Tenant isolation end to end, in pairs: the same tenant gets the engine's
// cached tokens, another tenant sending the very same prompt gets none (the
// proxy's cache_salt keeps their KV caches apart inside the engine).
func TestTenantIsolationInPairs(t *testing.T) {
	engines := fleet(t, 1, "-speedup", "20")
	url, p, _ := startProxyConfig(t, backendsYAML(map[string]string{"m": engines[0]}, `
auth:
  keys:
    - {key: alpha-key-0001, tenant: alpha}
    - {key: beta-key-00002, tenant: beta}
    - {key: gamma-key-0003, tenant: gamma}
    - {key: delta-key-0004, tenant: delta}
  admin_keys: [admin-key-0005]
  cache_salt_secret: e2e-secret
tenants:
  - {name: gamma, shared_cache: true}
  - {name: delta, shared_cache: true}
`))
	prompt := strings.Repeat("A confidential document that only its owner should be able to probe. ", 20)
	ask := func(key string) int64 {
		c := openai.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey(key), option.WithMaxRetries(0))
		res, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
			Model: "default", MaxTokens: openai.Int(2),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
		}, option.WithJSONSet("cache_salt", "a-client-chosen-salt"))
		if err != nil {
			t.Fatal(err)
		}
		return res.Usage.PromptTokensDetails.CachedTokens
	}
	if n := ask("alpha-key-0001"); n != 0 {
		t.Fatalf("first request of alpha: %d cached tokens", n)
	}
	if n := ask("alpha-key-0001"); n == 0 {
		t.Fatal("same tenant, same prompt: the engine must report cached tokens")
	}
	if n := ask("beta-key-00002"); n != 0 {
		t.Fatalf("another tenant hit alpha's cache: %d cached tokens", n)
	}
	ask("gamma-key-0003")
	if n := ask("delta-key-0004"); n == 0 {
		t.Fatal("tenants sharing the cache namespace should share cached prefixes")
	}
	c := openai.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey("not-a-key-000"), option.WithMaxRetries(0))
	_, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: "default",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("x")}})
	var apiErr *openai.Error
	if !asAPIError(err, &apiErr) || apiErr.StatusCode != 401 {
		t.Fatalf("bad key: %v", err)
	}
	assertIdle(t, url)
	for _, secret := range []string{"alpha-key-0001", "beta-key-00002", "admin-key-0005", "e2e-secret"} {
		if strings.Contains(p.String(), secret) {
			t.Fatalf("%q leaked into kvproxy's output", secret)
		}
	}
}

// In event mode the index learns each tenant's salted blocks from the
// engine's events (cache_salt in extra_keys), so a tenant's next turn routes
// on its own prefix and never on another tenant's.
func TestTenantsInEventMode(t *testing.T) {
	es, _ := fleetWithEvents(t, 2, "-speedup", "20")
	url, _, _ := startProxyConfig(t, eventBackends(es, `
auth:
  keys:
    - {key: alpha-key-0001, tenant: alpha}
    - {key: beta-key-00002, tenant: beta}
  admin_keys: [admin-key-0005]
`))
	prompt := strings.Repeat("Tenant-private context for event mode. ", 40)
	body := `{"model":"default","max_tokens":2,"messages":[{"role":"user","content":"` + prompt + `"}]}`
	dry := strings.Replace(body, `"max_tokens":2`, `"max_tokens":2,"nvext":{"annotations":["query_instance_id"]}`, 1)
	send := func(key, b string) map[string]any {
		req, _ := http.NewRequest("POST", url+"/v1/chat/completions", strings.NewReader(b))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		json.NewDecoder(resp.Body).Decode(&out)
		return out
	}
	send("alpha-key-0001", body)
	waitFor(t, 5*time.Second, "alpha's blocks indexed from events", func() bool {
		return send("alpha-key-0001", dry)["overlap_blocks"].(float64) > 0
	})
	if n := send("beta-key-00002", dry)["overlap_blocks"].(float64); n != 0 {
		t.Fatalf("beta matched %v blocks of alpha's prompt", n)
	}
	assertIdle(t, url)
}
