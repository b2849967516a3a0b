package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"github.com/openai/openai-go/responses"
	"github.com/openai/openai-go/shared"
)

// A tool call answered by an engine (kvmock answers a forced tool_choice
// with one, as vLLM does) crosses kvproxy whole, in each API, streamed or
// not: the SDK gets the call with its name and JSON arguments, kvproxy
// counts the engine's completion tokens and frees its load counters, and
// the conversation that feeds the tool result back stays on the engine
// that holds its cache.

// weatherSchema is get_weather's parameters: a property of each type.
var weatherSchema = map[string]any{
	"type": "object",
	"properties": map[string]any{
		"city":   map[string]any{"type": "string"},
		"days":   map[string]any{"type": "integer"},
		"metric": map[string]any{"type": "boolean"},
		"tags":   map[string]any{"type": "array", "items": map[string]any{"type": "string"}},
		"where":  map[string]any{"type": "object", "properties": map[string]any{"lat": map[string]any{"type": "number"}}},
	},
	"required": []string{"city"},
}

// checkWeatherArgs checks that arguments are a JSON object with a value
// of the schema's type for each of get_weather's properties.
func checkWeatherArgs(t *testing.T, arguments string) {
	t.Helper()
	var args struct {
		City   *string   `json:"city"`
		Days   *int      `json:"days"`
		Metric *bool     `json:"metric"`
		Tags   *[]string `json:"tags"`
		Where  *struct {
			Lat *float64 `json:"lat"`
		} `json:"where"`
	}
	if err := json.Unmarshal([]byte(arguments), &args); err != nil || args.City == nil || *args.City == "" || args.Days == nil ||
		args.Metric == nil || args.Tags == nil || args.Where == nil || args.Where.Lat == nil {
		t.Fatalf("arguments %q do not follow get_weather's schema (%v)", arguments, err)
	}
}

// completionTokens is kvproxy's kvproxy_tokens_total of type completion,
// every model and tenant.
func completionTokens(t *testing.T, url string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, "kvproxy_tokens_total{") && strings.Contains(l, `type="completion"`) {
			v, _ := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
			sum += v
		}
	}
	return sum
}

// assertSettled checks what kvproxy holds once an answer is over: no load
// on any backend, and completion tokens grown from before by the engine's
// count.
func assertSettled(t *testing.T, url string, before float64, engineCount int64) {
	t.Helper()
	assertIdle(t, url)
	want := before + float64(engineCount)
	deadline := time.Now().Add(3 * time.Second)
	for got := completionTokens(t, url); got != want; got = completionTokens(t, url) {
		if got > want || time.Now().After(deadline) {
			t.Fatalf("kvproxy_tokens_total{type=\"completion\"} went from %v to %v, the engine reported %d", before, got, engineCount)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// toolFleet is four engines with KV events behind kvproxy's kv policy.
func toolFleet(t *testing.T) string {
	t.Helper()
	es, _ := fleetWithEvents(t, 4, "-speedup", "50")
	url, _, _ := startProxyConfig(t, "log_level: info\n"+eventBackends(es, "router: {policy: kv}\n"))
	return url
}

var travelSystem = "You are a travel agent. " + strings.Repeat("Check the weather before you answer. ", 20)

// streamChat streams a chat completion through the SDK's accumulator,
// failing on any chunk it refuses and on the stream's error.
func streamChat(t *testing.T, c openai.Client, params openai.ChatCompletionNewParams) (openai.ChatCompletionAccumulator, *http.Response) {
	t.Helper()
	var httpResp *http.Response
	stream := c.Chat.Completions.NewStreaming(context.Background(), params, option.WithResponseInto(&httpResp))
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		if !acc.AddChunk(stream.Current()) {
			t.Fatalf("the accumulator refused chunk %s", stream.Current().RawJSON())
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	return acc, httpResp
}

// Chat, streamed through the SDK's accumulator and not: the call arrives
// whole (name, JSON arguments of the schema, the same both ways for the
// same prompt), finish_reason tool_calls, and the turn that answers the
// call is routed to the engine that made it.
func TestToolCallChatThroughTheSDK(t *testing.T) {
	url := toolFleet(t)
	c := client(url)
	ctx := context.Background()
	tools := []openai.ChatCompletionToolParam{
		{Function: shared.FunctionDefinitionParam{Name: "get_weather", Parameters: weatherSchema}},
		{Function: shared.FunctionDefinitionParam{Name: "book", Parameters: shared.FunctionParameters{"type": "object"}}},
	}
	msgs := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(travelSystem), openai.UserMessage("Is it warm in Lisbon?")}
	params := openai.ChatCompletionNewParams{
		Model: "default", Messages: msgs, Tools: tools,
		ToolChoice:    openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String(string(openai.ChatCompletionToolChoiceOptionAutoRequired))},
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	}

	before := completionTokens(t, url)
	acc, httpResp := streamChat(t, c, params)
	worker := httpResp.Header.Get("x-kvproxy-worker")
	if len(acc.Choices) != 1 || len(acc.Choices[0].Message.ToolCalls) != 1 {
		t.Fatalf("streamed answer %+v", acc.ChatCompletion)
	}
	streamed := acc.Choices[0].Message.ToolCalls[0]
	if acc.Choices[0].FinishReason != "tool_calls" || streamed.Function.Name != "get_weather" || !strings.HasPrefix(streamed.ID, "chatcmpl-tool-") ||
		streamed.Type != "function" || acc.Usage.CompletionTokens == 0 || !strings.HasPrefix(worker, "mock-") {
		t.Fatalf("streamed answer from %q: %+v", worker, acc.ChatCompletion)
	}
	checkWeatherArgs(t, streamed.Function.Arguments)
	assertSettled(t, url, before, acc.Usage.CompletionTokens)

	before = completionTokens(t, url)
	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{}
	res, err := c.Chat.Completions.New(ctx, params, option.WithResponseInto(&httpResp))
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Choices) != 1 || len(res.Choices[0].Message.ToolCalls) != 1 {
		t.Fatalf("answer %+v", res)
	}
	call := res.Choices[0].Message.ToolCalls[0]
	if res.Choices[0].FinishReason != "tool_calls" || call.Function.Name != "get_weather" || call.Function.Arguments != streamed.Function.Arguments ||
		res.Usage.CompletionTokens != acc.Usage.CompletionTokens || httpResp.Header.Get("x-kvproxy-worker") != worker {
		t.Fatalf("answer from %s (the stream's came from %s): %+v", httpResp.Header.Get("x-kvproxy-worker"), worker, res)
	}
	assertSettled(t, url, before, res.Usage.CompletionTokens)

	before = completionTokens(t, url)
	msgs = append(msgs, res.Choices[0].Message.ToParam(), openai.ToolMessage(`{"celsius":24,"sky":"clear"}`, call.ID))
	next, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "default", Messages: msgs, Tools: tools, MaxTokens: openai.Int(8)},
		option.WithResponseInto(&httpResp))
	if err != nil {
		t.Fatal(err)
	}
	if w := httpResp.Header.Get("x-kvproxy-worker"); w != worker || next.Usage.PromptTokensDetails.CachedTokens == 0 ||
		len(next.Choices) != 1 || next.Choices[0].Message.Content == "" || len(next.Choices[0].Message.ToolCalls) != 0 {
		t.Fatalf("the tool result's turn went to %s (the call came from %s): %+v", w, worker, next)
	}
	assertSettled(t, url, before, next.Usage.CompletionTokens)
}

// The Responses API, streamed through the SDK: the call is a function_call
// output item, its arguments streamed as deltas.
func TestToolCallResponsesThroughTheSDK(t *testing.T) {
	url := toolFleet(t)
	c := client(url)
	before := completionTokens(t, url)
	stream := c.Responses.NewStreaming(context.Background(), responses.ResponseNewParams{
		Model:        "mock-model",
		Instructions: openai.String(travelSystem),
		Input:        responses.ResponseNewParamsInputUnion{OfString: openai.String("Is it warm in Lisbon?")},
		Tools:        []responses.ToolUnionParam{{OfFunction: &responses.FunctionToolParam{Name: "get_weather", Parameters: weatherSchema, Strict: openai.Bool(false)}}},
		ToolChoice:   responses.ResponseNewParamsToolChoiceUnion{OfToolChoiceMode: openai.Opt(responses.ToolChoiceOptionsRequired)},
	})
	var deltas strings.Builder
	var added, done responses.ResponseOutputItemUnion
	var completed responses.Response
	for stream.Next() {
		switch ev := stream.Current(); ev.Type {
		case "response.output_item.added":
			added = ev.Item
		case "response.function_call_arguments.delta":
			deltas.WriteString(ev.Delta.OfString)
		case "response.output_item.done":
			done = ev.Item
		case "response.completed":
			completed = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if len(completed.Output) != 1 {
		t.Fatalf("response %+v", completed)
	}
	item := completed.Output[0]
	if item.Type != "function_call" || item.Name != "get_weather" || !strings.HasPrefix(item.CallID, "call_") || item.Status != "completed" ||
		added.Type != "function_call" || added.ID != item.ID || added.CallID != item.CallID ||
		done.Arguments != item.Arguments || deltas.String() != item.Arguments || completed.Usage.OutputTokens == 0 {
		t.Fatalf("function call %+v (added %+v, done %+v, deltas %q), usage %+v", item, added, done, deltas.String(), completed.Usage)
	}
	checkWeatherArgs(t, item.Arguments)
	assertSettled(t, url, before, completed.Usage.OutputTokens)
}

// messagesEvent is the part of a Messages stream event the test reads.
type messagesEvent struct {
	Type         string `json:"type"`
	ContentBlock struct {
		Type  string          `json:"type"`
		ID    string          `json:"id"`
		Name  string          `json:"name"`
		Input json.RawMessage `json:"input"`
	} `json:"content_block"`
	Delta struct {
		Type        string `json:"type"`
		PartialJSON string `json:"partial_json"`
		StopReason  string `json:"stop_reason"`
	} `json:"delta"`
	Usage struct {
		OutputTokens int64 `json:"output_tokens"`
		CacheRead    int64 `json:"cache_read_input_tokens"`
	} `json:"usage"`
}

// streamMessages posts a streamed Messages request and returns the events
// and the worker kvproxy chose.
func streamMessages(t *testing.T, url, body string) ([]messagesEvent, string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(messagesRequest(url+"/v1/messages", body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, readAll(resp.Body))
	}
	var events []messagesEvent
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || line == "[DONE]" {
			continue
		}
		var ev messagesEvent
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatalf("event %s: %v", line, err)
		}
		events = append(events, ev)
	}
	return events, resp.Header.Get("x-kvproxy-worker")
}

// The Messages API over raw SSE: a tool_use block whose input_json_delta
// pieces make the arguments, stop_reason tool_use; the tool_result turn
// stays on the engine.
func TestToolCallMessagesStream(t *testing.T) {
	url := toolFleet(t)
	schema, _ := json.Marshal(weatherSchema)
	system, _ := json.Marshal(travelSystem)
	tools := `[{"name":"get_weather","input_schema":` + string(schema) + `},{"name":"book","input_schema":{"type":"object"}}]`
	msgs := []string{`{"role":"user","content":"Is it warm in Lisbon?"}`}
	body := func(extra string) string {
		return fmt.Sprintf(`{"model":"mock-model","max_tokens":64,"stream":true,"system":%s,"tools":%s,"messages":[%s]%s}`,
			system, tools, strings.Join(msgs, ","), extra)
	}

	before := completionTokens(t, url)
	events, worker := streamMessages(t, url, body(`,"tool_choice":{"type":"any"}`))
	var block messagesEvent
	var input strings.Builder
	var final messagesEvent
	for _, ev := range events {
		switch {
		case ev.Type == "content_block_start":
			block = ev
		case ev.Type == "content_block_delta" && ev.Delta.Type == "input_json_delta":
			input.WriteString(ev.Delta.PartialJSON)
		case ev.Type == "message_delta":
			final = ev
		}
	}
	cb := block.ContentBlock
	if cb.Type != "tool_use" || cb.Name != "get_weather" || cb.ID == "" || string(cb.Input) != "{}" ||
		final.Delta.StopReason != "tool_use" || final.Usage.OutputTokens == 0 || events[len(events)-1].Type != "message_stop" {
		t.Fatalf("events %+v", events)
	}
	checkWeatherArgs(t, input.String())
	assertSettled(t, url, before, final.Usage.OutputTokens)

	before = completionTokens(t, url)
	msgs = append(msgs,
		fmt.Sprintf(`{"role":"assistant","content":[{"type":"tool_use","id":%q,"name":"get_weather","input":%s}]}`, cb.ID, input.String()),
		fmt.Sprintf(`{"role":"user","content":[{"type":"tool_result","tool_use_id":%q,"content":"24C, clear"}]}`, cb.ID))
	events, w := streamMessages(t, url, body(""))
	last := events[len(events)-2]
	if w != worker || last.Type != "message_delta" || last.Delta.StopReason == "tool_use" || last.Usage.CacheRead == 0 {
		t.Fatalf("the tool result's turn went to %s (the call came from %s): %+v", w, worker, events)
	}
	assertSettled(t, url, before, last.Usage.OutputTokens)
}
