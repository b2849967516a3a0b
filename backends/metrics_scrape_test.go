package backends

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"
)

const vllmPage = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 7.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.25
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.99
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 12345.0
vllm:num_requests_waiting_by_reason{reason="cap"} 100
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",cpu_offload_num_gpu_blocks="9",engine="0",num_cpu_blocks="4096",num_gpu_blocks="27000"} 1.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="1",num_gpu_blocks="26500"} 1.0
`

func TestParseEngineMetricsVLLM(t *testing.T) {
	m, err := ParseEngineMetrics([]byte(vllmPage))
	if err != nil {
		t.Fatal(err)
	}
	// Ranks are summed; usage averaged; the older usage name ignored when the new one exists.
	// The capacity is one engine's (the largest), with its block size; a
	// label whose name only ends in num_gpu_blocks is not it.
	want := EngineMetrics{Waiting: 7, Running: 7, KVUsage: 0.375, HasKVUsage: true, CacheBlocks: 27000, CacheBlockSize: 32}
	if m != want {
		t.Fatalf("got %+v want %+v", m, want)
	}
}

// vLLM with data parallelism exports one series per engine (engine="r"):
// each engine's load is read on its own, so the router can tell which rank
// is busy; the totals stay sums and averages.
func TestParseEngineRanksVLLM(t *testing.T) {
	m, ranks, err := ParseEngineRanks([]byte(vllmPage), nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := (EngineMetrics{Waiting: 7, Running: 7, KVUsage: 0.375, HasKVUsage: true, CacheBlocks: 27000, CacheBlockSize: 32}); m != want {
		t.Fatalf("totals: got %+v want %+v", m, want)
	}
	want := []RankMetrics{
		{0, EngineMetrics{Waiting: 7, Running: 3, KVUsage: 0.5, HasKVUsage: true, CacheBlocks: 27000, CacheBlockSize: 32}},
		{1, EngineMetrics{Waiting: 0, Running: 4, KVUsage: 0.25, HasKVUsage: true, CacheBlocks: 26500, CacheBlockSize: 32}},
	}
	if !slices.Equal(ranks, want) {
		t.Fatalf("ranks: got %+v\nwant %+v", ranks, want)
	}
}

func TestParseEngineRanksOddPages(t *testing.T) {
	for _, c := range []struct {
		name, page string
		want       []RankMetrics
	}{
		{"no engine label: all rank 0", "sglang:num_queue_reqs{tp_rank=\"0\"} 5\nsglang:num_running_reqs{tp_rank=\"0\"} 2\n",
			[]RankMetrics{{0, EngineMetrics{Waiting: 5, Running: 2}}}},
		{"ranks with no series are left out", "vllm:num_requests_waiting{engine=\"3\"} 4\nvllm:num_requests_waiting{engine=\"1\"} 1\n" +
			"vllm:cache_config_info{engine=\"2\",num_gpu_blocks=\"9\"} 1\n",
			[]RankMetrics{{1, EngineMetrics{Waiting: 1}}, {3, EngineMetrics{Waiting: 4}}}},
		{"old usage name per engine", "vllm:gpu_cache_usage_perc{engine=\"0\"} 0.9\nvllm:gpu_cache_usage_perc{engine=\"1\"} 0.2\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.3\n",
			[]RankMetrics{{0, EngineMetrics{KVUsage: 0.9, HasKVUsage: true}}, {1, EngineMetrics{KVUsage: 0.3, HasKVUsage: true}}}},
		{"engine label not a rank, or past MaxDPRank", "vllm:num_requests_waiting{engine=\"x\"} 2\nvllm:num_requests_waiting{engine=\"5000\"} 3\nvllm:num_requests_waiting{dp_engine=\"2\"} 1\n",
			[]RankMetrics{{0, EngineMetrics{Waiting: 3}}}},
	} {
		buf := make([]RankMetrics, 1, 4) // reused: appended to from [:0]
		_, ranks, err := ParseEngineRanks([]byte(c.page), buf)
		if err != nil || !slices.Equal(ranks, c.want) {
			t.Errorf("%s: got %+v %v\nwant %+v", c.name, ranks, err, c.want)
		}
	}
	if _, ranks, err := ParseEngineRanks([]byte("up 1\n"), make([]RankMetrics, 2)); !errors.Is(err, ErrNoEngineMetrics) || len(ranks) != 0 {
		t.Errorf("page without engine metrics: %v %v", ranks, err)
	}
}

func TestParseEngineMetricsOldVLLMAndSGLang(t *testing.T) {
	old := "vllm:num_requests_waiting 2\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.8 1700000000000\n"
	if m, err := ParseEngineMetrics([]byte(old)); err != nil || m != (EngineMetrics{Waiting: 2, KVUsage: 0.8, HasKVUsage: true}) {
		t.Fatalf("old vLLM: %+v %v", m, err)
	}
	sg := `# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 12.0
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 5.0
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.61
sglang:cache_hit_rate{model_name="qwen"} 0.4
`
	if m, err := ParseEngineMetrics([]byte(sg)); err != nil || m != (EngineMetrics{Waiting: 5, Running: 12, KVUsage: 0.61, HasKVUsage: true}) {
		t.Fatalf("sglang: %+v %v", m, err)
	}
}

func TestParseEngineMetricsOddLines(t *testing.T) {
	page := strings.Join([]string{
		`vllm:num_requests_running{path="a}b c",q="x\"}"} 2`, // quoted '}' and spaces in labels
		`vllm:num_requests_running{unterminated="x 9`,
		`vllm:num_requests_waiting NaN`,
		`vllm:num_requests_waiting +Inf`,
		`vllm:num_requests_waiting garbage`,
		`vllm:num_requests_waiting -3`,
		`vllm:kv_cache_usage_perc 1.7`,
		"\tvllm:num_requests_running 1\r",
		``,
	}, "\n")
	m, err := ParseEngineMetrics([]byte(page))
	if err != nil {
		t.Fatal(err)
	}
	if m != (EngineMetrics{Waiting: 0, Running: 3, KVUsage: 1, HasKVUsage: true}) {
		t.Fatalf("got %+v", m)
	}
	if _, err := ParseEngineMetrics([]byte("# nothing here\nup 1\n")); !errors.Is(err, ErrNoEngineMetrics) {
		t.Fatalf("page without engine metrics: %v", err)
	}
}

func TestMetricsScraperScrape(t *testing.T) {
	slow := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			w.Header().Set("Content-Type", "text/plain; version=0.0.4")
			w.Write([]byte(vllmPage))
		case "/big":
			w.Write([]byte(strings.Repeat("# padding\n", 2000) + vllmPage))
		case "/slow":
			<-slow
		case "/empty":
			w.Write([]byte("process_cpu_seconds_total 1\n"))
		default:
			http.Error(w, "nope", http.StatusInternalServerError)
		}
	}))
	defer srv.Close()
	defer close(slow)

	s := &MetricsScraper{Timeout: 200 * time.Millisecond, MaxBodySize: 8 << 10}
	m, err := s.Scrape(srv.URL+"/metrics", false)
	if err != nil || m.Waiting != 7 || m.Running != 7 {
		t.Fatalf("scrape: %+v %v", m, err)
	}
	for _, path := range []string{"/fail", "/slow", "/empty", "/big"} {
		if _, err := s.Scrape(srv.URL+path, false); err == nil || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: want an error naming the URL, got %v", path, err)
		}
	}
}

func BenchmarkParseEngineMetrics(b *testing.B) {
	page := []byte(strings.Repeat("# HELP x y\nvllm:iteration_tokens_total_bucket{le=\"1.0\"} 0.0\n", 200) + vllmPage)
	b.SetBytes(int64(len(page)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseEngineMetrics(page); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkParseEngineRanks(b *testing.B) {
	page := []byte(strings.Repeat("# HELP x y\nvllm:iteration_tokens_total_bucket{le=\"1.0\"} 0.0\n", 200) + vllmPage)
	ranks := make([]RankMetrics, 0, 8)
	b.SetBytes(int64(len(page)))
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if _, ranks, err = ParseEngineRanks(page, ranks); err != nil || len(ranks) != 2 {
			b.Fatal(err, ranks)
		}
	}
}

func TestLabelInt(t *testing.T) {
	for _, c := range []struct {
		line, key string
		want      int
	}{
		{`m{a="1",num_gpu_blocks="42"} 1`, "num_gpu_blocks", 42},
		{`m{num_gpu_blocks="42"} 1`, "num_gpu_blocks", 42},
		{`m{xnum_gpu_blocks="7",num_gpu_blocks="42"} 1`, "num_gpu_blocks", 42},
		{`m{num_gpu_blocks="None"} 1`, "num_gpu_blocks", 0},
		{`m{num_gpu_blocks="12`, "num_gpu_blocks", 0},
		{`m{num_gpu_blocks=42} 1`, "num_gpu_blocks", 0},
		{`m 1`, "num_gpu_blocks", 0},
		{`m{a="num_gpu_blocks"} 1`, "num_gpu_blocks", 0},
	} {
		if got := labelInt([]byte(c.line), c.key); got != c.want {
			t.Errorf("labelInt(%s, %s) = %d, want %d", c.line, c.key, got, c.want)
		}
	}
}

// vLLM's vllm:lora_requests_info: one series per label set it has had,
// valued with the time it was set; the latest tells which adapters the
// batch holds and how many it can (max_lora).
func TestParseLoRAInfo(t *testing.T) {
	page := `vllm:num_requests_running{model_name="m"} 2
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old-lora",waiting_lora_adapters=""} 1.7900000001e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="fs-lora"} 1.7900000009e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7900000005e+09
`
	m, err := ParseEngineMetrics([]byte(page))
	if err != nil {
		t.Fatal(err)
	}
	l := m.LoRA
	if l == nil || l.MaxLoRAs != 2 || fmt.Sprint(l.Running) != "[sql-lora chat-lora]" || fmt.Sprint(l.Waiting) != "[fs-lora]" {
		t.Fatalf("lora info %+v", l)
	}
	if !l.Full("fs-lora") || l.Full("sql-lora") {
		t.Fatalf("full for fs-lora %v, for sql-lora %v", l.Full("fs-lora"), l.Full("sql-lora"))
	}
	if m, _ := ParseEngineMetrics([]byte(`vllm:num_requests_running{model_name="m"} 2`)); m.LoRA != nil || m.LoRA.Full("x") {
		t.Fatalf("no lora info: %+v", m.LoRA)
	}
	empty, _ := ParseEngineMetrics([]byte("vllm:num_requests_running 0\nvllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1e9\n"))
	if empty.LoRA == nil || empty.LoRA.Running != nil || empty.LoRA.Full("x") {
		t.Fatalf("an idle engine's lora info %+v", empty.LoRA)
	}
}
