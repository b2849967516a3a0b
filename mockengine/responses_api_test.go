package mockengine

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// respObject is the part of a response object the tests read.
type respObject struct {
	ID                 string  `json:"id"`
	Object             string  `json:"object"`
	Model              string  `json:"model"`
	Status             string  `json:"status"`
	PreviousResponseID *string `json:"previous_response_id"`
	IncompleteDetails  *struct {
		Reason string `json:"reason"`
	} `json:"incomplete_details"`
	Output []struct {
		ID      string `json:"id"`
		Type    string `json:"type"`
		Role    string `json:"role"`
		Status  string `json:"status"`
		Content []struct {
			Type        string `json:"type"`
			Text        string `json:"text"`
			Annotations []any  `json:"annotations"`
		} `json:"content"`
	} `json:"output"`
	Usage *struct {
		InputTokens        int `json:"input_tokens"`
		InputTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
		OutputTokens        int `json:"output_tokens"`
		OutputTokensDetails struct {
			ReasoningTokens *int `json:"reasoning_tokens"`
		} `json:"output_tokens_details"`
		TotalTokens int `json:"total_tokens"`
	} `json:"usage"`
	Error *openAIError `json:"error"`
}

func (o *respObject) text() string {
	if len(o.Output) != 1 || len(o.Output[0].Content) != 1 {
		return ""
	}
	return o.Output[0].Content[0].Text
}

// do sends a request with a raw JSON body and returns the status, the body
// and the body decoded.
func do(t *testing.T, method, url, body string) (int, []byte, respObject) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	return readJSON[respObject](t, resp, err)
}

func createResponse(t *testing.T, url, body string) respObject {
	t.Helper()
	code, raw, o := do(t, "POST", url+"/v1/responses", body)
	if code != 200 || o.Object != "response" || o.Usage == nil {
		t.Fatalf("status %d: %s", code, raw)
	}
	return o
}

// chatTokens is the prompt the engine renders for a chat request body.
func chatTokens(t *testing.T, e *Engine, body string) []uint32 {
	t.Helper()
	_, prompt, _, err := e.parse(httptest.NewRecorder(), httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body)), true)
	if err != nil {
		t.Fatalf("chat %s: %v", body, err)
	}
	return prompt
}

// responsesTokens is the prompt the engine renders for a Responses body.
func responsesTokens(t *testing.T, e *Engine, body string) []uint32 {
	t.Helper()
	c, err := e.parseResponses(httptest.NewRecorder(), httptest.NewRequest("POST", "/v1/responses", strings.NewReader(body)))
	if err != nil {
		t.Fatalf("responses %s: %v", body, err)
	}
	return c.prompt
}

var longInput = strings.Repeat("The quick brown fox jumps over the lazy dog. ", 20)

// A Responses request is the chat request with the same messages: the same
// prompt tokens, so each finds the blocks the other left in the cache.
func TestResponsesSharePromptWithChat(t *testing.T) {
	e, url := startEngine(t, Config{})
	in, _ := json.Marshal(longInput)
	body := `{"model":"mock-model","instructions":"You are terse.","input":` + string(in) + `,"max_output_tokens":2}`
	first := createResponse(t, url, body)
	if first.Usage.InputTokensDetails.CachedTokens != 0 {
		t.Fatalf("cold prompt cached %d", first.Usage.InputTokensDetails.CachedTokens)
	}
	_, chat := post(t, url+"/v1/chat/completions", chatBody(longInput, map[string]any{"max_tokens": 2}))
	p := first.Usage.InputTokens
	if chat.Usage.PromptTokens != p || chat.Usage.PromptTokensDetails.CachedTokens != (p-1)/16*16 {
		t.Fatalf("chat: %+v, want the Responses prompt of %d tokens all cached", chat.Usage, p)
	}
	again := createResponse(t, url, body)
	if c := again.Usage.InputTokensDetails.CachedTokens; again.Usage.InputTokens != p || c != (p-1)/16*16 {
		t.Fatalf("repeated request: %d tokens, %d cached", again.Usage.InputTokens, c)
	}
	if !slices.Equal(responsesTokens(t, e, body), chatTokens(t, e, `{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":`+string(in)+`}]}`)) {
		t.Fatal("the prompts differ")
	}
	u := again.Usage
	if u.TotalTokens != u.InputTokens+u.OutputTokens || u.OutputTokens < 1 || u.OutputTokensDetails.ReasoningTokens == nil {
		t.Fatalf("usage %+v", u)
	}
	if !strings.HasPrefix(first.ID, "resp_") || len(first.ID) != 37 || first.ID == again.ID || !strings.HasPrefix(first.Output[0].ID, "msg_") {
		t.Fatalf("ids %s %s %s", first.ID, again.ID, first.Output[0].ID)
	}
	o := first.Output[0]
	if o.Type != "message" || o.Role != "assistant" || o.Status != "completed" || len(o.Content) != 1 ||
		o.Content[0].Type != "output_text" || o.Content[0].Annotations == nil || len(strings.Fields(o.Content[0].Text)) != u.OutputTokens {
		t.Fatalf("output %+v", first.Output)
	}
}

// A follow-up names the previous response: its prompt is its own
// instructions, the earlier turn, the answer, then the new input, and with
// the same instructions it hits the earlier turn's blocks.
func TestResponsesFollowUp(t *testing.T) {
	e, url := startEngine(t, Config{})
	in, _ := json.Marshal(longInput)
	first := createResponse(t, url, `{"instructions":"You are terse.","input":`+string(in)+`,"max_output_tokens":8,"ignore_eos":true}`)
	if first.Status != "incomplete" || first.IncompleteDetails == nil || first.IncompleteDetails.Reason != "max_output_tokens" {
		t.Fatalf("an answer cut at max_output_tokens is incomplete, as in vLLM: %s %+v", first.Status, first.IncompleteDetails)
	}
	body := `{"instructions":"You are terse.","input":"And then?","previous_response_id":"` + first.ID + `","max_output_tokens":2}`
	next := createResponse(t, url, body)
	if next.PreviousResponseID == nil || *next.PreviousResponseID != first.ID {
		t.Fatalf("previous_response_id %v", next.PreviousResponseID)
	}
	answer, _ := json.Marshal(first.text())
	want := chatTokens(t, e, `{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":`+string(in)+
		`},{"role":"assistant","content":`+string(answer)+`},{"role":"user","content":"And then?"}]}`)
	if got := responsesTokens(t, e, body); !slices.Equal(got, want) {
		t.Fatalf("follow-up prompt (%d tokens) is not the conversation (%d tokens)", len(got), len(want))
	}
	u := next.Usage
	if u.InputTokens != len(want) || u.InputTokens <= first.Usage.InputTokens+first.Usage.OutputTokens {
		t.Fatalf("follow-up of %d tokens after a turn of %d+%d", u.InputTokens, first.Usage.InputTokens, first.Usage.OutputTokens)
	}
	if c := u.InputTokensDetails.CachedTokens; c < (first.Usage.InputTokens-16)/16*16 {
		t.Fatalf("follow-up cached %d tokens, the earlier turn had %d", c, first.Usage.InputTokens)
	}
	// A third turn carries both earlier ones.
	third := createResponse(t, url, `{"input":"Go on.","previous_response_id":"`+next.ID+`","max_output_tokens":2}`)
	if third.Usage.InputTokens <= u.InputTokens+u.OutputTokens {
		t.Fatalf("third turn of %d tokens after %d+%d", third.Usage.InputTokens, u.InputTokens, u.OutputTokens)
	}
}

// The answers for an id the engine does not hold are vLLM's 404.
func TestResponsesUnknownID(t *testing.T) {
	_, url := startEngine(t, Config{})
	want := `{"error":{"message":"Response with id 'resp_0123' not found.","type":"invalid_request_error","param":"response_id","code":404}}`
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/v1/responses", `{"input":"hi","previous_response_id":"resp_0123"}`},
		{"POST", "/v1/responses", `{"input":"hi","previous_response_id":"resp_0123","stream":true}`},
		{"GET", "/v1/responses/resp_0123", ""},
		{"POST", "/v1/responses/resp_0123/cancel", ""},
		{"DELETE", "/v1/responses/resp_0123", ""},
	} {
		code, raw, _ := do(t, c.method, url+c.path, c.body)
		if code != 404 || string(raw) != want {
			t.Fatalf("%s %s %s: %d %s", c.method, c.path, c.body, code, raw)
		}
	}
}

// sseEvent is one server-sent event.
type sseEvent struct {
	name string
	data map[string]any
	raw  string
}

// readEvent reads the next event, or returns false at the end.
func readEvent(t *testing.T, br *bufio.Reader) (sseEvent, bool) {
	t.Helper()
	var ev sseEvent
	for {
		line, err := br.ReadString('\n')
		if err == io.EOF && line == "" {
			if ev.name != "" || ev.raw != "" {
				t.Fatalf("stream cut inside event %q", ev.name)
			}
			return ev, false
		}
		if err != nil {
			t.Fatal(err)
		}
		line = strings.TrimSuffix(line, "\n")
		switch {
		case line == "":
			if ev.name == "" || ev.raw == "" {
				t.Fatalf("event without name or data: %+v", ev)
			}
			return ev, true
		case strings.HasPrefix(line, "event: "):
			ev.name = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			ev.raw = strings.TrimPrefix(line, "data: ")
			if err := json.Unmarshal([]byte(ev.raw), &ev.data); err != nil {
				t.Fatalf("data is not a JSON object: %s", ev.raw)
			}
		default:
			t.Fatalf("unexpected SSE line %q", line)
		}
	}
}

// The stream is vLLM's event sequence, one delta per token, no [DONE];
// response.created comes before the prefill ends.
func TestResponsesStream(t *testing.T) {
	e, url := startEngine(t, Config{})
	_, release := holdFirstStep(e) // until the client saw response.created
	resp, err := http.Post(url+"/v1/responses", "application/json",
		strings.NewReader(`{"input":"stream please","max_output_tokens":6,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	br := bufio.NewReader(resp.Body)
	start := time.Now()
	var events []sseEvent
	for {
		ev, ok := readEvent(t, br)
		if !ok {
			break
		}
		if len(events) == 1 {
			if time.Since(start) > 4*time.Second {
				t.Fatal("response.created and response.in_progress waited for the prefill")
			}
			close(release)
		}
		events = append(events, ev)
	}
	var names []string
	for i, ev := range events {
		names = append(names, ev.name)
		if ev.data["type"] != ev.name || ev.data["sequence_number"] != float64(i) {
			t.Fatalf("event %d %s: %s", i, ev.name, ev.raw)
		}
		if strings.Contains(ev.raw, "[DONE]") {
			t.Fatal("the Responses stream has no [DONE]")
		}
	}
	want := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
	for range 6 {
		want = append(want, "response.output_text.delta")
	}
	want = append(want, "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed")
	if !slices.Equal(names, want) {
		t.Fatalf("events %q\nwant %q", names, want)
	}
	for _, ev := range events[:2] {
		r := ev.data["response"].(map[string]any)
		if r["status"] != "in_progress" || r["usage"] != nil || len(r["output"].([]any)) != 0 {
			t.Fatalf("%s: %s", ev.name, ev.raw)
		}
	}
	item := events[2].data["item"].(map[string]any)["id"].(string)
	var text string
	for _, ev := range events[4:10] {
		d := ev.data
		delta := d["delta"].(string)
		if len(strings.Fields(delta)) != 1 || d["item_id"] != item || d["output_index"] != 0.0 || d["content_index"] != 0.0 {
			t.Fatalf("delta %s", ev.raw)
		}
		text += delta
	}
	if events[10].data["text"] != text || events[11].data["part"].(map[string]any)["text"] != text {
		t.Fatalf("done events do not carry the text %q: %s %s", text, events[10].raw, events[11].raw)
	}
	var final struct {
		Response respObject `json:"response"`
	}
	json.Unmarshal([]byte(events[13].raw), &final)
	r := final.Response
	if r.text() != text || r.Output[0].ID != item || r.Usage == nil || r.Usage.OutputTokens != 6 || r.Usage.InputTokens == 0 || r.ID != events[0].data["response"].(map[string]any)["id"] {
		t.Fatalf("completed %s", events[13].raw)
	}
	// Stored as streamed.
	if code, _, got := do(t, "GET", url+"/v1/responses/"+r.ID, ""); code != 200 || got.text() != text {
		t.Fatalf("GET after a stream: %d %+v", code, got)
	}
}

// writeTemplate makes a model template that renders what the built-in
// ones leave out: tools, tool calls, tool call ids and reasoning.
func writeTemplate(t *testing.T) string {
	dir := t.TempDir()
	tmpl := `{{ tools | tojson }}{% for m in messages %}[{{ m.role }}]{{ m.content }}|{{ m.tool_calls | tojson }}|{{ m.tool_call_id }}|{{ m.reasoning }}{% endfor %}`
	cfg, _ := json.Marshal(map[string]any{"chat_template": tmpl})
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// Input items and tools become the chat messages and tools vLLM builds
// from them (construct_chat_messages_with_tool_call, construct_tool_dicts):
// the same prompt as the chat request written that way.
func TestResponsesItemsAndToolsAsChat(t *testing.T) {
	tool := `{"type":"function","name":"get_weather","description":"Weather now","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}`
	spaced := `{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}`
	chatTool := `{"type":"function","function":{"name":"get_weather","description":"Weather now","parameters":{"type":"object","properties":{"city":{"type":"string"}}},"strict":null}}`
	builtIn := `{"type":"web_search_preview"}`
	fc := func(id, city string) string {
		return `{"type":"function_call","call_id":"` + id + `","name":"get_weather","arguments":"{\"city\":\"` + city + `\"}","id":"fc_` + id + `"}`
	}
	call := func(id, city string) string {
		return `{"id":"` + id + `","function":{"name":"get_weather","arguments":"{\"city\":\"` + city + `\"}"},"type":"function"}`
	}
	user := `{"role":"user","content":"weather?"}`
	for _, c := range []struct{ name, responses, chat string }{
		{"tools",
			`{"input":"weather?","tools":[` + tool + `]}`,
			`{"messages":[` + user + `],"tools":[` + chatTool + `]}`},
		{"no tools are none",
			`{"input":"weather?","tools":[]}`,
			`{"messages":[` + user + `]}`},
		{"tool_choice none keeps the tools",
			`{"input":"weather?","tools":[` + tool + `],"tool_choice":"none"}`,
			`{"messages":[` + user + `],"tools":[` + chatTool + `]}`},
		{"built-in tools are skipped, spaced parameters compacted",
			`{"input":"weather?","tools":[` + builtIn + `,` + spaced + `,{"type":"file_search","vector_store_ids":["v"]}]}`,
			`{"messages":[` + user + `],"tools":[` + chatTool + `]}`},
		{"only built-in tools are an empty list",
			`{"input":"weather?","tools":[` + builtIn + `]}`,
			`{"messages":[` + user + `],"tools":[]}`},
		{"function call and output",
			`{"input":[` + user + `,` + fc("call_1", "Paris") + `,{"type":"function_call_output","call_id":"call_1","output":"sunny"},` + fc("call_2", "Rome") + `]}`,
			`{"messages":[` + user + `,{"role":"assistant","tool_calls":[` + call("call_1", "Paris") + `]},` +
				`{"role":"tool","content":"sunny","tool_call_id":"call_1"},{"role":"assistant","tool_calls":[` + call("call_2", "Rome") + `]}]}`},
		{"reasoning and two calls are one message",
			`{"input":[` + user + `,{"type":"reasoning","summary":[],"content":[{"type":"reasoning_text","text":"think"}]},` + fc("call_1", "Paris") + `,` + fc("call_2", "Rome") + `]}`,
			`{"messages":[` + user + `,{"role":"assistant","reasoning":"think","tool_calls":[` + call("call_1", "Paris") + `,` + call("call_2", "Rome") + `]}]}`},
		{"assistant text and a call are one message",
			`{"input":[` + user + `,{"type":"message","role":"assistant","content":[{"type":"output_text","text":"let me look"}]},` + fc("call_1", "Paris") + `]}`,
			`{"messages":[` + user + `,{"role":"assistant","content":"let me look","tool_calls":[` + call("call_1", "Paris") + `]}]}`},
		{"a call, then its text",
			`{"input":[` + fc("call_1", "Paris") + `,{"role":"assistant","content":"looked"},{"role":"assistant","content":"again"}]}`,
			`{"messages":[{"role":"assistant","content":"looked","tool_calls":[` + call("call_1", "Paris") + `]},{"role":"assistant","content":"again"}]}`},
		{"reasoning, then its text",
			`{"input":[` + user + `,{"type":"reasoning","summary":[{"type":"summary_text","text":"think"}]},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hello"}]}]}`,
			`{"messages":[` + user + `,{"role":"assistant","reasoning":"think","content":"hello"}]}`},
		{"text, then its reasoning",
			`{"input":[` + user + `,{"role":"assistant","content":"hello"},{"type":"reasoning","summary":[{"text":"think"}]}]}`,
			`{"messages":[` + user + `,{"role":"assistant","content":"hello","reasoning":"think"}]}`},
		{"two reasoning items are two messages",
			`{"input":[` + user + `,{"type":"reasoning","summary":[{"text":"a"}]},{"type":"reasoning","summary":[{"text":"b"}]}]}`,
			`{"messages":[` + user + `,{"role":"assistant","reasoning":"a"},{"role":"assistant","reasoning":"b"}]}`},
		{"empty reasoning is reasoning all the same",
			`{"input":[` + user + `,{"type":"reasoning","summary":[]},{"type":"reasoning","summary":[{"text":"b"}]}]}`,
			`{"messages":[` + user + `,{"role":"assistant","reasoning":""},{"role":"assistant","reasoning":"b"}]}`},
		{"empty assistant text is content all the same",
			`{"input":[{"role":"assistant","content":[]},` + fc("call_1", "Paris") + `,{"role":"assistant","content":"x"}]}`,
			`{"messages":[{"role":"assistant","content":"","tool_calls":[` + call("call_1", "Paris") + `]},{"role":"assistant","content":"x"}]}`},
		{"reasoning from its first content part before its summaries",
			`{"input":[` + user + `,{"type":"reasoning","summary":[{"text":"sum"}],"content":[{"type":"reasoning_text","text":"deep"},{"type":"reasoning_text","text":"deeper"}]}]}`,
			`{"messages":[` + user + `,{"role":"assistant","reasoning":"deep"}]}`},
		{"reasoning from its first summary, encrypted content not read",
			`{"input":[` + user + `,{"type":"reasoning","summary":[{"text":"a"},{"text":"b"}],"encrypted_content":"xx"}]}`,
			`{"messages":[` + user + `,{"role":"assistant","reasoning":"a"}]}`},
		{"assistant text is its first part's",
			`{"input":[` + user + `,{"type":"message","role":"assistant","content":[{"type":"output_text","text":"one"},{"type":"output_text","text":"two"}]},` +
				user + `,{"role":"assistant","content":[{"type":"refusal","refusal":"no"}]}]}`,
			`{"messages":[` + user + `,{"role":"assistant","content":"one"},` + user + `,{"role":"assistant","content":""}]}`},
		{"a namespaced call",
			`{"input":[{"type":"function_call","call_id":"c","namespace":"crm","name":"find","arguments":"{}"}]}`,
			`{"messages":[{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"crm__find","arguments":"{}"},"type":"function"}]}]}`},
		{"message parts and roles",
			`{"instructions":"Be kind.","input":[{"role":"developer","content":"dev"},{"role":"system","content":"sys"},{"type":"message","role":"user","content":[{"type":"input_text","text":"one"},{"type":"input_text","text":"two"}]}]}`,
			`{"messages":[{"role":"system","content":"Be kind."},{"role":"developer","content":"dev"},{"role":"system","content":"sys"},{"role":"user","content":"one\ntwo"}]}`},
	} {
		for _, template := range []string{"chatml", writeTemplate(t)} {
			e, _ := startEngine(t, Config{Template: template})
			got, want := responsesTokens(t, e, c.responses), chatTokens(t, e, c.chat)
			if !slices.Equal(got, want) {
				t.Errorf("%s, template %s: %d tokens, chat %d", c.name, filepath.Base(template), len(got), len(want))
			}
			e.Close()
		}
	}
}

// A follow-up carries the previous response's messages without their
// system ones (instructions do not carry over), each new then; the input
// items merge among themselves only, never into the history.
func TestResponsesFollowUpDropsSystem(t *testing.T) {
	e, url := startEngine(t, Config{Template: writeTemplate(t)})
	first := createResponse(t, url, `{"instructions":"Old rules.","input":[{"role":"system","content":"sys"},{"role":"developer","content":"dev"},{"role":"user","content":"hi"}],"max_output_tokens":3}`)
	body := `{"instructions":"New rules.","previous_response_id":"` + first.ID + `","input":[` +
		`{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c1","output":"done"}]}`
	answer, _ := json.Marshal(first.text())
	want := chatTokens(t, e, `{"messages":[{"role":"system","content":"New rules."},{"role":"developer","content":"dev"},{"role":"user","content":"hi"},`+
		`{"role":"assistant","content":`+string(answer)+`},{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{}"},"type":"function"}]},`+
		`{"role":"tool","content":"done","tool_call_id":"c1"}]}`)
	if got := responsesTokens(t, e, body); !slices.Equal(got, want) {
		t.Fatalf("follow-up prompt (%d tokens) is not the conversation (%d tokens)", len(got), len(want))
	}
	second := createResponse(t, url, body)
	// The third turn drops the second's instructions too.
	third := `{"previous_response_id":"` + second.ID + `","input":"more"}`
	answer2, _ := json.Marshal(second.text())
	want = chatTokens(t, e, `{"messages":[{"role":"developer","content":"dev"},{"role":"user","content":"hi"},`+
		`{"role":"assistant","content":`+string(answer)+`},{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{}"},"type":"function"}]},`+
		`{"role":"tool","content":"done","tool_call_id":"c1"},{"role":"assistant","content":`+string(answer2)+`},{"role":"user","content":"more"}]}`)
	if got := responsesTokens(t, e, third); !slices.Equal(got, want) {
		t.Fatalf("third turn (%d tokens) is not the conversation (%d tokens)", len(got), len(want))
	}
}

func TestResponsesBadRequests(t *testing.T) {
	e, url := startEngine(t, Config{})
	for _, c := range []struct {
		body, param string
		code        int
	}{
		{`{"input":`, "", 400},
		{`{"model":"mock-model"}`, "input", 400},
		{`{"input":7}`, "input", 400},
		{`{"input":[{"type":"web_search_call","id":"x"}]}`, "input", 400},
		{`{"input":[{"content":"no role"}]}`, "input", 400},
		{`{"input":[{"role":"tool","content":"bad role"}]}`, "input", 400},
		{`{"input":[{"type":"function_call","name":"f","arguments":"{}"}]}`, "input", 400},
		{`{"input":[{"type":"function_call_output","call_id":"c"}]}`, "input", 400},
		{`{"input":[{"type":"reasoning","summary":"x"}]}`, "input", 400},
		{`{"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"{}","namespace":7}]}`, "input", 400},
		{`{"input":["just a string"]}`, "input", 400},
		{`{"input":"x","tools":[{"name":"f"}]}`, "tools", 400},
		{`{"input":"x","tools":[7]}`, "tools", 400},
		{`{"input":"x","tools":[{"type":"function"}]}`, "tools", 400},
		{`{"input":"x","tools":[{"type":"function","name":"f","parameters":"x"}]}`, "tools", 400},
		{`{"input":"x","max_output_tokens":0}`, "max_output_tokens", 400},
		{`{"input":"x","max_output_tokens":100000000}`, "max_output_tokens", 400},
		{`{"input":"x","max_output_tokens":9223372036854775807}`, "max_output_tokens", 400},
		{`{"input":"x","stream":"yes"}`, "stream", 400},
		{`{"input":"x","background":true}`, "background", 400},
		{`{"input":"x","model":"other"}`, "model", 404},
	} {
		code, raw, r := do(t, "POST", url+"/v1/responses", c.body)
		if code != c.code || r.Error == nil || r.Error.Message == "" || r.Error.Type == "" || r.Error.Code != c.code {
			t.Fatalf("%s: status %d %s", c.body, code, raw)
		}
		if (c.param == "") != (r.Error.Param == nil) || (c.param != "" && *r.Error.Param != c.param) {
			t.Fatalf("%s: %s, want param %q", c.body, raw, c.param)
		}
	}
	waitIdle(t, e)
	if st := e.Stats(); st.Requests != 0 {
		t.Fatalf("a bad request reached the model: %+v", st)
	}
}

// Stored responses can be read back, cannot be cancelled (none runs in the
// background) and can be deleted; store:false ones are never kept.
func TestResponsesStore(t *testing.T) {
	_, url := startEngine(t, Config{})
	_, raw, kept := do(t, "POST", url+"/v1/responses", `{"input":"keep me","max_output_tokens":3}`)
	code, got, _ := do(t, "GET", url+"/v1/responses/"+kept.ID, "")
	if code != 200 || !bytes.Equal(got, raw) {
		t.Fatalf("GET: %d %s\nwant %s", code, got, raw)
	}
	code, got, r := do(t, "POST", url+"/v1/responses/"+kept.ID+"/cancel", "")
	if code != 400 || r.Error == nil || r.Error.Message != "Cannot cancel a synchronous response." {
		t.Fatalf("cancel: %d %s", code, got)
	}
	gone := createResponse(t, url, `{"input":"forget me","max_output_tokens":3,"store":false}`)
	for _, path := range []string{"/v1/responses/" + gone.ID, "/v1/responses/" + gone.ID + "/cancel"} {
		method := "GET"
		if strings.HasSuffix(path, "cancel") {
			method = "POST"
		}
		if code, got, _ := do(t, method, url+path, ""); code != 404 {
			t.Fatalf("%s %s of a store:false response: %d %s", method, path, code, got)
		}
	}
	if code, got, _ := do(t, "POST", url+"/v1/responses", `{"input":"more","previous_response_id":"`+gone.ID+`"}`); code != 404 {
		t.Fatalf("follow-up of a store:false response: %d %s", code, got)
	}
	code, got, _ = do(t, "DELETE", url+"/v1/responses/"+kept.ID, "")
	if want := fmt.Sprintf(`{"deleted":true,"id":%q,"object":"response.deleted"}`, kept.ID); code != 200 || string(got) != want {
		t.Fatalf("DELETE: %d %s", code, got)
	}
	if code, _, _ := do(t, "GET", url+"/v1/responses/"+kept.ID, ""); code != 404 {
		t.Fatalf("GET after DELETE: %d", code)
	}
}

// The store keeps the newest responses up to its capacity.
func TestResponseStoreBound(t *testing.T) {
	s := newResponseStore(3)
	for i := range 5 {
		s.put(&storedResponse{id: fmt.Sprint(i)})
	}
	for i := range 5 {
		if (s.get(fmt.Sprint(i)) != nil) != (i >= 2) {
			t.Fatalf("response %d kept: %v", i, s.get(fmt.Sprint(i)) != nil)
		}
	}
	if !s.remove("3") || s.remove("3") || s.remove("0") {
		t.Fatal("remove reports wrongly")
	}
	for i := 5; i < 200; i++ {
		s.put(&storedResponse{id: fmt.Sprint(i)})
		s.remove(fmt.Sprint(i - 1))
	}
	if len(s.byID) > 3 || len(s.order) > 2*3+64 || s.get("199") == nil {
		t.Fatalf("store holds %d responses, %d ids in order", len(s.byID), len(s.order))
	}
}

// A client that leaves a Responses request aborts it, as for chat.
func TestResponsesClientDisconnectAborts(t *testing.T) {
	checkDisconnectAborts(t, "/v1/responses", func(stream bool) any {
		return map[string]any{"input": strings.Repeat("word ", 1000), "max_output_tokens": 50, "stream": stream}
	})
}

// Each engine holds only its own responses: a follow-up sent to another
// engine is the 404 that tells a router it went astray.
func TestResponsesStoreIsPerEngine(t *testing.T) {
	_, a := startEngine(t, Config{})
	_, b := startEngine(t, Config{})
	first := createResponse(t, a, `{"input":"hello","max_output_tokens":2}`)
	follow := `{"input":"more","max_output_tokens":2,"previous_response_id":"` + first.ID + `"}`
	if code, raw, _ := do(t, "POST", b+"/v1/responses", follow); code != 404 || !strings.Contains(string(raw), first.ID) {
		t.Fatalf("follow-up on another engine: %d %s", code, raw)
	}
	if code, _, _ := do(t, "GET", b+"/v1/responses/"+first.ID, ""); code != 404 {
		t.Fatalf("GET on another engine: %d", code)
	}
	createResponse(t, a, follow)
}
