package mockengine

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

// Disaggregated prefill as vLLM's NixlConnector speaks it: a prefill engine
// asked with kv_transfer_params {"do_remote_decode": true} answers with
// params that name where the KV is; a decode engine sent them pulls the
// prompt's full blocks (cached_tokens) instead of computing them.
func TestDisaggregatedPrefill(t *testing.T) {
	_, pre := startEngine(t, Config{})
	_, dec := startEngine(t, Config{})
	long := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 200)
	ask := func(url string, body map[string]any) (map[string]any, time.Duration) {
		t.Helper()
		b, _ := json.Marshal(body)
		t0 := time.Now()
		resp, err := http.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var got map[string]any
		json.NewDecoder(resp.Body).Decode(&got)
		if resp.StatusCode != 200 {
			t.Fatalf("%d %v", resp.StatusCode, got)
		}
		return got, time.Since(t0)
	}
	msg := []map[string]any{{"role": "user", "content": long}}
	first, _ := ask(pre, map[string]any{"messages": msg, "max_tokens": 1, "kv_transfer_params": map[string]any{"do_remote_decode": true}})
	params, _ := first["kv_transfer_params"].(map[string]any)
	if params["do_remote_prefill"] != true || params["remote_engine_id"] == nil || params["remote_host"] != "127.0.0.1" {
		t.Fatalf("the prefill engine's params: %v", first["kv_transfer_params"])
	}
	second, _ := ask(dec, map[string]any{"messages": msg, "max_tokens": 1, "kv_transfer_params": params})
	u := second["usage"].(map[string]any)
	prompt, cached := int(u["prompt_tokens"].(float64)), int(u["prompt_tokens_details"].(map[string]any)["cached_tokens"].(float64))
	if cached != (prompt-1)/16*16 {
		t.Fatalf("the decode engine pulled %d of %d prompt tokens, want every full block", cached, prompt)
	}
	if second["kv_transfer_params"] != nil {
		t.Fatal("a decode engine's answer names params")
	}
}

// A pulled prompt costs its step only the tokens past its last full block.
func TestRemoteKVSkipsThePrefill(t *testing.T) {
	prompt := make([]uint32, 1000)
	for i := range prompt {
		prompt[i] = uint32(1000 + i)
	}
	var took [2]time.Duration
	for i, remote := range []bool{false, true} {
		m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 200})
		if err := m.Add(&Seq{ID: 1, Prompt: prompt, MaxTokens: 1, RemoteKV: remote}); err != nil {
			t.Fatal(err)
		}
		took[i], _ = m.Step()
	}
	if whole, rest := StepTime(1000, 0, 0), StepTime(1000-(999/16)*16, 0, 0); took[0] != whole || took[1] != rest {
		t.Fatalf("first step %v computing the prompt, %v pulling it: want %v and %v", took[0], took[1], whole, rest)
	}
}
