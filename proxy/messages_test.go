package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/tokenize"
)

func TestPythonJSON(t *testing.T) {
	raw := []byte(`{"a":1.0,"b":[true,null,false],"c":"é\n\"x\"\u0001","d":1e16,"e":0.00001,"f":-0,"g":"😀","h":{},"i":[],"j":123456789012345678901,"k":1E2,"l":0.5,"it's":"say \"hi\""}`)
	dumps := `{"a": 1.0, "b": [true, null, false], "c": "\u00e9\n\"x\"\u0001", "d": 1e+16, "e": 1e-05, "f": 0, "g": "\ud83d\ude00", "h": {}, "i": [], "j": 123456789012345678901, "k": 100.0, "l": 0.5, "it's": "say \"hi\""}`
	if got := string(appendPyDumps(nil, raw)); got != dumps {
		t.Errorf("json.dumps:\n%s\nwant\n%s", got, dumps)
	}
	for f, want := range map[float64]string{1e15: "1000000000000000.0", 1e-4: "0.0001", 123.456: "123.456", 1.5e300: "1.5e+300", 2.5e-7: "2.5e-07"} {
		if got := string(appendPyFloat(nil, f)); got != want {
			t.Errorf("repr(%g) = %s, want %s", f, got, want)
		}
	}
}

// An Anthropic request becomes the chat request vLLM makes of it: the
// billing header Claude Code puts in its system prompt dropped, thinking as
// reasoning, tool calls with json.dumps arguments, tool results as tool
// messages (by tool_use_id; blocks as their texts, images in a user message
// of their own) before their user message.
func TestParseAnthropic(t *testing.T) {
	req := &apiRequest{}
	pe := req.parseAnthropic([]byte(`{"model":"m","max_tokens":64,"stream":true,
		"system":[{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.197.5c8; cc_entrypoint=cli;"},{"type":"text","text":"You are Claude Code. ","cache_control":{"type":"ephemeral"}},{"type":"text","text":"Be brief."}],
		"messages":[
		{"role":"user","content":"Weather in Paris?"},
		{"role":"assistant","content":[{"type":"thinking","thinking":"use the tool","signature":"s"},{"type":"redacted_thinking","data":"opaque"},{"type":"text","text":"Checking."},
			{"type":"tool_use","id":"tu1","name":"get_weather","input":{"city":"Paris","units":"°C","n":1.0}}]},
		{"role":"user","content":[{"type":"tool_result","tool_use_id":"tu1","content":"18C"},{"type":"tool_result","tool_use_id":"tu2","content":[{"type":"text","text":"line 1"},{"type":"image","source":{"type":"url","url":"https://x/y.png"}},{"type":"text","text":"line 2"}]}]},
		{"role":"user","content":[{"type":"text","text":"Thanks."},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}},{"type":"text","text":"And tomorrow?"}]}],
		"tools":[{"name":"get_weather","description":"Weather","input_schema":{"properties":{"city":{"type":"string"}}}},{"name":"noop","input_schema":{}}]}`), false)
	if pe != nil {
		t.Fatal(pe)
	}
	stand := func(url string) string { return string(tokenize.AppendMediaStandIn(nil, []byte(url))) }
	want := []tokenize.Message{
		{Role: "system", Content: "You are Claude Code. Be brief."},
		{Role: "user", Content: "Weather in Paris?"},
		{Role: "assistant", Content: "Checking.", Reasoning: "use the tool",
			ToolCalls: `[{"id":"tu1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\", \"units\": \"\\u00b0C\", \"n\": 1.0}"}}]`},
		{Role: "tool", Content: "18C", ToolCallID: "tu1"},
		{Role: "tool", Content: "line 1\nline 2", ToolCallID: "tu2"},
		{Role: "user", Content: stand("https://x/y.png")},
		{Role: "user", Content: "Thanks.\n" + stand("data:image/png;base64,AAAA") + "\nAnd tomorrow?"},
	}
	if fmt.Sprint(req.messages) != fmt.Sprint(want) {
		t.Errorf("messages:\n%q\nwant\n%q", req.messages, want)
	}
	tools := `[{"type":"function","function":{"name":"get_weather","description":"Weather","parameters":{"properties":{"city":{"type":"string"}},"type":"object"}}},` +
		`{"type":"function","function":{"name":"noop","description":null,"parameters":{"type":"object"}}}]`
	if req.tools != tools {
		t.Errorf("tools %s\nwant  %s", req.tools, tools)
	}
	for body, param := range map[string]string{
		`{"messages":[{"role":"user","content":"x"}]}`:                "max_tokens",
		`{"max_tokens":0,"messages":[{"role":"user","content":"x"}]}`: "max_tokens",
		`{"max_tokens":5}`:               "messages",
		`{"max_tokens":5,"messages":[]}`: "messages",
		`{"max_tokens":5,"messages":[{"role":"robot","content":"x"}]}`:                       "messages[0].role",
		`{"max_tokens":5,"messages":[{"role":"user","content":[{"type":"document"}]}]}`:      "messages[0].content[0].type",
		`{"max_tokens":5,"messages":[{"role":"user","content":7}]}`:                          "messages[0].content",
		`{"max_tokens":5,"messages":[{"role":"user","content":"x"}],"tools":[{"name":"f"}]}`: "tools[0]",
		`{"max_tokens":5,"messages":[{"role":"user","content":"x"}],"system":5}`:             "system",
	} {
		req := &apiRequest{}
		if pe := req.parseAnthropic([]byte(body), false); pe == nil || pe.param != param {
			t.Errorf("%s: %v, want an error on %s", body, pe, param)
		}
	}
	// A missing max_tokens in Anthropic's words (its SDK users know them).
	for _, body := range []string{`{"messages":[{"role":"user","content":"x"}]}`, `{"max_tokens":null,"messages":[{"role":"user","content":"x"}]}`} {
		req := &apiRequest{}
		if pe := req.parseAnthropic([]byte(body), false); pe == nil || pe.msg != "max_tokens: Field required" {
			t.Errorf("%s: %v", body, pe)
		}
	}
	// As vLLM: an empty system list is none, an image without a source is
	// skipped, an empty thinking block keeps its message.
	for body, want := range map[string]string{
		`{"max_tokens":5,"system":[],"messages":[{"role":"user","content":"x"}]}`:                                                        `[{user x    }]`,
		`{"max_tokens":5,"system":[{"type":"text","text":""}],"messages":[{"role":"user","content":"x"}]}`:                               `[{user x    }]`,
		`{"max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{}},{"type":"text","text":"x"}]}]}`:              `[{user x    }]`,
		`{"max_tokens":5,"messages":[{"role":"user","content":"x"},{"role":"assistant","content":[{"type":"thinking","thinking":""}]}]}`: `[{user x    } {assistant     }]`,
		`{"max_tokens":5,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"}]}]}`:              `[{tool ok  t  }]`,
		// Each tool result's images follow it; an empty assistant turn stays (vLLM drops only a user's).
		`{"max_tokens":5,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":[{"type":"text","text":"one"},{"type":"image","source":{"type":"url","url":"u1"}}]},{"type":"tool_result","tool_use_id":"b","content":[{"type":"image","source":{"type":"url","url":"u2"}}]}]},{"role":"assistant","content":[{"type":"redacted_thinking","data":"x"}]}]}`: "[{tool one  a  } {user " + string(tokenize.AppendMediaStandIn(nil, []byte("u1"))) + "    } {tool   b  } {user " + string(tokenize.AppendMediaStandIn(nil, []byte("u2"))) + "    } {assistant     }]",
	} {
		req := &apiRequest{}
		if pe := req.parseAnthropic([]byte(body), false); pe != nil || fmt.Sprint(req.messages) != want {
			t.Errorf("%s: %v %q, want %s", body, pe, req.messages, want)
		}
	}
	if pe := (&apiRequest{}).parseAnthropic([]byte(`{"messages":[{"role":"user","content":"x"}]}`), true); pe != nil {
		t.Errorf("count_tokens needs no max_tokens: %v", pe)
	}
}

// anthEngine answers the Messages API as vLLM does.
type anthEngine struct {
	addr    string
	prefill time.Duration // before message_start (sent with the first token)
	dropMid bool
	mu      sync.Mutex
	bodies  []map[string]any
}

func startAnthEngine(t *testing.T) *anthEngine {
	t.Helper()
	e := &anthEngine{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e.addr = ln.Addr().String()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/messages", func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		json.NewDecoder(r.Body).Decode(&body)
		e.mu.Lock()
		e.bodies = append(e.bodies, body)
		e.mu.Unlock()
		usage := `{"input_tokens":14,"output_tokens":3,"cache_read_input_tokens":16}` // Anthropic's meaning: 30 prompt tokens
		if stream, _ := body["stream"].(bool); !stream {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"chatcmpl-1","type":"message","role":"assistant","content":[{"type":"text","text":"a b c"}],"model":%q,"stop_reason":"end_turn","usage":%s}`, body["model"], usage)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		send := func(typ, data string) {
			fmt.Fprintf(w, "event: %s\ndata: %s\n\n", typ, data)
			w.(http.Flusher).Flush()
		}
		time.Sleep(e.prefill)
		send("message_start", `{"type":"message_start","message":{"id":"chatcmpl-1","type":"message","role":"assistant","content":[],"model":"m","usage":{"input_tokens":14,"output_tokens":0,"cache_read_input_tokens":16}}}`)
		send("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`)
		for i, tok := range []string{"a", " b", " c"} {
			send("content_block_delta", fmt.Sprintf(`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":%q}}`, tok))
			if e.dropMid && i == 0 {
				conn, _, _ := w.(http.Hijacker).Hijack()
				conn.Close()
				return
			}
		}
		send("content_block_stop", `{"type":"content_block_stop","index":0}`)
		send("message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":`+usage+`}`)
		send("message_stop", `{"type":"message_stop"}`)
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return e
}

func startAnthProxy(t *testing.T, e *anthEngine, extra string) *testProxy {
	t.Helper()
	return serveYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+e.addr+"', model: m, served_model: engine-m}]\n"+extra, true)
}

func postHeaders(t *testing.T, url, body string, headers ...string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// A message routes as the chat request with the same conversation, and
// count_tokens counts those tokens.
func TestMessagesRouteAsTheirChatEquivalent(t *testing.T) {
	e := startAnthEngine(t)
	p := startAnthProxy(t, e, "")
	dry := `"nvext":{"annotations":["query_instance_id"]}`
	conv := `"messages":[{"role":"user","content":"Hello there"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"f","input":{"x":1}}]},
		{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"ok"},{"type":"text","text":"go on"}]}]`
	_, mb := post(t, p.url+"/v1/messages", `{"model":"m","max_tokens":5,"system":"Be brief.",`+conv+`,`+dry+`}`)
	_, cb := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello there"},
		{"role":"assistant","tool_calls":[{"id":"t1","type":"function","function":{"name":"f","arguments":"{\"x\": 1}"}}]},{"role":"tool","content":"ok","tool_call_id":""},{"role":"user","content":"go on"}],`+dry+`}`)
	m, c := decodeJSON(t, mb), decodeJSON(t, cb)
	ids, _ := m["token_ids"].([]any)
	if fmt.Sprint(m["token_ids"]) != fmt.Sprint(c["token_ids"]) || len(ids) < 10 {
		t.Fatalf("messages tokens %v\nchat tokens     %v", m["token_ids"], c["token_ids"])
	}
	resp, b := post(t, p.url+"/v1/messages/count_tokens", `{"model":"m","system":"Be brief.",`+conv+`}`)
	if want := fmt.Sprintf(`{"input_tokens":%d}`, len(ids)); resp.StatusCode != 200 || string(b) != want {
		t.Fatalf("count_tokens: %d %s, want %s", resp.StatusCode, b, want)
	}
	if len(e.bodies) != 0 {
		t.Fatal("a dry run or a count reached the engine")
	}
}

// Messages through the proxy: the engine's answer as it came, usage read
// from it, the prefill ended by the first content block delta, errors in
// Anthropic's shape, the key taken from x-api-key.
func TestMessagesThroughTheProxy(t *testing.T) {
	e := startAnthEngine(t)
	e.prefill = 300 * time.Millisecond
	p := startAnthProxy(t, e, "auth: {keys: [{key: sk-ant-test-key-01, tenant: a}]}\nlimits: {max_request_body_bytes: 4096}\n")
	// The SDK sends an auth token beside the key when it has both.
	key := []string{"x-api-key", "sk-ant-test-key-01", "anthropic-version", "2023-06-01", "Authorization", "Bearer not-a-key"}
	resp, b := postHeaders(t, p.url+"/v1/messages", `{"model":"m","max_tokens":"5","messages":[{"role":"user","content":"Hi"}]}`, key...)
	if v := decodeJSON(t, b); resp.StatusCode != 200 || v["type"] != "message" || e.bodies[0]["model"] != "engine-m" || resp.Header.Get("request-id") == "" {
		t.Fatalf("%d %s (engine got %v, request-id %q)", resp.StatusCode, b, e.bodies[0], resp.Header.Get("request-id"))
	}
	resp, b = postHeaders(t, p.url+"/v1/messages", `{"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`, key...)
	if resp.StatusCode != 200 || !strings.HasSuffix(string(b), "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\ndata: [DONE]\n\n") || strings.Count(string(b), "content_block_delta") != 6 {
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
	var lines []map[string]any
	for _, l := range strings.Split(p.logs.String(), "\n") {
		if strings.Contains(l, `"path":"/v1/messages"`) {
			var line map[string]any
			json.Unmarshal([]byte(l), &line)
			lines = append(lines, line)
		}
	}
	if len(lines) != 2 {
		t.Fatalf("access lines %v", lines)
	}
	for _, line := range lines {
		if line["status"] != 200.0 || line["prompt_tokens"] != 30.0 || line["cached_tokens"] != 16.0 || line["output_tokens"] != 3.0 || line["error"] != nil {
			t.Fatalf("access line %v", line)
		}
	}
	if ttft, _ := time.ParseDuration(fmt.Sprint(lines[1]["ttft"]) + "ms"); ttft < e.prefill {
		t.Fatalf("ttft %v, the engine's prefill %v", lines[1]["ttft"], e.prefill)
	}

	for _, c := range []struct {
		body   string
		key    []string
		status int
		typ    string
	}{
		{`{"model":"m","messages":[{"role":"user","content":"Hi"}]}`, key, 400, "invalid_request_error"},
		{`{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}`, nil, 401, "authentication_error"},
		{`{"model":"nope","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}`, key, 404, "not_found_error"},
		{`{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"` + strings.Repeat("x", 5000) + `"}]}`, key, 413, "request_too_large"},
	} {
		resp, b := postHeaders(t, p.url+"/v1/messages", c.body, c.key...)
		var v struct {
			Type  string `json:"type"`
			Error struct{ Type, Message string }
		}
		if json.Unmarshal(b, &v); resp.StatusCode != c.status || v.Type != "error" || v.Error.Type != c.typ || v.Error.Message == "" {
			t.Errorf("%s: %d %s, want %d %s in Anthropic's shape", c.body, resp.StatusCode, b, c.status, c.typ)
		}
	}
}

// An engine failing mid-message: the client gets Anthropic's error event.
func TestMessagesStreamEngineFailure(t *testing.T) {
	e := startAnthEngine(t)
	e.dropMid = true
	p := startAnthProxy(t, e, "")
	resp, b := post(t, p.url+"/v1/messages", `{"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`)
	if resp.StatusCode != 200 || !strings.HasSuffix(string(b), "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"the backend serving this request failed mid-stream\"}}\n\n") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// Current vLLM salts a message's cache with its cache_salt, as chat: a
// tenant's messages are hashed in its own namespace and its salt sent.
func TestMessagesAreSalted(t *testing.T) {
	e := startAnthEngine(t)
	p := startAnthProxy(t, e, "auth: {keys: [{key: key-salted-0001, tenant: s}, {key: key-plain-00001, tenant: plain}], cache_salt_secret: s3cret}\n")
	body := `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"` + strings.Repeat("hello ", 40) + `"}]`
	dry := body + `,"nvext":{"annotations":["query_instance_id"]}}`
	_, salted := postHeaders(t, p.url+"/v1/messages", dry, "x-api-key", "key-salted-0001")
	_, plain := postHeaders(t, p.url+"/v1/messages", dry, "x-api-key", "key-plain-00001")
	s, pl := decodeJSON(t, salted), decodeJSON(t, plain)
	if fmt.Sprint(s["block_hashes"]) == fmt.Sprint(pl["block_hashes"]) || len(s["block_hashes"].([]any)) == 0 {
		t.Fatalf("salted %v\nplain  %v", s["block_hashes"], pl["block_hashes"])
	}
	if resp, b := postHeaders(t, p.url+"/v1/messages", body+"}", "x-api-key", "key-salted-0001"); resp.StatusCode != 200 || e.bodies[0]["cache_salt"] == nil {
		t.Fatalf("%d %s, the engine got %v", resp.StatusCode, b, e.bodies[0])
	}
}

// Errors answered before the endpoint takes the request are Anthropic's
// too on these paths.
func TestMessagesPathErrorsAreAnthropics(t *testing.T) {
	e := startAnthEngine(t)
	p := startAnthProxy(t, e, "cors: {allowed_origins: [https://app.example.com]}\n")
	for _, c := range []struct {
		method, path string
		status       int
	}{{"GET", "/v1/messages", 405}, {"GET", "/v1/messages/count_tokens", 405}, {"POST", "/v1/messages/batches", 404}, {"OPTIONS", "/v1/messages", 400}} {
		req, _ := http.NewRequest(c.method, p.url+c.path, nil)
		if c.method == "OPTIONS" { // a preflight from a page kvproxy does not serve
			req.Header.Set("Origin", "https://evil.example.com")
			req.Header.Set("Access-Control-Request-Method", "POST")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var v struct {
			Type  string `json:"type"`
			Error struct{ Type, Message string }
		}
		json.NewDecoder(resp.Body).Decode(&v)
		resp.Body.Close()
		if resp.StatusCode != c.status || v.Type != "error" || v.Error.Message == "" {
			t.Errorf("%s %s: %d %+v", c.method, c.path, resp.StatusCode, v)
		}
	}
}

// Inline system messages (Claude Code sends one on most turns) are placed
// as vLLM places them: with a system prompt, where they are but out of a
// tool call's run; without one, folded into the user turns around them.
func TestAnthropicInlineSystem(t *testing.T) {
	calls := `[{"id":"t1","type":"function","function":{"name":"f","arguments":"{}"}}]`
	for _, c := range []struct {
		name, body string
		want       []tokenize.Message
	}{{"kept in place", `{"system":"S","messages":[{"role":"user","content":"q1"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"f","input":{}}]},
		{"role":"system","content":"note1"},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"r1"}]},{"role":"system","content":[{"type":"text","text":"note2"}]}]}`,
		[]tokenize.Message{{Role: "system", Content: "S"}, {Role: "user", Content: "q1"}, {Role: "assistant", ToolCalls: calls}, {Role: "tool", Content: "r1", ToolCallID: "t1"},
			{Role: "system", Content: "note1"}, {Role: "system", Content: "note2"}}},
		{"leading ones join the system prompt", `{"system":"S","messages":[{"role":"system","content":"L"},{"role":"ctx","content":"q"}]}`,
			[]tokenize.Message{{Role: "system", Content: "S\n\nL"}, {Role: "user", Content: "q"}}},
		{"folded", `{"messages":[{"role":"user","content":"q1"},{"role":"system","content":"n1"},{"role":"assistant","content":"a1"},{"role":"system","content":"n2"},
		{"role":"user","content":[{"type":"text","text":"q2"}]},{"role":"assistant","content":"a2"},{"role":"system","content":"n3"}]}`,
			[]tokenize.Message{{Role: "user", Content: "q1\n\nn1"}, {Role: "assistant", Content: "a1"}, {Role: "user", Content: "n2\n\nq2"}, {Role: "assistant", Content: "a2"}, {Role: "user", Content: "n3"}}},
		{"folded into a tool result", `{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"f","input":{}}]},
		{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"r"}]},{"role":"system","content":"n"}]}`,
			[]tokenize.Message{{Role: "user", Content: "q"}, {Role: "assistant", ToolCalls: calls}, {Role: "tool", Content: "r\n\nn", ToolCallID: "t1"}}},
	} {
		req := &apiRequest{}
		if pe := req.parseAnthropic([]byte(c.body), true); pe != nil {
			t.Fatalf("%s: %v", c.name, pe)
		}
		if fmt.Sprint(req.messages) != fmt.Sprint(c.want) {
			t.Errorf("%s:\n%q\nwant\n%q", c.name, req.messages, c.want)
		}
	}
}

// An engine without the Messages API answers 404: the request goes to
// another, and the engine, still good for chat, is not taken out for it.
func TestMessagesEngineWithoutTheAPI(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux() // chat only: /v1/messages is the mux's 404
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	p := serveYAML(t, "models: [{name: m}]\nbackends: [{id: old, url: 'http://"+ln.Addr().String()+"', model: m}]\n", true)
	for range 4 {
		if resp, b := post(t, p.url+"/v1/messages", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 502 || !strings.Contains(string(b), "does not serve /v1/messages") {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 {
		t.Fatalf("chat after Messages requests it cannot serve: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// count_tokens is the engine's count or none: with tokenizer: engine and
// the engine unable to tokenize, a 503, never kvproxy's guess.
func TestCountTokensIsNeverAGuess(t *testing.T) {
	e := startAnthEngine(t) // it has no /tokenize
	p := serveYAML(t, "models: [{name: m, tokenizer: engine}]\nbackends: [{id: e0, url: 'http://"+e.addr+"', model: m}]\n", true)
	resp, b := post(t, p.url+"/v1/messages/count_tokens", `{"model":"m","messages":[{"role":"user","content":"hello there"}]}`)
	var v struct {
		Type  string `json:"type"`
		Error struct{ Type, Message string }
	}
	if json.Unmarshal(b, &v); resp.StatusCode != 503 || v.Type != "error" || v.Error.Type != "overloaded_error" || !strings.Contains(v.Error.Message, "could not count") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}

func TestAnthropicErrorTypes(t *testing.T) {
	for status, want := range map[int]string{400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
		413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "timeout_error"} {
		if got := anthropicErrorType(status); got != want {
			t.Errorf("%d: %s, want %s", status, got, want)
		}
	}
	// A stream cut by a silent engine says so in its error event.
	if ev := string(anthropicFailEvent(nil, 504, "silent")); ev != "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"timeout_error\",\"message\":\"silent\"}}\n\n" {
		t.Errorf("%q", ev)
	}
}

// A prompt over the context gets Anthropic's "prompt is too long: N tokens
// > M maximum", the words its clients recognize (Claude Code compacts on
// them; the SDK trial found kvproxy's own words): from kvproxy's
// max_prompt_tokens check, and prefixed to an engine's refusal.
func TestMessagesPromptTooLongInAnthropicsWords(t *testing.T) {
	e := startAnthEngine(t)
	p := startAnthProxy(t, e, "limits: {max_prompt_tokens: 100}\n")
	long := `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"` + strings.Repeat("word ", 300) + `"}]}`
	resp, b := postHeaders(t, p.url+"/v1/messages", long)
	var v struct {
		Type  string `json:"type"`
		Error struct{ Type, Message string }
	}
	json.Unmarshal(b, &v)
	if resp.StatusCode != 400 || v.Type != "error" || v.Error.Type != "invalid_request_error" ||
		!regexp.MustCompile(`^prompt is too long: (at least )?\d+ tokens > 100 maximum$`).MatchString(v.Error.Message) {
		t.Fatalf("kvproxy's own refusal: %d %s", resp.StatusCode, b)
	}

	f := startFake(t, "e0", func(f *fakeEngine) {
		f.status = 400
		f.errBody = `{"error":{"message":"This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens.","type":"BadRequestError","param":null,"code":400}}`
	})
	p2 := startProxy(t, "kv", f)
	resp, b = postHeaders(t, p2.url+"/v1/messages", `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`)
	json.Unmarshal(b, &v)
	if resp.StatusCode != 400 || v.Error.Message != "prompt is too long: This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens." {
		t.Fatalf("an engine's refusal: %d %s", resp.StatusCode, b)
	}
}
