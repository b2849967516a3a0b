package mockengine

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// weatherSchema has a property of each type the engine fills in.
const weatherSchema = `{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"},` +
	`"metric":{"type":"boolean"},"unit":{"type":"string","enum":["celsius","fahrenheit"]},` +
	`"tags":{"type":"array","items":{"type":"string"}},"where":{"type":"object","properties":{"lat":{"type":"number"}}}},` +
	`"required":["city"]}`

// chatTools is a chat request's tools: get_weather first, then lookup.
const chatToolsJSON = `[{"type":"function","function":{"name":"get_weather","parameters":` + weatherSchema + `}},` +
	`{"type":"function","function":{"name":"lookup","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}}]`

// checkWeatherArgs checks that arguments are compact JSON with a value of
// the schema's type for each of get_weather's properties, in order.
func checkWeatherArgs(t *testing.T, args string) {
	t.Helper()
	re := `^\{"city":"[a-z]+","days":\d+,"metric":(true|false),"unit":"celsius","tags":\["[a-z]+"\],"where":\{"lat":\d+\}\}$`
	if !regexp.MustCompile(re).MatchString(args) {
		t.Fatalf("arguments %s do not follow get_weather's schema", args)
	}
}

// toolCallMessage is the part of a chat answer with a tool call the tests
// read.
type toolCallMessage struct {
	Choices []struct {
		Message struct {
			Content   *string `json:"content"`
			ToolCalls []struct {
				ID       string `json:"id"`
				Type     string `json:"type"`
				Function struct {
					Name      string `json:"name"`
					Arguments string `json:"arguments"`
				} `json:"function"`
			} `json:"tool_calls"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage usage `json:"usage"`
}

func chatCall(t *testing.T, url, choice string, extra string) toolCallMessage {
	t.Helper()
	body := `{"model":"mock-model","messages":[{"role":"user","content":"Weather in Lisbon?"}],"tools":` + chatToolsJSON +
		`,"tool_choice":` + choice + extra + `}`
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	code, raw, m := readJSON[toolCallMessage](t, resp, err)
	if code != 200 || len(m.Choices) != 1 || len(m.Choices[0].Message.ToolCalls) != 1 {
		t.Fatalf("status %d: %s", code, raw)
	}
	return m
}

// A chat request that must call a tool gets one call, as vLLM answers it:
// of the first tool for "required" (finish_reason "tool_calls"), of the
// named one for a named choice ("stop", as OpenAI has it), content "",
// arguments made up from the schema and the same for the same prompt, and
// the arguments' tokens counted as the completion.
func TestChatToolCallWhole(t *testing.T) {
	e, url := startEngine(t, Config{})
	first := chatCall(t, url, `"required"`, "")
	c := first.Choices[0]
	call := c.Message.ToolCalls[0]
	if c.FinishReason != "tool_calls" || c.Message.Content == nil || *c.Message.Content != "" ||
		!regexp.MustCompile(`^chatcmpl-tool-[0-9a-f]{32}$`).MatchString(call.ID) || call.Type != "function" || call.Function.Name != "get_weather" {
		t.Fatalf("answer %+v", first)
	}
	checkWeatherArgs(t, call.Function.Arguments)
	if n := len(e.enc.EncodeText(nil, call.Function.Arguments)); first.Usage.CompletionTokens != n {
		t.Fatalf("%d completion tokens for arguments of %d tokens", first.Usage.CompletionTokens, n)
	}
	again := chatCall(t, url, `"required"`, "")
	if a := again.Choices[0].Message.ToolCalls[0]; a.Function.Arguments != call.Function.Arguments || a.ID == call.ID {
		t.Fatalf("the same prompt got %s (id %s), then %s (id %s)", call.Function.Arguments, call.ID, a.Function.Arguments, a.ID)
	}
	if again.Usage.PromptTokensDetails.CachedTokens == 0 {
		t.Fatal("the repeated prompt found nothing cached")
	}

	named := chatCall(t, url, `{"type":"function","function":{"name":"lookup"}}`, "")
	if c := named.Choices[0]; c.FinishReason != "stop" || c.Message.ToolCalls[0].Function.Name != "lookup" ||
		!regexp.MustCompile(`^\{"q":"[a-z]+"\}$`).MatchString(c.Message.ToolCalls[0].Function.Arguments) {
		t.Fatalf("named call %+v", named)
	}

	cut := chatCall(t, url, `"required"`, `,"max_tokens":3`)
	if c := cut.Choices[0]; c.FinishReason != "length" || cut.Usage.CompletionTokens != 3 ||
		!strings.HasPrefix(call.Function.Arguments, c.Message.ToolCalls[0].Function.Arguments) {
		t.Fatalf("call cut at 3 tokens: %+v", cut)
	}
	waitIdle(t, e)
	if st := e.Stats(); st.GenerationTokens != uint64(2*first.Usage.CompletionTokens+named.Usage.CompletionTokens+3) {
		t.Fatalf("engine counted %d generated tokens", st.GenerationTokens)
	}
}

// A tool_choice no tool satisfies is vLLM's 400, before the model.
func TestToolChoiceWithoutTheTool(t *testing.T) {
	e, url := startEngine(t, Config{})
	for path, body := range map[string]string{
		"/v1/chat/completions": `{"messages":[{"role":"user","content":"hi"}],"tool_choice":"required"}`,
		"/v1/responses":        `{"input":"hi","tools":[{"type":"function","name":"a"}],"tool_choice":{"type":"function","name":"b"}}`,
		"/v1/messages":         `{"model":"mock-model","max_tokens":4,"messages":[{"role":"user","content":"hi"}],"tool_choice":{"type":"any"}}`,
	} {
		resp, err := http.Post(url+path, "application/json", strings.NewReader(body))
		code, raw, _ := readJSON[map[string]any](t, resp, err)
		if code != 400 || !strings.Contains(string(raw), "tools") {
			t.Fatalf("%s %s: %d %s", path, body, code, raw)
		}
	}
	if st := e.Stats(); st.Requests != 0 {
		t.Fatalf("%d requests reached the model", st.Requests)
	}
}

// Streamed, the call comes as vLLM streams a forced call: a role chunk,
// then a tool call delta per token, the first with id, type, index and
// name, the later ones with the arguments' text ("name":null with
// "required"), the last with the finish reason; the usage chunk counts the
// arguments' tokens, and the arguments are those of the whole answer.
func TestChatToolCallStream(t *testing.T) {
	e, url := startEngine(t, Config{})
	whole := chatCall(t, url, `"required"`, "").Choices[0].Message.ToolCalls[0].Function.Arguments
	for _, c := range []struct {
		choice, name, finish, later string
	}{
		{`"required"`, "get_weather", "tool_calls", `\{"index":0,"function":\{"name":null,"arguments":"[^"\\]*(\\"[^"\\]*)*"\}\}`},
		{`{"type":"function","function":{"name":"get_weather"}}`, "get_weather", "stop", `\{"index":0,"function":\{"arguments":"[^"\\]*(\\"[^"\\]*)*"\}\}`},
	} {
		body := json.RawMessage(`{"model":"mock-model","messages":[{"role":"user","content":"Weather in Lisbon?"}],"tools":` + chatToolsJSON +
			`,"tool_choice":` + c.choice + `,"stream":true,"stream_options":{"include_usage":true}}`)
		data := streamEvents(t, url+"/v1/chat/completions", body)
		if data[len(data)-1] != "[DONE]" {
			t.Fatalf("no [DONE]: %q", data)
		}
		data = data[:len(data)-1]
		prefix := `^\{"id":"chatcmpl-[^"]+","object":"chat.completion.chunk","created":\d+,"model":"mock-model","choices":`
		choice := func(delta, finish string) *regexp.Regexp {
			return regexp.MustCompile(prefix + `\[\{"index":0,"delta":` + delta + `,"logprobs":null,"finish_reason":` + finish + `\}\],"usage":null\}$`)
		}
		if !choice(`\{"role":"assistant","content":""\}`, "null").MatchString(data[0]) {
			t.Fatalf("role chunk %s", data[0])
		}
		firstDelta := `\{"tool_calls":\[\{"id":"chatcmpl-tool-[0-9a-f]{32}","type":"function","index":0,"function":\{"name":"` + c.name +
			`","arguments":"[^"\\]*(\\"[^"\\]*)*"\}\}\]\}`
		if !choice(firstDelta, "null").MatchString(data[1]) {
			t.Fatalf("first tool call chunk %s", data[1])
		}
		var args strings.Builder
		var finish string
		for i, d := range data[1 : len(data)-1] {
			if i > 0 && !choice(`\{"tool_calls":\[`+c.later+`\]\}`, `(null|"`+c.finish+`")`).MatchString(d) {
				t.Fatalf("chunk %d: %s", i+1, d)
			}
			var ch struct {
				Choices []struct {
					Delta struct {
						ToolCalls []struct {
							Function struct{ Arguments string }
						} `json:"tool_calls"`
					}
					FinishReason *string `json:"finish_reason"`
				}
			}
			json.Unmarshal([]byte(d), &ch)
			args.WriteString(ch.Choices[0].Delta.ToolCalls[0].Function.Arguments)
			if f := ch.Choices[0].FinishReason; f != nil {
				finish = *f
			}
		}
		if args.String() != whole || finish != c.finish {
			t.Fatalf("streamed arguments %s, finish %q; the whole answer's %s", args.String(), finish, whole)
		}
		var last response
		json.Unmarshal([]byte(data[len(data)-1]), &last)
		if n := len(e.enc.EncodeText(nil, whole)); last.Usage == nil || last.Usage.CompletionTokens != n || len(last.Choices) != 0 {
			t.Fatalf("usage chunk %s, want %d completion tokens", data[len(data)-1], n)
		}
	}
}

// responsesTools is a Responses request's tools, get_weather first.
const responsesToolsJSON = `[{"type":"function","name":"get_weather","parameters":` + weatherSchema + `},` +
	`{"type":"function","name":"lookup","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}]`

// A Responses request that must call a tool answers with one
// function_call output item, as vLLM's; streamed, the item is added with
// the first token, each token's text is an arguments delta, then come the
// arguments done, the item done and response.completed.
func TestResponsesToolCall(t *testing.T) {
	e, url := startEngine(t, Config{})
	body := `{"input":"Weather in Lisbon?","tools":` + responsesToolsJSON + `,"tool_choice":"required"`
	code, raw, o := do(t, "POST", url+"/v1/responses", body+`}`)
	var whole struct {
		Output []functionCallItem `json:"output"`
	}
	json.Unmarshal(raw, &whole)
	if code != 200 || o.Status != "completed" || len(whole.Output) != 1 {
		t.Fatalf("status %d: %s", code, raw)
	}
	item := whole.Output[0]
	itemRe := `\{"arguments":"[^"\\]*(\\"[^"\\]*)*","call_id":"call_[0-9a-f]{32}","name":"get_weather","type":"function_call","id":"fc_[0-9a-f]{32}","status":"completed"\}`
	if !regexp.MustCompile(`"output":\[` + itemRe + `\]`).Match(raw) {
		t.Fatalf("output item: %s", raw)
	}
	checkWeatherArgs(t, item.Arguments)
	if n := len(e.enc.EncodeText(nil, item.Arguments)); o.Usage.OutputTokens != n {
		t.Fatalf("%d output tokens for arguments of %d tokens", o.Usage.OutputTokens, n)
	}
	named := createResponse(t, url, `{"input":"hi","tools":`+responsesToolsJSON+`,"tool_choice":{"type":"function","name":"lookup"}}`)
	if named.Status != "completed" || named.Usage.OutputTokens == 0 {
		t.Fatalf("named call: %+v", named)
	}
	_, raw, _ = do(t, "GET", url+"/v1/responses/"+named.ID, "")
	if !regexp.MustCompile(`"output":\[\{"arguments":"\{\\"q\\":\\"[a-z]+\\"\}","call_id":"call_[0-9a-f]+","name":"lookup"`).Match(raw) {
		t.Fatalf("named call, as stored: %s", raw)
	}

	resp, err := http.Post(url+"/v1/responses", "application/json", strings.NewReader(body+`,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var names []string
	var args strings.Builder
	var events []sseEvent
	br := bufio.NewReader(resp.Body)
	for {
		ev, ok := readEvent(t, br)
		if !ok {
			break
		}
		names = append(names, ev.name)
		events = append(events, ev)
		if ev.name == "response.function_call_arguments.delta" {
			args.WriteString(ev.data["delta"].(string))
		}
	}
	want := []string{"response.created", "response.in_progress", "response.output_item.added"}
	for range len(names) - 6 {
		want = append(want, "response.function_call_arguments.delta")
	}
	want = append(want, "response.function_call_arguments.done", "response.output_item.done", "response.completed")
	if !slices.Equal(names, want) || len(names) < 7 {
		t.Fatalf("events %q", names)
	}
	if args.String() != item.Arguments {
		t.Fatalf("streamed arguments %s, whole %s", args.String(), item.Arguments)
	}
	for i, re := range map[int]string{
		2:              `^\{"item":\{"arguments":"","call_id":"call_[0-9a-f]{32}","name":"get_weather","type":"function_call","id":"(fc_[0-9a-f]{32})","status":"in_progress"\},"output_index":0,"sequence_number":2,"type":"response.output_item.added"\}$`,
		3:              `^\{"delta":"[^"\\]*(\\"[^"\\]*)*","item_id":"fc_[0-9a-f]{32}","output_index":0,"sequence_number":3,"type":"response.function_call_arguments.delta"\}$`,
		len(names) - 3: `^\{"arguments":"[^"\\]*(\\"[^"\\]*)*","item_id":"fc_[0-9a-f]{32}","name":"get_weather","output_index":0,"sequence_number":\d+,"type":"response.function_call_arguments.done"\}$`,
		len(names) - 2: `^\{"item":` + itemRe + `,"output_index":0,"sequence_number":\d+,"type":"response.output_item.done"\}$`,
	} {
		if !regexp.MustCompile(re).MatchString(events[i].raw) {
			t.Fatalf("event %d: %s", i, events[i].raw)
		}
	}
	done := events[len(events)-2].data["item"].(map[string]any)
	if done["arguments"] != item.Arguments || !strings.Contains(events[2].raw, done["id"].(string)) || !strings.Contains(events[2].raw, done["call_id"].(string)) {
		t.Fatalf("item done %v, added %s", done, events[2].raw)
	}
	completed := events[len(events)-1].data["response"].(map[string]any)
	if u := completed["usage"].(map[string]any); u["output_tokens"] != float64(o.Usage.OutputTokens) {
		t.Fatalf("completed usage %v", u)
	}
}

// anthropicToolsJSON is a Messages request's tools, get_weather first.
const anthropicToolsJSON = `[{"name":"get_weather","input_schema":` + weatherSchema + `},` +
	`{"name":"lookup","input_schema":{"type":"object","properties":{"q":{"type":"string"}}}}]`

// A Messages request that must use a tool gets the tool_use block vLLM
// converts the chat call to (the call's id, its name, the arguments as
// input), stop_reason tool_use for {"type":"any"} and end_turn for a
// named tool (the chat finish reason "stop"); streamed, the block starts
// with an empty input and each token's text is an input_json_delta.
func TestMessagesToolUse(t *testing.T) {
	e, url := startEngine(t, Config{})
	body := `{"model":"mock-model","max_tokens":64,"messages":[{"role":"user","content":"Weather in Lisbon?"}],"tools":` + anthropicToolsJSON
	code, raw, m := postMessages(t, url+"/v1/messages", body+`,"tool_choice":{"type":"any"}}`)
	var whole struct {
		Content []struct {
			Type  string          `json:"type"`
			ID    string          `json:"id"`
			Name  string          `json:"name"`
			Input json.RawMessage `json:"input"`
		} `json:"content"`
	}
	json.Unmarshal(raw, &whole)
	if code != 200 || m.StopReason != "tool_use" || len(whole.Content) != 1 ||
		!regexp.MustCompile(`"content":\[\{"type":"tool_use","id":"chatcmpl-tool-[0-9a-f]{32}","name":"get_weather","input":\{.*\}\}\],"model"`).Match(raw) {
		t.Fatalf("status %d: %s", code, raw)
	}
	input := string(whole.Content[0].Input)
	checkWeatherArgs(t, input)
	if n := len(e.enc.EncodeText(nil, input)); m.Usage.OutputTokens != n {
		t.Fatalf("%d output tokens for an input of %d tokens", m.Usage.OutputTokens, n)
	}
	if named := createMessage(t, url, body+`,"tool_choice":{"type":"tool","name":"lookup"}}`); named.StopReason != "end_turn" {
		t.Fatalf("named tool: stop_reason %s", named.StopReason)
	}

	resp, err := http.Post(url+"/v1/messages", "application/json", strings.NewReader(body+`,"tool_choice":{"type":"any"},"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	all, _ := io.ReadAll(resp.Body)
	events, ok := strings.CutSuffix(string(all), "data: [DONE]\n\n")
	if !ok {
		t.Fatalf("no final [DONE]: %s", all)
	}
	var names []string
	var partial strings.Builder
	var evs []sseEvent
	br := bufio.NewReader(strings.NewReader(events))
	for {
		ev, ok := readEvent(t, br)
		if !ok {
			break
		}
		names = append(names, ev.name)
		evs = append(evs, ev)
		if ev.name == "content_block_delta" {
			if !regexp.MustCompile(`^\{"type":"content_block_delta","delta":\{"type":"input_json_delta","partial_json":"[^"\\]*(\\"[^"\\]*)*"\},"index":0\}$`).MatchString(ev.raw) {
				t.Fatalf("delta %s", ev.raw)
			}
			partial.WriteString(ev.data["delta"].(map[string]any)["partial_json"].(string))
		}
	}
	want := []string{"message_start", "content_block_start"}
	for range len(names) - 5 {
		want = append(want, "content_block_delta")
	}
	want = append(want, "content_block_stop", "message_delta", "message_stop")
	if !slices.Equal(names, want) || len(names) < 6 {
		t.Fatalf("events %q", names)
	}
	if !regexp.MustCompile(`^\{"type":"content_block_start","content_block":\{"type":"tool_use","id":"chatcmpl-tool-[0-9a-f]{32}","name":"get_weather","input":\{\}\},"index":0\}$`).MatchString(evs[1].raw) {
		t.Fatalf("block start %s", evs[1].raw)
	}
	if partial.String() != input {
		t.Fatalf("streamed input %s, whole %s", partial.String(), input)
	}
	if d := evs[len(evs)-2].raw; !strings.Contains(d, `"delta":{"stop_reason":"tool_use"}`) || !strings.Contains(d, `"output_tokens":`+itoa(m.Usage.OutputTokens)+`,`) {
		t.Fatalf("message_delta %s", d)
	}
}

// Each output token of a call carries the arguments' text up to where it
// ends, cut between characters: the pieces make the arguments again.
func TestToolCallTokenPieces(t *testing.T) {
	e, _ := startEngine(t, Config{})
	for _, text := range []string{`{"unit":"été","n":7,"s":"日本語のテキスト"}`, `{}`, `{"a":"` + strings.Repeat("river ", 40) + `"}`} {
		ids, ends := e.tokenPieces(text)
		if !slices.Equal(ids, e.enc.EncodeText(nil, text)) || len(ends) != len(ids) || ends[len(ends)-1] != len(text) {
			t.Fatalf("%s: %d ids, ends %v", text, len(ids), ends)
		}
		c := &toolCall{arguments: text, ends: ends}
		var b strings.Builder
		for j := range ids {
			piece := c.piece(j, j+1)
			if !utf8.ValidString(piece) {
				t.Fatalf("%s: token %d's piece %q cuts a character", text, j, piece)
			}
			b.WriteString(piece)
		}
		if b.String() != text {
			t.Fatalf("pieces make %q, not %q", b.String(), text)
		}
	}
}
