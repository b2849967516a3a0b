package mockengine

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// anthropicMessage is the part of a Messages answer (or error) the tests
// read.
type anthropicMessage struct {
	ID      string `json:"id"`
	Type    string `json:"type"`
	Role    string `json:"role"`
	Content []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	} `json:"content"`
	Model      string `json:"model"`
	StopReason string `json:"stop_reason"`
	Usage      *struct {
		InputTokens          int  `json:"input_tokens"`
		OutputTokens         int  `json:"output_tokens"`
		CacheReadInputTokens *int `json:"cache_read_input_tokens"`
	} `json:"usage"`
	Error *struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
	InputTokens *int `json:"input_tokens"` // count_tokens
}

// postMessages sends a raw body and returns the status, the body and the
// body decoded.
func postMessages(t *testing.T, url, body string) (int, []byte, anthropicMessage) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	return readJSON[anthropicMessage](t, resp, err)
}

func createMessage(t *testing.T, url, body string) anthropicMessage {
	t.Helper()
	code, raw, m := postMessages(t, url+"/v1/messages", body)
	if code != 200 || m.Type != "message" || m.Usage == nil || m.Usage.CacheReadInputTokens == nil {
		t.Fatalf("status %d: %s", code, raw)
	}
	return m
}

// messagesTokens is the prompt the engine renders for a Messages body.
func messagesTokens(t *testing.T, e *Engine, body string) []uint32 {
	t.Helper()
	c, err := e.parseMessages(httptest.NewRecorder(), httptest.NewRequest("POST", "/v1/messages", strings.NewReader(body)), false)
	if err != nil {
		t.Fatalf("messages %s: %v", body, err)
	}
	return c.prompt
}

// A Messages request is the chat request it converts to: the same prompt
// tokens, so each finds the blocks the other left in the cache, and the
// cached ones are reported as cache_read_input_tokens, input_tokens being
// the rest (Anthropic's meaning), in the answer and in the stream.
func TestMessagesSharePromptWithChat(t *testing.T) {
	e, url := startEngine(t, Config{})
	in, _ := json.Marshal(longInput)
	body := `{"model":"mock-model","system":"You are terse.","messages":[{"role":"user","content":` + string(in) + `}],"max_tokens":2}`
	first := createMessage(t, url, body)
	if *first.Usage.CacheReadInputTokens != 0 {
		t.Fatalf("cold prompt cached %d", *first.Usage.CacheReadInputTokens)
	}
	_, chat := post(t, url+"/v1/chat/completions", chatBody(longInput, map[string]any{"max_tokens": 2}))
	p := first.Usage.InputTokens
	if chat.Usage.PromptTokens != p || chat.Usage.PromptTokensDetails.CachedTokens != (p-1)/16*16 {
		t.Fatalf("chat: %+v, want the Messages prompt of %d tokens all cached", chat.Usage, p)
	}
	again := createMessage(t, url, body)
	if c := *again.Usage.CacheReadInputTokens; c != (p-1)/16*16 || again.Usage.InputTokens != p-c {
		t.Fatalf("repeated request: %d tokens, %d cached", again.Usage.InputTokens, c)
	}
	resp, err := http.Post(url+"/v1/messages", "application/json", strings.NewReader(strings.Replace(body, `{`, `{"stream":true,`, 1)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	stream, _ := io.ReadAll(resp.Body)
	usages := regexp.MustCompile(`"usage":\{"input_tokens":(\d+),"output_tokens":\d+,"cache_read_input_tokens":(\d+)\}`).FindAllStringSubmatch(string(stream), -1)
	if len(usages) != 2 {
		t.Fatalf("stream: %s", stream)
	}
	for _, u := range usages {
		if u[1] != itoa(p-(p-1)/16*16) || u[2] != itoa((p-1)/16*16) {
			t.Fatalf("stream usage %s, want %d tokens of which %d cached", u[0], p, (p-1)/16*16)
		}
	}
	if !slices.Equal(messagesTokens(t, e, body), chatTokens(t, e, `{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":`+string(in)+`}]}`)) {
		t.Fatal("the prompts differ")
	}
}

// The answer is vLLM's AnthropicMessagesResponse dumped with exclude_none,
// members in its order, with cache_read_input_tokens added to usage.
func TestMessagesWhole(t *testing.T) {
	_, url := startEngine(t, Config{})
	for _, c := range []struct {
		content, extra, stop string
	}{{"hi", `,"ignore_eos":true`, "max_tokens"}, {"hello", ``, ""}} {
		code, raw, m := postMessages(t, url+"/v1/messages", `{"model":"mock-model","messages":[{"role":"user","content":"`+c.content+`"}],"max_tokens":5`+c.extra+`}`)
		want := `^\{"id":"chatcmpl-[^"]+","type":"message","role":"assistant","content":\[\{"type":"text","text":"( \w+)+"\}\],"model":"mock-model",` +
			`"stop_reason":"(end_turn|max_tokens)","usage":\{"input_tokens":\d+,"output_tokens":\d+,"cache_read_input_tokens":0\}\}$`
		if code != 200 || !regexp.MustCompile(want).Match(raw) {
			t.Fatalf("status %d: %s", code, raw)
		}
		n := len(strings.Fields(m.Content[0].Text))
		if m.Usage.OutputTokens != n || (c.stop != "" && m.StopReason != c.stop) || (n == 5) != (m.StopReason == "max_tokens") {
			t.Fatalf("%d words: %s", n, raw)
		}
	}
}

// Blocks, tools and the system prompt become the chat request vLLM builds
// from them: the same prompt as that chat request written by hand, with
// a template that shows tools, tool calls, tool call ids and reasoning as
// well as with one that renders the tool calls' text.
func TestMessagesBlocksAsChat(t *testing.T) {
	for _, template := range []string{"chatml", writeTemplate(t)} {
		e, _ := startEngine(t, Config{Template: template})
		for _, c := range []struct{ name, messages, chat string }{
			{"system blocks run together",
				`{"system":[{"type":"text","text":"Be "},{"type":"text","text":""},{"type":"text","text":"kind."}],"messages":[{"role":"user","content":"hi"}]}`,
				`{"messages":[{"role":"system","content":"Be kind."},{"role":"user","content":"hi"}]}`},
			{"empty system is none",
				`{"system":"","messages":[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"text","text":"x"}]}]}`,
				`{"messages":[{"role":"user","content":"hi"},{"role":"user","content":"x"}]}`},
			{"empty system blocks are none, blocks without text a system message of nothing",
				`{"system":[],"messages":[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"text","text":"x"}]}]}`,
				`{"messages":[{"role":"user","content":"hi"},{"role":"user","content":"x"}]}`},
			{"system blocks without text are none",
				`{"system":[{"type":"image"}],"messages":[{"role":"user","content":"hi"}]}`,
				`{"messages":[{"role":"user","content":"hi"}]}`},
			{"the billing header is left out of the system prompt",
				`{"system":[{"type":"text","text":"x-anthropic-billing-header: cch=1;"},{"type":"text","text":"Be kind."}],"messages":[{"role":"user","content":"hi"}]}`,
				`{"messages":[{"role":"system","content":"Be kind."},{"role":"user","content":"hi"}]}`},
			{"a billing header string is no system prompt",
				`{"system":"x-anthropic-billing-header: cch=2;","messages":[{"role":"user","content":"hi"}]}`,
				`{"messages":[{"role":"user","content":"hi"}]}`},
			{"text blocks are parts",
				`{"messages":[{"role":"user","content":[{"type":"text","text":"one"},{"type":"text","text":""},{"type":"text","text":"two"}]}]}`,
				`{"messages":[{"role":"user","content":[{"type":"text","text":"one"},{"type":"text","text":"two"}]}]}`},
			{"image as a base64 data URL",
				`{"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}},{"type":"text","text":"what is it?"}]}]}`,
				`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}},{"type":"text","text":"what is it?"}]}]}`},
			{"image media type jpeg by default, a url source its url",
				`{"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","data":"AAAA"}},{"type":"image","source":{"type":"url","url":"https://x.test/a.png"}}]}]}`,
				`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,AAAA"}},{"type":"image_url","image_url":{"url":"https://x.test/a.png"}}]}]}`},
			{"tool use and result",
				`{"tools":[{"name":"get_weather","description":"Weather now","input_schema":{"properties":{"city":{"type":"string"}}}}],"messages":[` +
					`{"role":"user","content":"weather in Zürich?"},` +
					`{"role":"assistant","content":[{"type":"text","text":"Let me look."},{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Zürich","days":1.0,"x":1e16}}]},` +
					`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"sunny"},{"type":"text","text":"thanks"}]}]}`,
				`{"tools":[{"type":"function","function":{"name":"get_weather","description":"Weather now","parameters":{"properties":{"city":{"type":"string"}},"type":"object"}}}],"messages":[` +
					`{"role":"user","content":"weather in Zürich?"},` +
					`{"role":"assistant","content":"Let me look.","tool_calls":[{"id":"toolu_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Z\\u00fcrich\", \"days\": 1.0, \"x\": 1e+16}"}}]},` +
					`{"role":"tool","tool_call_id":"toolu_1","content":"sunny"},{"role":"user","content":"thanks"}]}`},
			{"tool result names its call by tool_use_id; a list is its texts, one a line, followed by a user message of its images",
				`{"messages":[{"role":"user","content":[{"type":"tool_result","id":"x","tool_use_id":"toolu_1","content":[{"type":"text","text":"it's 20°"},` +
					`{"type":"image","source":{"type":"base64","media_type":"image/png","data":"QUJD"}},{"type":"other"},{"type":"image"},{"type":"image","source":{"type":"url"}},{"type":"text","text":"dry"}]},` +
					`{"type":"tool_result","content":null},{"type":"text","text":"and?"}]}]}`,
				`{"messages":[{"role":"tool","tool_call_id":"toolu_1","content":"it's 20°\ndry"},` +
					`{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,QUJD"}},{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,"}}]},` +
					`{"role":"tool","tool_call_id":"","content":""},{"role":"user","content":"and?"}]}`},
			{"redacted thinking and tool references say nothing; ctx and msg are user",
				`{"messages":[{"role":"ctx","content":"c"},{"role":"msg","content":[{"type":"tool_reference","tool_name":"f"},{"type":"text","text":"m"}]},` +
					`{"role":"assistant","content":[{"type":"redacted_thinking","data":"zz"},{"type":"text","text":"ok"}]}]}`,
				`{"messages":[{"role":"user","content":"c"},{"role":"user","content":"m"},{"role":"assistant","content":"ok"}]}`},
			{"leading system messages join the system prompt",
				`{"system":"S","messages":[{"role":"system","content":"A"},{"role":"system","content":[{"type":"text","text":"x-anthropic-billing-header: h"},{"type":"text","text":"B"}]},` +
					`{"role":"system","content":""},{"role":"user","content":"hi"}]}`,
				`{"messages":[{"role":"system","content":"S\n\nA\n\nB"},{"role":"user","content":"hi"}]}`},
			{"leading system messages are the system prompt when there is none",
				`{"messages":[{"role":"system","content":"A"},{"role":"user","content":"hi"}]}`,
				`{"messages":[{"role":"system","content":"A"},{"role":"user","content":"hi"}]}`},
			{"with a system prompt, inline system messages stay (empty ones dropped), moved out of a tool run",
				`{"system":"S","messages":[{"role":"user","content":"q"},{"role":"system","content":"n1"},{"role":"system","content":"x-anthropic-billing-header: h"},` +
					`{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"f","input":{}}]},{"role":"system","content":[{"type":"text","text":"n2"}]},` +
					`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"r"}]},{"role":"assistant","content":"ok"}]}`,
				`{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q"},{"role":"system","content":"n1"},` +
					`{"role":"assistant","tool_calls":[{"id":"t1","type":"function","function":{"name":"f","arguments":"{}"}}]},` +
					`{"role":"tool","tool_call_id":"t1","content":"r"},{"role":"system","content":"n2"},{"role":"assistant","content":"ok"}]}`},
			{"fold: after a user message into its text",
				`{"messages":[{"role":"user","content":[{"type":"text","text":"q"},{"type":"text","text":"r"}]},{"role":"system","content":"n"},{"role":"system","content":"o"},` +
					`{"role":"assistant","content":"a"},{"role":"user","content":[{"type":"image","source":{"type":"url","url":"u"}}]},{"role":"system","content":"p"}]}`,
				`{"messages":[{"role":"user","content":[{"type":"text","text":"q"},{"type":"text","text":"r\n\nn\n\no"}]},{"role":"assistant","content":"a"},` +
					`{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"p"}]}]}`},
			{"fold: after an assistant message into the next user message, or one of its own",
				`{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"system","content":"n"},{"role":"system","content":"o"},{"role":"user","content":"u"},` +
					`{"role":"assistant","content":"b"},{"role":"system","content":"p"},{"role":"assistant","content":"c"},{"role":"system","content":"e"},` +
					`{"role":"user","content":[{"type":"image","source":{"type":"url","url":"v"}}]}]}`,
				`{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"n\n\no\n\nu"},{"role":"assistant","content":"b"},` +
					`{"role":"user","content":"p"},{"role":"assistant","content":"c"},{"role":"user","content":[{"type":"text","text":"e"},{"type":"image_url","image_url":{"url":"v"}}]}]}`},
			{"fold: before a user message's first text",
				`{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"system","content":"n"},{"role":"user","content":[{"type":"text","text":"u"},{"type":"text","text":"w"}]}]}`,
				`{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":[{"type":"text","text":"n\n\nu"},{"type":"text","text":"w"}]}]}`},
			{"fold: at the end a user message of its own",
				`{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"system","content":"n"}]}`,
				`{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"n"}]}`},
			{"fold: into the last tool result, after the tool run",
				`{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"f","input":{}},{"type":"tool_use","id":"t2","name":"f","input":{}}]},` +
					`{"role":"system","content":"n"},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"r"},{"type":"tool_result","tool_use_id":"t2","content":[{"type":"text","text":"s"},{"type":"image","source":{"type":"url","url":"i"}}]}]},` +
					`{"role":"system","content":"o"}]}`,
				`{"messages":[{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"id":"t1","type":"function","function":{"name":"f","arguments":"{}"}},{"id":"t2","type":"function","function":{"name":"f","arguments":"{}"}}]},` +
					`{"role":"tool","tool_call_id":"t1","content":"r"},{"role":"tool","tool_call_id":"t2","content":"s\nn\n\no"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"i"}}]}]}`},
			{"fold: into a tool result's string or last text",
				`{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"r"}]},{"role":"system","content":"n"},` +
					`{"role":"assistant","content":"a"},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t2","content":[{"type":"text","text":"x"},{"type":"text","text":"y"}]}]},{"role":"system","content":"o"},` +
					`{"role":"assistant","content":"b"},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t3"}]},{"role":"system","content":"p"}]}`,
				`{"messages":[{"role":"tool","tool_call_id":"t1","content":"r\n\nn"},{"role":"assistant","content":"a"},{"role":"tool","tool_call_id":"t2","content":"x\ny\n\no"},` +
					`{"role":"assistant","content":"b"},{"role":"tool","tool_call_id":"t3","content":"p"}]}`},
			{"a tool result in an assistant message is text",
				`{"messages":[{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"tool_result","content":"b"}]}]}`,
				`{"messages":[{"role":"assistant","content":"a\nTool result: b"}]}`},
			{"thinking is reasoning; a message of nothing is dropped",
				`{"messages":[{"role":"user","content":[{"type":"text","text":""}]},{"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},{"type":"thinking","thinking":"m"},{"type":"text","text":"ok"}]}]}`,
				`{"messages":[{"role":"assistant","content":"ok","reasoning":"hmm"}]}`},
			{"ids, names and descriptions as sent, schemas compact, arguments quoted by json.Marshal (kvproxy's text)",
				`{"tools":[{"name":"f\u005f","input_schema":{ "properties": {} }},{"name":"g","description":"d\u0020","input_schema":{}}],"messages":[` +
					`{"role":"assistant","content":[{"type":"tool_use","id":"t\u005f1","name":"f\u005f","input":{"q":"<a&b>"}},{"type":"tool_use","id":"t2","name":"g","input":{}}]}]}`,
				`{"tools":[{"type":"function","function":{"name":"f\u005f","description":null,"parameters":{"properties":{},"type":"object"}}},` +
					`{"type":"function","function":{"name":"g","description":"d\u0020","parameters":{"type":"object"}}}],"messages":[` +
					`{"role":"assistant","tool_calls":[{"id":"t\u005f1","type":"function","function":{"name":"f\u005f","arguments":"{\"q\": \"\u003ca\u0026b\u003e\"}"}},` +
					`{"id":"t2","type":"function","function":{"name":"g","arguments":"{}"}}]}]}`},
			{"tools, none or empty",
				`{"tools":[],"messages":[{"role":"user","content":"hi"}]}`,
				`{"tools":[],"messages":[{"role":"user","content":"hi"}]}`},
		} {
			body := strings.Replace(c.messages, `{`, `{"model":"mock-model","max_tokens":4,`, 1)
			got, want := messagesTokens(t, e, body), chatTokens(t, e, c.chat)
			if !slices.Equal(got, want) {
				t.Errorf("%s, template %s: %d tokens, chat %d", c.name, filepath.Base(template), len(got), len(want))
			}
		}
		e.Close()
	}
}

// Tool inputs are written as Python's json.dumps writes them (the
// expected string is Python 3's).
func TestPythonRenderings(t *testing.T) {
	in := `{"city": "Zürich 😀", "n": [1, 2.50, 1e16, 1.5e-7, 0.0001, -0.0, 1E400, 12345678901234567890, -0, 123.456e3, 1e15], ` +
		`"q": "a\"b\\c\n\u007f<&>", "o": {}, "t": true, "z": null, "city2": "Bern", "city2": "Genf"}`
	want := `{"city": "Z\u00fcrich \ud83d\ude00", "n": [1, 2.5, 1e+16, 1.5e-07, 0.0001, -0.0, Infinity, 12345678901234567890, 0, 123456.0, 1000000000000000.0], ` +
		`"q": "a\"b\\c\n\u007f<&>", "o": {}, "t": true, "z": null, "city2": "Genf"}`
	if got := string(pyJSONDumps(nil, decodeOrdered(json.RawMessage(in)))); got != want {
		t.Errorf("json.dumps:\n got %s\nwant %s", got, want)
	}
}

// The stream is vLLM's event sequence, one content_block_delta per token,
// ending with data: [DONE].
func TestMessagesStream(t *testing.T) {
	_, url := startEngine(t, Config{})
	resp, err := http.Post(url+"/v1/messages", "application/json",
		strings.NewReader(`{"model":"mock-model","messages":[{"role":"user","content":"stream please"}],"max_tokens":6,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	body, ok := strings.CutSuffix(string(raw), "data: [DONE]\n\n")
	if !ok {
		t.Fatalf("no final [DONE]: %q", raw)
	}
	var names, deltas []string
	var events []string
	br := bufio.NewReader(strings.NewReader(body))
	for {
		ev, ok := readEvent(t, br)
		if !ok {
			break
		}
		if ev.data["type"] != ev.name {
			t.Fatalf("event %s: %s", ev.name, ev.raw)
		}
		names = append(names, ev.name)
		events = append(events, ev.raw)
		if ev.name == "content_block_delta" {
			deltas = append(deltas, ev.data["delta"].(map[string]any)["text"].(string))
		}
	}
	want := []string{"message_start", "content_block_start"}
	for range 6 {
		want = append(want, "content_block_delta")
	}
	want = append(want, "content_block_stop", "message_delta", "message_stop")
	if !slices.Equal(names, want) {
		t.Fatalf("events %q\nwant %q", names, want)
	}
	for i, re := range []string{
		`^\{"type":"message_start","message":\{"id":"chatcmpl-[^"]+","content":\[\],"model":"mock-model","stop_reason":null,"stop_sequence":null,` +
			`"usage":\{"input_tokens":(\d+),"output_tokens":0,"cache_read_input_tokens":0\}\}\}$`,
		`^\{"type":"content_block_start","content_block":\{"type":"text","text":""\},"index":0\}$`,
		`^\{"type":"content_block_delta","delta":\{"type":"text_delta","text":" \w+"\},"index":0\}$`,
	} {
		if !regexp.MustCompile(re).MatchString(events[i]) {
			t.Fatalf("event %d: %s", i, events[i])
		}
	}
	input := regexp.MustCompile(`"input_tokens":(\d+)`).FindStringSubmatch(events[0])[1]
	for i, w := range map[int]string{
		8:  `{"type":"content_block_stop","index":0}`,
		9:  `{"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":` + input + `,"output_tokens":6,"cache_read_input_tokens":0}}`,
		10: `{"type":"message_stop"}`,
	} {
		if events[i] != w {
			t.Fatalf("event %d: %s\nwant %s", i, events[i], w)
		}
	}
	for _, d := range deltas {
		if len(strings.Fields(d)) != 1 {
			t.Fatalf("delta %q is not one word", d)
		}
	}
}

// Errors are vLLM's Anthropic error object with the chat path's status
// and type; none reaches the model.
func TestMessagesBadRequests(t *testing.T) {
	e, url := startEngine(t, Config{})
	for _, c := range []struct {
		body string
		code int
	}{
		{`{"model":"mock-model","messages":`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":"x"}]}`, 400},                // no max_tokens
		{`{"model":"mock-model","messages":[{"role":"user","content":"x"}],"max_tokens":0}`, 400}, // not positive
		{`{"messages":[{"role":"user","content":"x"}],"max_tokens":1}`, 400},                      // no model
		{`{"model":"mock-model","messages":[],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"tool","content":"x"}],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"developer","content":"x"}],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":"x"}],"max_tokens":1,"system":[{"type":"document"}]}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":7}}]}],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":null}],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":[{"type":"document"}]}],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":[{"type":"text","text":7}]}],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":[{"type":"tool_use","input":[]}]}],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":[{"type":"tool_result","content":[1]}]}],"max_tokens":1}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":"x"}],"max_tokens":1,"tools":[{"name":"f"}]}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":"x"}],"max_tokens":1,"tool_choice":{"type":"some"}}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":"x"}],"max_tokens":1,"system":7}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":"x"}],"max_tokens":100000000}`, 400},
		{`{"model":"mock-model","messages":[{"role":"user","content":"x"}],"max_tokens":9223372036854775807}`, 400},
		{`{"model":"other","messages":[{"role":"user","content":"x"}],"max_tokens":1}`, 404},
	} {
		code, raw, m := postMessages(t, url+"/v1/messages", c.body)
		var shape map[string]json.RawMessage
		json.Unmarshal(raw, &shape)
		if code != c.code || len(shape) != 2 || m.Type != "error" || m.Error == nil || m.Error.Type == "" || m.Error.Message == "" {
			t.Fatalf("%s: status %d %s", c.body, code, raw)
		}
	}
	waitIdle(t, e)
	if st := e.Stats(); st.Requests != 0 {
		t.Fatalf("a bad request reached the model: %+v", st)
	}
}

// count_tokens counts the prompt a Messages request would run, in vLLM's
// shape, and runs nothing.
func TestMessagesCountTokens(t *testing.T) {
	e, url := startEngine(t, Config{})
	body := `{"model":"mock-model","system":"Be brief.","messages":[{"role":"user","content":"hello there"}],` +
		`"tools":[{"name":"f","input_schema":{"type":"object"}}]}`
	code, raw, m := postMessages(t, url+"/v1/messages/count_tokens", body)
	n := len(messagesTokens(t, e, strings.Replace(body, `{`, `{"max_tokens":1,`, 1)))
	want := `{"input_tokens":` + itoa(n) + `,"context_management":{"original_input_tokens":` + itoa(n) + `}}`
	if code != 200 || string(raw) != want || *m.InputTokens < 10 {
		t.Fatalf("status %d: %s, want %s", code, raw, want)
	}
	if code, raw, m := postMessages(t, url+"/v1/messages/count_tokens", `{"messages":[]}`); code != 400 || m.Type != "error" {
		t.Fatalf("bad count_tokens: %d %s", code, raw)
	}
	waitIdle(t, e)
	if st := e.Stats(); st.Requests != 0 {
		t.Fatalf("count_tokens ran a request: %+v", st)
	}
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// message_start waits for the first token, as vLLM sends it with its
// first chat chunk; the headers do not.
func TestMessagesStreamStartsWithFirstToken(t *testing.T) {
	e, url := startEngine(t, Config{})
	entered, release := holdFirstStep(e) // the prefill step
	resp, err := http.Post(url+"/v1/messages", "application/json",
		strings.NewReader(`{"model":"mock-model","messages":[{"role":"user","content":"wait"}],"max_tokens":2,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	<-entered
	first := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(resp.Body).ReadString('\n')
		first <- line
	}()
	select {
	case line := <-first:
		t.Fatalf("sent %q before the first token", line)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	if line := <-first; line != "event: message_start\n" {
		t.Fatalf("first line %q", line)
	}
}

// A client that goes away aborts its request, streamed or not.
func TestMessagesClientDisconnectAborts(t *testing.T) {
	checkDisconnectAborts(t, "/v1/messages", func(stream bool) any {
		return map[string]any{"model": "mock-model", "max_tokens": 50, "stream": stream,
			"messages": []map[string]any{{"role": "user", "content": strings.Repeat("word ", 1000)}}}
	})
}
