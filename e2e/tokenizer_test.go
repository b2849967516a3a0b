package e2e

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// tokenizer: engine routes on the engine's own tokens (POST /tokenize),
// cached by request content.
func TestEngineTokenizer(t *testing.T) {
	engines := fleet(t, 2, "-speedup", "20", "-template", "llama3")
	var b strings.Builder
	b.WriteString("models: [{name: mock-model, aliases: [default], tokenizer: engine}]\nbackends:\n")
	b.WriteString("  - {id: mock-0, url: 'http://" + engines[0] + "', model: mock-model}\n")
	b.WriteString("  - {id: mock-1, url: 'http://" + engines[1] + "', model: mock-model}\n")
	url, _, _ := startProxyConfig(t, b.String())
	msgs := `[{"role":"system","content":"` + strings.Repeat("Be precise. ", 30) + `"},{"role":"user","content":"What is a KV cache?"}]`
	dry := func() []uint32 {
		resp, err := http.Post(url+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"default","messages":`+msgs+`,"nvext":{"annotations":["query_instance_id"]}}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var d struct {
			TokenIDs []uint32 `json:"token_ids"`
		}
		json.NewDecoder(resp.Body).Decode(&d)
		return d.TokenIDs
	}
	got := dry()
	resp, err := http.Post("http://"+engines[0]+"/tokenize", "application/json", bytes.NewReader([]byte(`{"messages":`+msgs+`}`)))
	if err != nil {
		t.Fatal(err)
	}
	var want struct {
		Tokens []uint32 `json:"tokens"`
	}
	json.NewDecoder(resp.Body).Decode(&want)
	resp.Body.Close()
	if len(got) == 0 || len(got) != len(want.Tokens) {
		t.Fatalf("routed on %d tokens, the engine has %d", len(got), len(want.Tokens))
	}
	for i := range got {
		if got[i] != want.Tokens[i] {
			t.Fatalf("token %d: %d vs the engine's %d", i, got[i], want.Tokens[i])
		}
	}
	calls := func() float64 {
		return engineMetric(t, engines[0], "kvmock:tokenize_requests_total") + engineMetric(t, engines[1], "kvmock:tokenize_requests_total")
	}
	before := calls()
	dry()
	if calls() != before {
		t.Fatal("a repeated request must be served from the token cache")
	}
	// A real request routed this way is answered and leaves no load behind.
	chat(t, url, `{"model":"default","max_tokens":2,"messages":`+msgs+`}`)
	assertIdle(t, url)
}
