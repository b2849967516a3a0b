package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
)

func client(url string) openai.Client {
	return openai.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
}

func TestOpenAISDKStreamingAndNonStreaming(t *testing.T) {
	engines := fleet(t, 2, "-speedup", "20")
	url, _ := kvproxy(t, engines, "kv")
	c := client(url)
	ctx := context.Background()

	var httpResp *http.Response
	res, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:     "default",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be brief."), openai.UserMessage("Name three rivers.")},
		MaxTokens: openai.Int(12),
	}, option.WithResponseInto(&httpResp), option.WithJSONSet("ignore_eos", true))
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Choices) != 1 || res.Choices[0].Message.Content == "" || res.Usage.CompletionTokens != 12 {
		t.Fatalf("non-streaming answer: %+v", res)
	}
	if w := httpResp.Header.Get("x-kvproxy-worker"); !strings.HasPrefix(w, "mock-") {
		t.Fatalf("x-kvproxy-worker header: %q", w)
	}

	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:         "mock-model",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Count to twenty.")},
		MaxTokens:     openai.Int(20),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	}, option.WithJSONSet("ignore_eos", true))
	var text strings.Builder
	chunks, usageTokens := 0, int64(0)
	for stream.Next() {
		ch := stream.Current()
		if len(ch.Choices) > 0 {
			text.WriteString(ch.Choices[0].Delta.Content)
			chunks++
		}
		if ch.Usage.CompletionTokens > 0 {
			usageTokens = ch.Usage.CompletionTokens
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if chunks < 20 || usageTokens != 20 || text.Len() == 0 {
		t.Fatalf("stream: %d chunks, usage %d, text %q", chunks, usageTokens, text.String())
	}

	comp, err := c.Completions.New(ctx, openai.CompletionNewParams{
		Model:     openai.CompletionNewParamsModel("mock-model"),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: []int64{100, 200, 300, 400}},
		MaxTokens: openai.Int(3),
	})
	if err != nil || len(comp.Choices) != 1 {
		t.Fatalf("completions with token ids: %v %+v", err, comp)
	}

	if m, err := c.Models.Get(ctx, "mock-model"); err != nil || m.ID != "mock-model" {
		t.Fatalf("models.retrieve: %v %+v", err, m)
	}
	var apiErr *openai.Error
	if _, err := c.Models.Get(ctx, "no-such-model"); !asAPIError(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" {
		t.Fatalf("models.retrieve of an unknown model: %v", err)
	}
	assertIdle(t, url)
}

// A conversation keeps landing on the worker that holds its prefix, and the
// engine confirms the reuse with cached_tokens.
func TestMultiTurnConversationStaysOnItsWorker(t *testing.T) {
	engines := fleet(t, 4, "-speedup", "20")
	url, _ := kvproxy(t, engines, "kv")
	c := client(url)
	ctx := context.Background()
	msgs := []openai.ChatCompletionMessageParamUnion{
		openai.SystemMessage(strings.Repeat("You are a meticulous assistant who answers in full sentences. ", 12)),
	}
	var worker string
	for turn := 0; turn < 6; turn++ {
		msgs = append(msgs, openai.UserMessage(fmt.Sprintf("Turn %d: tell me something new about the number %d.", turn, turn*7)))
		var httpResp *http.Response
		res, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "default", Messages: msgs, MaxTokens: openai.Int(8)},
			option.WithResponseInto(&httpResp))
		if err != nil {
			t.Fatal(err)
		}
		w := httpResp.Header.Get("x-kvproxy-worker")
		if turn == 0 {
			worker = w
		} else {
			if w != worker {
				t.Fatalf("turn %d went to %s, the conversation lives on %s", turn, w, worker)
			}
			if res.Usage.PromptTokensDetails.CachedTokens == 0 {
				t.Fatalf("turn %d: engine reports no cached tokens", turn)
			}
		}
		msgs = append(msgs, openai.AssistantMessage(res.Choices[0].Message.Content))
	}
	assertIdle(t, url)
}

func TestUnrelatedPromptsSpreadOverAllWorkers(t *testing.T) {
	engines := fleet(t, 4, "-speedup", "5")
	url, _ := kvproxy(t, engines, "kv")
	c := client(url)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	seen := map[string]int{}
	type result struct {
		w   string
		err error
	}
	results := make(chan result)
	const n = 32
	for i := 0; i < n; i++ {
		go func(i int) {
			var httpResp *http.Response
			_, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
				Model:     "default",
				Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage(fmt.Sprintf("%d: %s", i, strings.Repeat(fmt.Sprintf("unrelated topic %d ", i*31), 30)))},
				MaxTokens: openai.Int(16),
			}, option.WithResponseInto(&httpResp), option.WithJSONSet("ignore_eos", true))
			w := ""
			if httpResp != nil {
				w = httpResp.Header.Get("x-kvproxy-worker")
			}
			results <- result{w, err}
		}(i)
	}
	for i := 0; i < n; i++ {
		r := <-results
		if r.err != nil {
			t.Fatal(r.err)
		}
		seen[r.w]++
	}
	if len(seen) != 4 {
		t.Fatalf("32 unrelated concurrent prompts used %d of 4 workers: %v", len(seen), seen)
	}
	for w, k := range seen {
		if k > n/2 {
			t.Fatalf("worker %s took %d of %d requests: %v", w, k, n, seen)
		}
	}
	assertIdle(t, url)
}

// A client that leaves during a long prefill frees its slot at once and the
// engine aborts the request instead of finishing it.
func TestClientDisconnectDuringSlowPrefill(t *testing.T) {
	engines := fleet(t, 1, "-speedup", "0.02") // a 3k-token prefill takes seconds
	url, _ := kvproxy(t, engines, "kv")
	for _, stream := range []bool{true, false} {
		// A prompt of its own each time: the first one's, routed already,
		// would be a predicted cache hit with next to no prefill pending.
		prompt := fmt.Sprintf("stream=%v: ", stream) + strings.Repeat("a long document that takes time to prefill ", 300)
		body, _ := json.Marshal(map[string]any{"model": "default", "stream": stream, "max_tokens": 4,
			"messages": []map[string]string{{"role": "user", "content": prompt}}})
		conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: kvproxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		deadline := time.Now().Add(5 * time.Second)
		for engineMetric(t, engines[0], "vllm:num_requests_running")+engineMetric(t, engines[0], "vllm:num_requests_waiting") == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the engine never received the request")
			}
			time.Sleep(5 * time.Millisecond)
		}
		if rows := adminBackends(t, url); rows[0].Inflight != 1 || rows[0].PrefillTokens == 0 {
			t.Fatalf("the request should hold a slot with prefill pending: %+v", rows)
		}
		finishedBefore := engineMetric(t, engines[0], "vllm:request_success_total")
		left := time.Now()
		conn.Close()
		assertIdle(t, url)
		for engineMetric(t, engines[0], "vllm:num_requests_running")+engineMetric(t, engines[0], "vllm:num_requests_waiting") != 0 {
			if time.Since(left) > 3*time.Second {
				t.Fatal("the engine kept running the request after the client left")
			}
			time.Sleep(5 * time.Millisecond)
		}
		if engineMetric(t, engines[0], "vllm:request_success_total") != finishedBefore {
			t.Fatal("the engine finished the request instead of aborting it")
		}
		t.Logf("stream=%v: slot freed and engine aborted %v after the client left", stream, time.Since(left))
	}
}

func TestDryRunMatchesTheRealDecision(t *testing.T) {
	engines := fleet(t, 4, "-speedup", "20")
	url, _ := kvproxy(t, engines, "kv")
	c := client(url)
	ctx := context.Background()
	base := []openai.ChatCompletionMessageParamUnion{openai.UserMessage(strings.Repeat("shared context for the dry run ", 40))}
	if _, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "default", Messages: base, MaxTokens: openai.Int(2)}); err != nil {
		t.Fatal(err)
	}
	next := append(base, openai.AssistantMessage("ok"), openai.UserMessage("and then?"))
	var dry struct {
		WorkerID      string   `json:"worker_id"`
		InstanceID    uint64   `json:"instance_id"`
		OverlapBlocks int      `json:"overlap_blocks"`
		TotalBlocks   int      `json:"total_blocks"`
		TokenIDs      []uint32 `json:"token_ids"`
		Candidates    []any    `json:"candidates"`
	}
	// The SDK sends the annotation through an extra JSON field.
	err := c.Post(ctx, "chat/completions", map[string]any{
		"model": "default", "messages": next,
		"nvext": map[string]any{"annotations": []string{"query_instance_id"}},
	}, &dry)
	if err != nil {
		t.Fatal(err)
	}
	if dry.WorkerID == "" || dry.OverlapBlocks == 0 || len(dry.Candidates) != 4 || len(dry.TokenIDs) < dry.TotalBlocks*16 {
		t.Fatalf("dry-run answer: %+v", dry)
	}
	var httpResp *http.Response
	if _, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "default", Messages: next, MaxTokens: openai.Int(2)},
		option.WithResponseInto(&httpResp)); err != nil {
		t.Fatal(err)
	}
	if got := httpResp.Header.Get("x-kvproxy-worker"); got != dry.WorkerID {
		t.Fatalf("dry-run said %s, the real request went to %s", dry.WorkerID, got)
	}
	// token_data supplied by the client skips tokenization and routes the same.
	var dry2 struct {
		WorkerID string `json:"worker_id"`
	}
	if err := c.Post(ctx, "chat/completions", map[string]any{
		"model": "default", "messages": next,
		"nvext": map[string]any{"annotations": []string{"query_instance_id"}, "token_data": dry.TokenIDs},
	}, &dry2); err != nil || dry2.WorkerID != dry.WorkerID {
		t.Fatalf("token_data dry-run: %v %+v", err, dry2)
	}
	assertIdle(t, url)
}

func TestBadRequestsGetOpenAIErrors(t *testing.T) {
	engines := fleet(t, 1)
	url, _ := kvproxy(t, engines, "kv")
	c := client(url)
	ctx := context.Background()
	_, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "no-such-model",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
	var apiErr *openai.Error
	if !asAPIError(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" || apiErr.Param != "model" {
		t.Fatalf("unknown model: %v", err)
	}
	_, err = c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "default"})
	if !asAPIError(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Param != "messages" {
		t.Fatalf("missing messages: %v", err)
	}
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model": "default", "messages": [`))
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(body, `"type":"invalid_request_error"`) {
		t.Fatalf("malformed JSON: %d %s", resp.StatusCode, body)
	}
	// The engine's refusal of a prompt too long for the model with its
	// max_tokens (vLLM's words, its status as the code) reaches the client
	// with OpenAI's code, as kvproxy's own limit gives it; a max_tokens
	// that alone passes the context, which no shorter prompt mends, with
	// none.
	_, err = c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "default", MaxTokens: openai.Int(480000 - 10),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
	if !asAPIError(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Code != "context_length_exceeded" || apiErr.Param != "max_tokens" ||
		!strings.Contains(apiErr.Message, "maximum context length is") {
		t.Fatalf("max_tokens and the prompt beyond the context: %v", err)
	}
	_, err = c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "default", MaxTokens: openai.Int(1 << 30),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
	if !asAPIError(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Code != "" || apiErr.Param != "max_tokens" ||
		!strings.Contains(apiErr.Message, "maximum context length is") {
		t.Fatalf("max_tokens beyond the context: %v", err)
	}
	assertIdle(t, url)
}
