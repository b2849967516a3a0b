package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// LoRA adapters, end to end: two engines serve the adapter sql-lora
// (kvmock -lora-modules, listed in their /v1/models as vLLM lists
// --lora-modules), a third serves the base model alone. kvproxy, told of no
// adapter, learns them from the engines' lists and sends sql-lora requests
// to those two only; the blocks the engine reports under lora_name route
// the adapter's next request, and never the base model's.
func TestLoRAAdaptersEndToEnd(t *testing.T) {
	withLoRA, _ := fleetWithEvents(t, 2, "-lora-modules", "sql-lora")
	plain, _ := fleetWithEvents(t, 1)
	url, _, _ := startProxyConfig(t, eventBackends(append(withLoRA, plain...), ""))
	waitAdapterLists(t, url)
	prompt := strings.Repeat("Translate this question into SQL, table by table. ", 40)
	send := func(model string, dry bool) (worker string, cached, overlap int) {
		t.Helper()
		body := map[string]any{"model": model, "max_tokens": 2,
			"messages": []map[string]string{{"role": "user", "content": prompt}}}
		if dry {
			body["nvext"] = map[string]any{"annotations": []string{"query_instance_id"}}
		}
		b, _ := json.Marshal(body)
		resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out struct {
			Model string
			Usage struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			}
			Overlap int `json:"overlap_blocks"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s: %d %v", model, resp.StatusCode, err)
		}
		if !dry && out.Model != model {
			t.Fatalf("the engine answered as %q, want %q", out.Model, model)
		}
		return resp.Header.Get("x-kvproxy-worker"), out.Usage.Details.Cached, out.Overlap
	}
	first, _, _ := send("sql-lora", false)
	if first == "mock-2" {
		t.Fatal("sql-lora went to the engine without it")
	}
	assertIdle(t, url)
	waitFor(t, 10*time.Second, "the adapter's blocks in the index", func() bool {
		w, _, overlap := send("sql-lora", true)
		return w == first && overlap > 0
	})
	if _, _, overlap := send("mock-model", true); overlap != 0 {
		t.Fatalf("the base model finds %d blocks of the adapter's", overlap)
	}
	for i := range 4 {
		w, cached, _ := send("sql-lora", false)
		if w != first || cached == 0 {
			t.Fatalf("sql-lora request %d: %s with %d cached tokens, want %s with its prefix", i, w, cached, first)
		}
	}
	if _, cached, _ := send("mock-model", false); cached != 0 {
		t.Fatalf("the base model was served %d cached tokens of the adapter's", cached)
	}
	assertIdle(t, url)
	var models struct{ Data []struct{ ID, Parent string } }
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	json.NewDecoder(resp.Body).Decode(&models)
	resp.Body.Close()
	if got := fmt.Sprint(models.Data); !strings.Contains(got, "{sql-lora mock-model}") {
		t.Fatalf("/v1/models: %s", got)
	}
}

// vLLM runs at most --max-loras adapters in a batch (kvmock too, 1 by
// default) and a request of another waits there. With mock-0's batch
// holding a-lora and mock-1 busier, least_load alone sends a b-lora request
// to mock-0, where it would wait for a-lora's request to end; kvproxy reads
// the batches' adapters from the engines' vllm:lora_requests_info and sends
// it to mock-1.
func TestLoRAAdapterGoesWhereTheBatchHasRoom(t *testing.T) {
	engines := fleet(t, 2, "-lora-modules", "a-lora,b-lora", "-max-loras", "1")
	url, _ := kvproxy(t, engines, "least_load")
	// The adapters are the engines' own (not configured): known once
	// kvproxy has read their lists (a request before that was a 404, a CI
	// flake).
	waitAdapterLists(t, url)
	long := func(model, pin string) *http.Response {
		t.Helper()
		body := fmt.Sprintf(`{"model":%q,"stream":true,"max_tokens":3000,"ignore_eos":true,"messages":[{"role":"user","content":"go on"}],"nvext":{"backend_instance_id":%q}}`, model, pin)
		resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s on %s: %v %v", model, pin, resp, err)
		}
		buf := make([]byte, 64)
		resp.Body.Read(buf) // the stream has begun: the request runs
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}
	long("a-lora", "mock-0")
	long("default", "mock-1")
	long("default", "mock-1")
	waitFor(t, 10*time.Second, "mock-0's batch to show a-lora", func() bool {
		for _, r := range adminBackends(t, url) {
			if r.ID == "mock-0" && r.Scrape.LoRA != nil && fmt.Sprint(r.Scrape.LoRA.Running) == "[a-lora]" {
				return true
			}
		}
		return false
	})
	for i := range 3 {
		resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"b-lora","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if w := resp.Header.Get("x-kvproxy-worker"); resp.StatusCode != 200 || w != "mock-1" {
			t.Fatalf("b-lora request %d: %d on %s, want mock-1, whose batch has room for it", i, resp.StatusCode, w)
		}
	}
}

// waitAdapterLists waits until kvproxy has read every engine's model list.
func waitAdapterLists(t *testing.T, url string) {
	t.Helper()
	waitFor(t, 15*time.Second, "the engines' adapter lists", func() bool {
		for _, r := range adminBackends(t, url) {
			if r.Adapters == nil {
				return false
			}
		}
		return true
	})
}
