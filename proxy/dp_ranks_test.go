package proxy

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/router"
)

// workerStatus is the router's view of the worker named name in model m.
func workerStatus(p *testProxy, model, name string) (router.WorkerStatus, bool) {
	for _, w := range p.s.st.Load().models[model].rt.Workers() {
		if w.Name == name {
			return w, true
		}
	}
	return router.WorkerStatus{}, false
}

// TestScrapedLoadPerDataParallelRank: vLLM with data parallelism exports one
// series per engine (engine="r"). Each rank's worker gets its own engine's
// load and capacity; they were summed onto rank 0's worker, which pushed the
// router towards the rank that was actually overloaded (found by the ninth
// session's review). Before any rank worker exists, the backend's one worker
// stands for the whole engine and gets the total.
func TestScrapedLoadPerDataParallelRank(t *testing.T) {
	const page = `vllm:num_requests_waiting{engine="0",model_name="m"} 0
vllm:num_requests_waiting{engine="1",model_name="m"} 40
vllm:num_requests_running{engine="0",model_name="m"} 2
vllm:num_requests_running{engine="1",model_name="m"} 64
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.05
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.95
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="3000"} 1
`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			w.Write([]byte(page))
		}
	}))
	defer srv.Close()
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n  - {id: e0, url: '"+srv.URL+"', model: m, kv_events: {mode: http}}\n")
	type load struct {
		waiting, running int64
		usage, blocks    float64
	}
	waitFor := func(name string, want load) {
		t.Helper()
		var got load
		for deadline := time.Now().Add(4 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			w, ok := workerStatus(p, "m", name)
			got = load{w.EngineWaiting, w.EngineRunning, w.EngineKVUsage, w.CacheBlocks}
			if ok && fmt.Sprintf("%.3f", got.usage) == fmt.Sprintf("%.3f", want.usage) && got.waiting == want.waiting &&
				got.running == want.running && got.blocks == want.blocks {
				return
			}
		}
		t.Fatalf("worker %s: engine load %+v, want %+v", name, got, want)
	}
	waitFor("e0", load{40, 66, 0.5, 3000}) // the whole engine: one engine's capacity, as before
	pushRank(t, p, "e0", 1, promptIDs(100))
	waitFor("e0#1", load{40, 64, 0.95, 3000})
	waitFor("e0", load{0, 2, 0.05, 1000})
}
