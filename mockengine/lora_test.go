package mockengine

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/kvproxy/kvproxy/kv"
)

// A request may name one of the engine's LoRA adapters. As in vLLM, the
// adapter's blocks are cached apart from the base model's and other
// adapters', reported with its lora_name, and the adapter is listed in
// /v1/models with the base model as its parent.
func TestLoRAModules(t *testing.T) {
	var mu sync.Mutex
	stored := map[string]int{} // blocks stored per lora_name
	_, url := startEngine(t, Config{LoRAModules: []string{"sql-lora", "chat-lora"}, OnEvents: func(evs []kv.Event) {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range evs {
			if ev.Kind == kv.BlockStored {
				stored[ev.LoRAName] += len(ev.EngineHashes)
			}
		}
	}})
	long := strings.Repeat("An adapter computes its own keys and values. ", 10)
	cached := func(model string) int {
		t.Helper()
		body := chatBody(long, map[string]any{"max_tokens": 1})
		body["model"] = model
		code, r := post(t, url+"/v1/chat/completions", body)
		if code != 200 {
			t.Fatalf("%s: %d %+v", model, code, r.Error)
		}
		return r.Usage.PromptTokensDetails.CachedTokens
	}
	if c := cached("sql-lora"); c != 0 {
		t.Fatalf("cold adapter: %d cached", c)
	}
	if c := cached("sql-lora"); c == 0 {
		t.Fatal("the adapter does not find its own blocks")
	}
	for _, other := range []string{"mock-model", "chat-lora"} {
		if c := cached(other); c != 0 {
			t.Fatalf("%s finds %d tokens of sql-lora's", other, c)
		}
	}
	if code, _ := post(t, url+"/v1/chat/completions", map[string]any{"model": "no-lora", "messages": []map[string]string{{"role": "user", "content": "x"}}}); code != 404 {
		t.Fatalf("an adapter it does not serve: %d", code)
	}
	mu.Lock()
	if stored["sql-lora"] == 0 || stored["chat-lora"] == 0 || stored[""] == 0 {
		t.Errorf("blocks stored per lora_name: %v", stored)
	}
	mu.Unlock()

	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(page), `vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} `) {
		t.Fatalf("no lora_requests_info as vLLM's (max_lora 1 by default):\n%s", page)
	}
	resp, err = http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		}
	}
	if err := json.Unmarshal(b, &list); err != nil || len(list.Data) != 3 || list.Data[0].Parent != nil ||
		list.Data[1].ID != "sql-lora" || list.Data[1].Parent == nil || *list.Data[1].Parent != "mock-model" {
		t.Fatalf("/v1/models: %s", b)
	}
}

// With max_loras adapters in the running batch, a waiting sequence of
// another adapter is passed over, keeping its place, and others go ahead:
// vLLM's scheduler skips it until an adapter leaves the batch.
func TestMaxLoRAsPassesOverOtherAdapters(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 1000, MaxLoRAs: 1})
	a := mustAdd(t, m, &Seq{ID: 1, Prompt: toks(32, 1), MaxTokens: 20, LoRA: "a"})
	b := mustAdd(t, m, &Seq{ID: 2, Prompt: toks(32, 2), MaxTokens: 2, LoRA: "b"})
	a2 := mustAdd(t, m, &Seq{ID: 3, Prompt: toks(32, 3), MaxTokens: 2, LoRA: "a"})
	base := mustAdd(t, m, &Seq{ID: 4, Prompt: toks(32, 4), MaxTokens: 2})
	m.Step()
	if running, waiting := m.LoRAs(); fmt.Sprint(running, waiting) != "[a] [b]" || m.Running() != 3 || m.Waiting() != 1 {
		t.Fatalf("after one step: running %v waiting %v (%d running, %d waiting)", running, waiting, m.Running(), m.Waiting())
	}
	if a2.state != seqRunning || base.state != seqRunning {
		t.Fatal("the sequences behind b did not go ahead of it")
	}
	for a.state != seqDone {
		if b.state != seqWaiting {
			t.Fatal("b ran beside a with max_loras 1")
		}
		m.Step()
	}
	run(t, m)
	if b.state != seqDone {
		t.Fatal("b never ran")
	}
	// Without a limit (MaxLoRAs 0) both adapters run at once.
	m = NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 1000})
	mustAdd(t, m, &Seq{ID: 1, Prompt: toks(32, 1), MaxTokens: 20, LoRA: "a"})
	mustAdd(t, m, &Seq{ID: 2, Prompt: toks(32, 2), MaxTokens: 2, LoRA: "b"})
	m.Step()
	if m.Running() != 2 {
		t.Fatalf("no limit: %d running", m.Running())
	}
}
