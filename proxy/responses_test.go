package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/tokenize"
)

// respEngine is an engine that answers the Responses API as vLLM does with
// its store on: responses kept in memory, previous_response_id looked up
// there (404 when it is not), SSE events with event: lines and no [DONE].
type respEngine struct {
	id, addr string
	prefill  time.Duration // between response.in_progress and the first delta
	dropMid  bool          // close the connection after the first delta
	errorMid bool          // end with the Responses API's error event after the first delta

	stop func() // closes its listener and connections: the engine is down

	mu     sync.Mutex
	n      int
	store  map[string]map[string]any
	bodies []map[string]any
	paths  []string
}

func startRespEngine(t *testing.T, id string) *respEngine {
	t.Helper()
	e := &respEngine{id: id, store: map[string]map[string]any{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e.addr = ln.Addr().String()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/responses", e.create)
	mux.HandleFunc("/v1/responses/{id}", e.byID)
	mux.HandleFunc("POST /v1/responses/{id}/cancel", e.byID)
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	e.stop = func() { srv.Close() }
	t.Cleanup(e.stop)
	return e
}

func (e *respEngine) notFound(w http.ResponseWriter, id, param string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(404)
	msg, _ := json.Marshal("Response with id '" + id + "' not found.")
	fmt.Fprintf(w, `{"error":{"message":%s,"type":"invalid_request_error","param":%q,"code":404}}`, msg, param)
}

func (e *respEngine) create(w http.ResponseWriter, r *http.Request) {
	var body map[string]any
	json.NewDecoder(r.Body).Decode(&body)
	e.mu.Lock()
	e.bodies = append(e.bodies, body)
	e.paths = append(e.paths, r.URL.Path)
	e.n++
	id := fmt.Sprintf("resp_%s%05d", e.id, e.n)
	if rid, _ := body["request_id"].(string); rid != "" {
		id = rid // vLLM's ResponsesResponse.from_request: the request's id is the response's
	}
	prev, _ := body["previous_response_id"].(string)
	_, known := e.store[prev]
	e.mu.Unlock()
	if prev != "" && !known {
		e.notFound(w, prev, "previous_response_id")
		return
	}
	obj := map[string]any{"id": id, "object": "response", "model": body["model"], "status": "in_progress", "output": []any{}, "usage": nil, "metadata": body["metadata"]}
	inputTokens := 21
	if prev != "" {
		obj["previous_response_id"] = prev
		inputTokens = 5000 // the stored conversation comes first
	}
	done := func() map[string]any {
		obj["status"] = "completed"
		obj["output"] = []any{map[string]any{"id": "msg_1", "type": "message", "role": "assistant", "content": []any{map[string]any{"type": "output_text", "text": "a b c", "annotations": []any{}}}}}
		obj["usage"] = map[string]any{"input_tokens": inputTokens, "input_tokens_details": map[string]any{"cached_tokens": 16}, "output_tokens": 3, "total_tokens": inputTokens + 3}
		if store, ok := body["store"].(bool); !ok || store {
			e.mu.Lock()
			e.store[id] = obj
			e.mu.Unlock()
		}
		return obj
	}
	if stream, _ := body["stream"].(bool); !stream {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(done())
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	seq := 0
	send := func(typ string, fields map[string]any) {
		fields["type"], fields["sequence_number"] = typ, seq
		seq++
		b, _ := json.Marshal(fields)
		fmt.Fprintf(w, "event: %s\ndata: %s\n\n", typ, b)
		w.(http.Flusher).Flush()
	}
	send("response.created", map[string]any{"response": obj})
	send("response.in_progress", map[string]any{"response": obj})
	time.Sleep(e.prefill)
	for i, tok := range []string{"a", " b", " c"} {
		send("response.output_text.delta", map[string]any{"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": tok})
		if e.dropMid && i == 0 {
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		if e.errorMid && i == 0 {
			send("error", map[string]any{"code": "server_error", "message": "boom", "param": nil})
			return
		}
	}
	send("response.completed", map[string]any{"response": done()})
}

func (e *respEngine) byID(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	e.mu.Lock()
	e.paths = append(e.paths, r.Method+" "+r.URL.Path)
	obj, ok := e.store[id]
	if ok && r.Method == "DELETE" {
		delete(e.store, id)
	}
	e.mu.Unlock()
	if !ok {
		e.notFound(w, id, "response_id")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if r.Method == "DELETE" {
		fmt.Fprintf(w, `{"id":%q,"object":"response.deleted","deleted":true}`, id)
		return
	}
	json.NewEncoder(w).Encode(obj)
}

func (e *respEngine) last() (string, map[string]any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.paths[len(e.paths)-1], e.bodies[len(e.bodies)-1]
}

func (e *respEngine) created() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.bodies)
}

func startRespProxy(t *testing.T, engines ...*respEngine) *testProxy {
	t.Helper()
	var b strings.Builder
	b.WriteString("models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\nrouter: {policy: round_robin}\nbackends:\n")
	for _, e := range engines {
		fmt.Fprintf(&b, "  - {id: %s, url: 'http://%s', model: m, served_model: engine-m}\n", e.id, e.addr)
	}
	return serveYAML(t, b.String(), true)
}

// doRequest sends a request without a body and reads the answer whole.
func doRequest(t *testing.T, method, url string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func decodeJSON(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	return v
}

// The Responses API becomes the chat request vLLM makes of it.
func TestParseResponses(t *testing.T) {
	req := &apiRequest{}
	// An agent's turn as vLLM's construct_chat_messages_with_tool_call
	// makes it: reasoning and the calls that follow it are one assistant
	// message, and so are text and the call after it; a second reasoning
	// starts a message.
	pe := req.parseResponses([]byte(`{"model":"m","instructions":"Be brief.","input":[
		{"role":"user","content":[{"type":"input_text","text":"Weather in Paris?"}]},
		{"type":"reasoning","summary":[{"type":"summary_text","text":"from the summary"}],"content":[{"type":"reasoning_text","text":"use the tool"},{"type":"reasoning_text","text":"not this"}]},
		{"type":"function_call","call_id":"c1","name":"get_weather","arguments":"{\"city\":\"Paris\"}"},
		{"type":"function_call","call_id":"c2","name":"get_time","arguments":"{}"},
		{"type":"function_call_output","call_id":"c1","output":"18C"},
		{"type":"function_call_output","call_id":"c2","output":"noon"},
		{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Mild.","annotations":[]},{"type":"output_text","text":"not this"}],"id":"msg_9","status":"completed"},
		{"type":"function_call","call_id":"c3","name":"get_weather","arguments":"{}"},
		{"type":"reasoning","summary":[{"type":"summary_text","text":"first"}]},
		{"type":"reasoning","summary":[{"type":"summary_text","text":"second"}]},
		{"role":"developer","content":"Stay on topic."}],
		"tools":[{"type":"function","name":"get_weather","parameters":{ "type" : "object" },"description":"Weather"},{"type":"web_search"},{"type":"function","name":"get_time","strict":true}],
		"tool_choice":"none","previous_response_id":null,"stream":true}`))
	if pe != nil {
		t.Fatal(pe)
	}
	want := []tokenize.Message{
		{Role: "system", Content: "Be brief."},
		{Role: "user", Content: "Weather in Paris?"},
		{Role: "assistant", Reasoning: "use the tool", ToolCalls: `[{"id":"c1","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"},"type":"function"},{"id":"c2","function":{"name":"get_time","arguments":"{}"},"type":"function"}]`},
		{Role: "tool", Content: "18C", ToolCallID: "c1"},
		{Role: "tool", Content: "noon", ToolCallID: "c2"},
		{Role: "assistant", Content: "Mild.", ToolCalls: `[{"id":"c3","function":{"name":"get_weather","arguments":"{}"},"type":"function"}]`, Reasoning: "first"},
		{Role: "assistant", Reasoning: "second"},
		{Role: "developer", Content: "Stay on topic."},
	}
	if fmt.Sprint(req.messages) != fmt.Sprint(want) {
		t.Errorf("messages:\n%q\nwant\n%q", req.messages, want)
	}
	// Function tools only, parameters compact; tool_choice "none" keeps them.
	if tools := `[{"type":"function","function":{"name":"get_weather","description":"Weather","parameters":{"type":"object"},"strict":null}},` +
		`{"type":"function","function":{"name":"get_time","description":null,"parameters":null,"strict":true}}]`; req.tools != tools {
		t.Errorf("tools %s\nwant  %s", req.tools, tools)
	}
	if !req.stream || !req.converted || req.model != "m" {
		t.Errorf("stream %v responses %v model %q", req.stream, req.converted, req.model)
	}

	for body, want := range map[string]string{
		`{"input":"hi"}`: `[{user hi    }] tools `,
		`{"input":"hi","tools":[{"type":"web_search"}]}`: `[{user hi    }] tools []`,
		`{"input":"hi","instructions":""}`:               `[{user hi    }] tools `,
	} {
		req := &apiRequest{}
		if pe := req.parseResponses([]byte(body)); pe != nil {
			t.Fatalf("%s: %v", body, pe)
		}
		if got := fmt.Sprintf("%v tools %s", req.messages, req.tools); got != want {
			t.Errorf("%s: %q, want %q", body, got, want)
		}
	}

	for body, param := range map[string]string{
		`{"model":"m"}`:                     "input",
		`{"input":7}`:                       "input",
		`{"input":[]}`:                      "input",
		`{"input":[3]}`:                     "input[0]",
		`{"input":[{"content":"no role"}]}`: "input[0].role",
		`{"input":[{"type":"item_reference","id":"x"}]}`:                               "input[0].type",
		`{"input":[{"id":"msg_1"}]}`:                                                   "input[0].type", // a reference without its type (the Go SDK's)
		`{"input":[{"type":"function_call","call_id":1,"name":"f","arguments":"{}"}]}`: "input[0].call_id",
		`{"input":[{"role":"user","content":{}}]}`:                                     "input[0].content",
		`{"input":"x","instructions":5}`:                                               "instructions",
		`{"input":"x","previous_response_id":""}`:                                      "previous_response_id",
		`{"input":"x","tools":[{"type":"function"}]}`:                                  "tools[0].name",
	} {
		req := &apiRequest{}
		if pe := req.parseResponses([]byte(body)); pe == nil || pe.param != param {
			t.Errorf("%s: %v, want an error on %s", body, pe, param)
		}
	}
}

func TestResponseIDTags(t *testing.T) {
	sign := func(key, backend, tenant, orig string) string {
		return respSigner{macs: newRespMACs([]byte(key)), backend: backend, tenant: tenant}.tag([]byte(orig))
	}
	tag := sign("k", "backend-a", "team-a", "resp_1")
	for _, other := range []string{sign("k", "backend-b", "team-a", "resp_1"), sign("k", "backend-a", "team-b", "resp_1"),
		sign("k", "backend-a", "team-a", "resp_2"), sign("j", "backend-a", "team-a", "resp_1")} {
		if other == tag || other[:8] != tag[:8] && other[:8] != hex8("backend-b") {
			t.Fatalf("tag %q, and %q for other inputs", tag, other)
		}
	}
	if len(tag) != respTagLen || tag != sign("k", "backend-a", "team-a", "resp_1") || tag[:8] != hex8("backend-a") {
		t.Fatalf("tag %q", tag)
	}
	id := string(appendTaggedID(nil, tag, []byte("resp_0123abc")))
	gotTag, orig, ok := splitTaggedID(id)
	if !ok || gotTag != tag || orig != "resp_0123abc" {
		t.Fatalf("%s split into %q %q %v", id, gotTag, orig, ok)
	}
	const hex24 = "012345670123456701234567"
	for _, id := range []string{"resp_0123abc", "resp_kvp" + hex24 + "_", "resp_kvpzz" + hex24[2:] + "_x", "resp_kvp" + hex24 + "-x",
		"resp_kvp" + hex24 + "_..", "resp_kvp" + hex24 + "_x%3Fa=b", "resp_kvp" + hex24 + "_a/b", "resp_kvp0123456701234567_x"} {
		if _, _, ok := splitTaggedID(id); ok {
			t.Errorf("%s: taken for a kvproxy id", id)
		}
	}
}

// testTag is the tag p gives the engine id orig of backend for tenant.
func testTag(p *testProxy, backend, tenant, orig string) string {
	return respSigner{macs: p.s.st.Load().respMACs, backend: backend, tenant: tenant}.tag([]byte(orig))
}

// A response routes as the chat request with the same conversation: the
// same tokens, so the same cached prefix.
func TestResponsesRouteAsTheirChatEquivalent(t *testing.T) {
	e := startRespEngine(t, "e0")
	p := startRespProxy(t, e)
	dry := `"nvext":{"annotations":["query_instance_id"]}`
	_, rb := post(t, p.url+"/v1/responses", `{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"Hello there"},
		{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c1","output":"ok"}],`+dry+`}`)
	_, cb := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello there"},
		{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{}"},"type":"function"}]},{"role":"tool","content":"ok","tool_call_id":"c1"}],"tools":[],`+dry+`}`)
	r, c := decodeJSON(t, rb), decodeJSON(t, cb)
	if fmt.Sprint(r["token_ids"]) != fmt.Sprint(c["token_ids"]) || len(r["token_ids"].([]any)) < 10 {
		t.Fatalf("responses tokens %v\nchat tokens      %v", r["token_ids"], c["token_ids"])
	}
	if e.created() != 0 {
		t.Fatal("a dry run reached the engine")
	}
}

// Response ids name the backend that made them: a request that continues
// one goes there, with the engine's own id, and so do retrievals.
func TestResponsesContinueOnTheirBackend(t *testing.T) {
	e0, e1 := startRespEngine(t, "e0"), startRespEngine(t, "e1")
	p := startRespProxy(t, e0, e1)
	resp, b := post(t, p.url+"/v1/responses", `{"model":"m","input":"Hi"}`)
	first := decodeJSON(t, b)
	id, _ := first["id"].(string)
	worker := resp.Header.Get(WorkerHeader)
	engines := map[string]*respEngine{"e0": e0, "e1": e1}
	owner := engines[worker]
	if tag, orig, _ := splitTaggedID(id); resp.StatusCode != 200 || owner == nil || !strings.HasPrefix(orig, "resp_"+worker) || tag != testTag(p, worker, "", orig) {
		t.Fatalf("%d %s (worker %q)", resp.StatusCode, b, worker)
	}
	if path, body := owner.last(); path != "/v1/responses" || body["model"] != "engine-m" {
		t.Fatalf("engine got %s %v", path, body)
	}
	_, orig, _ := splitTaggedID(id)
	// round_robin alone would alternate: each follow-up goes to the owner.
	for i := range 4 {
		resp, b := post(t, p.url+"/v1/responses", fmt.Sprintf(`{"model":"m","input":"More %d","previous_response_id":%q}`, i, id))
		next := decodeJSON(t, b)
		if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != worker || next["previous_response_id"] != id {
			t.Fatalf("follow-up %d: %d %s via %s", i, resp.StatusCode, b, resp.Header.Get(WorkerHeader))
		}
		if _, body := owner.last(); body["previous_response_id"] != orig {
			t.Fatalf("the engine got previous_response_id %v, want %s", body["previous_response_id"], orig)
		}
	}
	if strings.Contains(string(b), `"`+orig+`"`) {
		t.Fatalf("the engine's own id reached the client: %s", b)
	}

	get := func(method, path string) (int, map[string]any) {
		req, _ := http.NewRequest(method, p.url+path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var v map[string]any
		json.NewDecoder(resp.Body).Decode(&v)
		return resp.StatusCode, v
	}
	if code, v := get("GET", "/v1/responses/"+id); code != 200 || v["id"] != id || v["status"] != "completed" {
		t.Fatalf("GET: %d %v", code, v)
	}
	if code, v := get("POST", "/v1/responses/"+id+"/cancel"); code != 200 || v["id"] != id {
		t.Fatalf("cancel: %d %v", code, v)
	}
	if code, v := get("DELETE", "/v1/responses/"+id); code != 200 || v["id"] != id || v["deleted"] != true {
		t.Fatalf("DELETE: %d %v", code, v)
	}
	if code, v := get("GET", "/v1/responses/"+id); code != 404 {
		t.Fatalf("GET after DELETE: %d %v", code, v)
	}
	if code, _ := get("PUT", "/v1/responses/"+id); code != 405 {
		t.Fatalf("PUT: %d", code)
	}
	before := e0.created() + e1.created()
	unknown := string(appendTaggedID(nil, respSigner{macs: p.s.st.Load().respMACs, backend: "gone"}.tag([]byte("resp_x")), []byte("resp_x")))
	if code, v := get("GET", "/v1/responses/"+unknown); code != 404 || !strings.Contains(fmt.Sprint(v), "no longer configured") {
		t.Fatalf("GET of a removed backend's response: %d %v", code, v)
	}
	resp, b = post(t, p.url+"/v1/responses", fmt.Sprintf(`{"model":"m","input":"x","previous_response_id":%q}`, unknown))
	if v := decodeJSON(t, b); resp.StatusCode != 404 || !strings.Contains(string(b), "previous_response_not_found") || e0.created()+e1.created() != before {
		t.Fatalf("continuing a removed backend's response: %d %v", resp.StatusCode, v)
	}
	p.waitIdle(t)
}

// An engine that does not hold the previous response says so with a 404:
// the client's answer, not a fault of kvproxy's configuration (which a 404
// otherwise is).
func TestResponsesEngineWithoutThePreviousResponse(t *testing.T) {
	e0 := startRespEngine(t, "e0")
	p := startRespProxy(t, e0)
	resp, b := post(t, p.url+"/v1/responses", `{"model":"m","input":"x","previous_response_id":"resp_unknown1"}`)
	if resp.StatusCode != 404 || !strings.Contains(string(b), "resp_unknown1") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	// An id the engine's JSON escapes is recognised in its answer too: it
	// was taken for an engine without the API, rerouted and answered 502
	// (found by the eleventh session's SDK trial).
	resp, b = post(t, p.url+"/v1/responses", `{"model":"m","input":"x","previous_response_id":"resp_a\"b\n"}`)
	if resp.StatusCode != 404 || !strings.Contains(string(b), `resp_a\"b\n`) || strings.Contains(p.logs.String(), "rerouting") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	// A response kvproxy relayed, which the engine no longer holds (it
	// restarted): the error names it as the client knows it.
	// Its code and param are kvproxy's own refusals': clients that
	// rebuild the conversation on previous_response_not_found missed the
	// engine's (code null, param response_id: the twenty-ninth session's
	// SDK trial).
	gone := string(appendTaggedID(nil, testTag(p, "e0", "", "resp_e0lost"), []byte("resp_e0lost")))
	for _, stream := range []string{"false", "true"} {
		resp, b = post(t, p.url+"/v1/responses", fmt.Sprintf(`{"model":"m","input":"x","stream":%s,"previous_response_id":%q}`, stream, gone))
		if resp.StatusCode != 404 || !strings.Contains(string(b), "'"+gone+"'") ||
			!strings.Contains(string(b), `"param":"previous_response_id","code":"previous_response_not_found"`) {
			t.Fatalf("stream %s: %d %s", stream, resp.StatusCode, b)
		}
	}
	if resp, b := post(t, p.url+"/v1/responses", `{"model":"m","input":"x"}`); resp.StatusCode != 200 {
		t.Fatalf("the engine was taken out for it: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// responseEvents reads an SSE answer: each event's lines.
func responseEvents(t *testing.T, resp *http.Response) [][]string {
	t.Helper()
	var events [][]string
	var cur []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if sc.Text() == "" {
			events, cur = append(events, cur), nil
			continue
		}
		cur = append(cur, sc.Text())
	}
	return events
}

// A streamed response: the engine's events as they came (event: lines
// kept, no [DONE] added), ids the client's, the prefill ended by the first
// delta (vLLM sends response.created before it computes anything), the
// usage read from response.completed.
func TestResponsesStream(t *testing.T) {
	e0 := startRespEngine(t, "e0")
	e0.prefill = 300 * time.Millisecond
	p := startRespProxy(t, e0)
	resp, err := http.Post(p.url+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"Hi","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	events := responseEvents(t, resp)
	resp.Body.Close()
	var types []string
	for _, ev := range events {
		if len(ev) != 2 || !strings.HasPrefix(ev[0], "event: ") || !strings.HasPrefix(ev[1], "data: ") {
			t.Fatalf("event %q", ev)
		}
		types = append(types, strings.TrimPrefix(ev[0], "event: "))
		if strings.Contains(ev[1], `"resp_e0`) && !strings.Contains(ev[1], `"resp_kvp`) {
			t.Errorf("an engine id reached the client: %s", ev[1])
		}
	}
	want := "response.created response.in_progress response.output_text.delta response.output_text.delta response.output_text.delta response.completed"
	if strings.Join(types, " ") != want {
		t.Fatalf("events %v", types)
	}
	completed := decodeJSON(t, []byte(strings.TrimPrefix(events[5][1], "data: ")))
	id := completed["response"].(map[string]any)["id"].(string)
	if tag, orig, ok := splitTaggedID(id); !ok || tag != testTag(p, "e0", "", orig) {
		t.Fatalf("response id %s", id)
	}
	p.waitIdle(t)
	var line map[string]any
	for _, l := range strings.Split(p.logs.String(), "\n") {
		if strings.Contains(l, `"path":"/v1/responses"`) {
			json.Unmarshal([]byte(l), &line)
		}
	}
	if line["status"] != 200.0 || line["prompt_tokens"] != 21.0 || line["cached_tokens"] != 16.0 || line["output_tokens"] != 3.0 || line["error"] != nil {
		t.Fatalf("access line %v", line)
	}
	if ttft, _ := time.ParseDuration(fmt.Sprint(line["ttft"]) + "ms"); ttft < e0.prefill {
		t.Fatalf("ttft %v: the prefill ended before the first delta (%v)", line["ttft"], e0.prefill)
	}
}

// An engine failing mid-response: the client gets the Responses API's
// error event, and no [DONE] (its streams have none).
func TestResponsesStreamEngineFailure(t *testing.T) {
	e0 := startRespEngine(t, "e0")
	e0.dropMid = true
	p := startRespProxy(t, e0)
	resp, err := http.Post(p.url+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"Hi","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	events := responseEvents(t, resp)
	resp.Body.Close()
	last := events[len(events)-1]
	if len(last) != 2 || last[0] != "event: error" || !strings.Contains(last[1], `"type":"error","code":"backend_failed"`) {
		t.Fatalf("last event %q of %q", last, events)
	}
	// With an OpenAI error object as "error", on which the SDKs raise: a
	// client that skips unknown events (LangChain) took the cut stream for
	// a finished one (the AI SDK trial).
	var ev struct {
		Error *struct{ Message, Type, Code string } `json:"error"`
	}
	if json.Unmarshal([]byte(strings.TrimPrefix(last[1], "data: ")), &ev); ev.Error == nil || ev.Error.Code != "backend_failed" ||
		ev.Error.Type != "upstream_error" || ev.Error.Message != "the backend serving this request failed mid-stream" {
		t.Fatalf("the error event's error member: %+v in %s", ev.Error, last[1])
	}
	// Numbered after the engine's events, as OpenAI's SDKs expect of an
	// error event (found by the eleventh session's SDK trial).
	var prev, failed struct {
		Seq *int `json:"sequence_number"`
	}
	json.Unmarshal([]byte(strings.TrimPrefix(events[len(events)-2][1], "data: ")), &prev)
	json.Unmarshal([]byte(strings.TrimPrefix(last[1], "data: ")), &failed)
	if prev.Seq == nil || failed.Seq == nil || *failed.Seq != *prev.Seq+1 {
		t.Fatalf("sequence numbers %v then %v: %q", prev.Seq, failed.Seq, events[len(events)-2:])
	}
	for _, ev := range events {
		if strings.Contains(strings.Join(ev, "\n"), "[DONE]") {
			t.Fatalf("a [DONE] in a response stream: %q", events)
		}
	}
	p.waitIdle(t)
}

// Events that are not deltas carry the response object, and with it what
// the client put in metadata: a "delta" there is no output, and the ids
// are rewritten all the same.
func TestResponsesMetadataIsNotOutput(t *testing.T) {
	e0 := startRespEngine(t, "e0")
	p := startRespProxy(t, e0)
	resp, err := http.Post(p.url+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"Hi","stream":true,"metadata":{"delta":"not a token"}}`))
	if err != nil {
		t.Fatal(err)
	}
	events := responseEvents(t, resp)
	resp.Body.Close()
	for _, ev := range events {
		if strings.Contains(strings.Join(ev, "\n"), `"id":"resp_e0`) || ev[0] == "event: error" {
			t.Fatalf("event %q", ev)
		}
	}
	p.waitIdle(t)
	if !strings.Contains(p.logs.String(), `"output_tokens":3,`) || strings.Contains(p.logs.String(), "ejected") {
		t.Fatalf("logs:\n%s", p.logs.String())
	}
}

// An engine's error event ends its response: relayed once, and the engine
// is not taken out for it.
func TestResponsesEngineErrorEventEndsTheStream(t *testing.T) {
	e0 := startRespEngine(t, "e0")
	e0.errorMid = true
	p := startRespProxy(t, e0)
	for range 2 {
		resp, err := http.Post(p.url+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"Hi","stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		events := responseEvents(t, resp)
		resp.Body.Close()
		errs := 0
		for _, ev := range events {
			if ev[0] == "event: error" {
				errs++
			}
		}
		if resp.StatusCode != 200 || errs != 1 || !strings.Contains(events[len(events)-1][1], "boom") {
			t.Fatalf("%d %q", resp.StatusCode, events)
		}
	}
	p.waitIdle(t)
}

// A response belongs to its tenant: another tenant's key finds no such
// response, to continue, read or delete. A tenant's token budget pays for
// the stored conversation a follow-up makes the engine compute.
func TestResponsesBelongToTheirTenant(t *testing.T) {
	e0 := startRespEngine(t, "e0")
	p := serveYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+e0.addr+"', model: m}]\n"+
		"auth: {keys: [{key: key-team-a-0001, tenant: a}, {key: key-team-b-0001, tenant: b}]}\n"+
		"tenants: [{name: a, tokens_per_minute: 3000}]\n", true)
	a, b := []string{"Authorization", "Bearer key-team-a-0001"}, []string{"Authorization", "Bearer key-team-b-0001"}
	resp, body := postHeaders(t, p.url+"/v1/responses", `{"model":"m","input":"Hi"}`, a...)
	id, _ := decodeJSON(t, body)["id"].(string)
	if resp.StatusCode != 200 || id == "" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	follow := fmt.Sprintf(`{"model":"m","input":"more","previous_response_id":%q}`, id)
	if resp, body := postHeaders(t, p.url+"/v1/responses", follow, b...); resp.StatusCode != 404 || !strings.Contains(string(body), "previous_response_not_found") {
		t.Fatalf("another tenant continued it: %d %s", resp.StatusCode, body)
	}
	// Nor with the engine's own id (pinned to the engine or not), nor with
	// a tag of one of its own responses on that engine put in front of it
	// (found by the eleventh session's SDK trial: both read, continued and
	// deleted the other tenant's response).
	_, orig, _ := splitTaggedID(id)
	resp, body = postHeaders(t, p.url+"/v1/responses", `{"model":"m","input":"Hi"}`, b...)
	if resp.StatusCode != 200 {
		t.Fatalf("the other tenant's own response: %d %s", resp.StatusCode, body)
	}
	ownTag, _, _ := splitTaggedID(decodeJSON(t, body)["id"].(string))
	forged := string(appendTaggedID(nil, ownTag, []byte(orig)))
	for _, prev := range []string{orig, forged} {
		for _, nv := range []string{"", `,"nvext":{"backend_instance_id":"e0"}`} {
			follow := fmt.Sprintf(`{"model":"m","input":"more","previous_response_id":%q%s}`, prev, nv)
			if resp, body := postHeaders(t, p.url+"/v1/responses", follow, b...); resp.StatusCode != 404 || !strings.Contains(string(body), "previous_response_not_found") {
				t.Fatalf("another tenant continued it as %s%s: %d %s", prev, nv, resp.StatusCode, body)
			}
		}
	}
	// Nor by having the engine make a response of the same id: vLLM takes a
	// request's request_id for its response's id (found by the eleventh
	// session's review).
	resp, body = postHeaders(t, p.url+"/v1/responses", fmt.Sprintf(`{"model":"m","input":"x","request_id":%q}`, orig), b...)
	_, minted, _ := splitTaggedID(decodeJSON(t, body)["id"].(string))
	if resp.StatusCode != 200 || minted == orig {
		t.Fatalf("a request_id of another tenant's response: %d %s", resp.StatusCode, body)
	}
	for _, method := range []string{"GET", "DELETE"} {
		for _, as := range []string{id, forged, orig} {
			req, _ := http.NewRequest(method, p.url+"/v1/responses/"+as, nil)
			req.Header.Set(b[0], b[1])
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 404 {
				t.Fatalf("another tenant's %s of %s: %d", method, as, resp.StatusCode)
			}
		}
	}
	// Without a cache salt secret, ids hold at one process: the 404 says so.
	if resp, body := postHeaders(t, p.url+"/v1/responses", fmt.Sprintf(`{"model":"m","input":"more","previous_response_id":%q}`, id), b...); resp.StatusCode != 404 || !strings.Contains(string(body), "hold only at the kvproxy process") {
		t.Fatalf("no hint of where ids hold: %d %s", resp.StatusCode, body)
	}
	if got := e0.created(); got != 3 {
		t.Fatalf("the engine made %d responses, want the two tenants' first ones and the request_id one", got)
	}
	// The follow-up is admitted for its own few tokens; the engine's
	// usage (5,000 prompt tokens) puts the budget in debt.
	if resp, body := postHeaders(t, p.url+"/v1/responses", follow, a...); resp.StatusCode != 200 {
		t.Fatalf("follow-up: %d %s", resp.StatusCode, body)
	}
	if resp, body := postHeaders(t, p.url+"/v1/responses", `{"model":"m","input":"Hi"}`, a...); resp.StatusCode != 429 {
		t.Fatalf("a budget of 3,000 after 5,000 tokens: %d %s", resp.StatusCode, body)
	}
	p.waitIdle(t)
}

// The by-id endpoints: whole methods only, engine ids that could only be
// ids, errors that name the response as the client knows it; and a
// follow-up whose engine is down says which.
func TestResponsesByIDEdges(t *testing.T) {
	e0 := startRespEngine(t, "e0")
	p := startRespProxy(t, e0)
	_, body := post(t, p.url+"/v1/responses", `{"model":"m","input":"Hi","store":false}`)
	id := decodeJSON(t, body)["id"].(string)
	do := func(method, path string) (int, string) {
		resp, body := doRequest(t, method, p.url+path)
		return resp.StatusCode, body
	}
	if code, body := do("GET", "/v1/responses/"+id); code != 404 || !strings.Contains(body, "'"+id+"'") {
		t.Fatalf("a response not stored: %d %s", code, body)
	}
	if code, _ := do("GE", "/v1/responses/"+id); code != 405 {
		t.Fatalf("method GE: %d", code)
	}
	before := len(e0.paths)
	tag, _, _ := splitTaggedID(id)
	if code, _ := do("GET", "/v1/responses/"+respIDPrefix+tag+"_x%3Fa=b"); code != 404 || len(e0.paths) != before {
		t.Fatalf("an id with a query: %d, engine saw %v", code, e0.paths[before:])
	}

	_, body = post(t, p.url+"/v1/responses", `{"model":"m","input":"Hi"}`)
	id = decodeJSON(t, body)["id"].(string)
	dry := fmt.Sprintf(`{"model":"m","input":"more","previous_response_id":%q,"nvext":{"annotations":["query_instance_id"]}}`, id)
	if _, body := post(t, p.url+"/v1/responses", dry); !strings.Contains(string(body), `"block_hashes":[]`) || !strings.Contains(string(body), `"total_blocks":0`) {
		t.Fatalf("dry run of a follow-up: %s", body)
	}
	p.s.st.Load().backends["e0"].fail(ejectConnect, "test")
	follow := fmt.Sprintf(`{"model":"m","input":"more","previous_response_id":%q}`, id)
	if resp, body := post(t, p.url+"/v1/responses", follow); resp.StatusCode != 503 || !strings.Contains(string(body), "holds the previous response "+id) {
		t.Fatalf("the owner ejected: %d %s", resp.StatusCode, body)
	}
	p.waitIdle(t)
}

// A stored response whose backend is down: the first request finds the
// connection refused (502, as a completion gets it: retry, and no engine
// address in the message), and from then on the backend is out and the
// answer is the follow-up's 503 (found by the twelfth session's user trial:
// a 502 quoting the dial error, the backend still tried, no Retry-After).
func TestResponsesByIDOwnerDown(t *testing.T) {
	e0 := startRespEngine(t, "e0")
	p := startRespProxy(t, e0)
	_, body := post(t, p.url+"/v1/responses", `{"model":"m","input":"Hi"}`)
	id := decodeJSON(t, body)["id"].(string)
	e0.stop()
	do := func(method, path string) (*http.Response, string) { return doRequest(t, method, p.url+path) }
	host, _, _ := net.SplitHostPort(e0.addr)
	resp, msg := do("GET", "/v1/responses/"+id)
	if resp.StatusCode != 502 || resp.Header.Get("Retry-After") != "1" || !strings.Contains(msg, "backend e0 refused the connection") || strings.Contains(msg, host) {
		t.Fatalf("the engine down: %d (Retry-After %q) %s", resp.StatusCode, resp.Header.Get("Retry-After"), msg)
	}
	for _, method := range []string{"GET", "DELETE"} {
		resp, body := do(method, "/v1/responses/"+id)
		if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" || !strings.Contains(body, "holds the response "+id+", is not available") {
			t.Fatalf("%s with the backend out: %d (Retry-After %q) %s", method, resp.StatusCode, resp.Header.Get("Retry-After"), body)
		}
	}
	resp, msg = do("POST", "/v1/responses/"+id+"/cancel")
	if resp.StatusCode != 503 {
		t.Fatalf("cancel with the backend out: %d %s", resp.StatusCode, msg)
	}

	// A follow-up, which may go nowhere else, says to retry as well.
	e1 := startRespEngine(t, "e1")
	p1 := startRespProxy(t, e1)
	_, body = post(t, p1.url+"/v1/responses", `{"model":"m","input":"Hi"}`)
	id = decodeJSON(t, body)["id"].(string)
	e1.stop()
	resp, body = post(t, p1.url+"/v1/responses", fmt.Sprintf(`{"model":"m","input":"more","previous_response_id":%q}`, id))
	if resp.StatusCode != 502 || resp.Header.Get("Retry-After") != "1" || !strings.Contains(string(body), "refused the connection") {
		t.Fatalf("a follow-up, its engine down: %d (Retry-After %q) %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	p.waitIdle(t)
	p1.waitIdle(t)
}

// The response ids' key: the cache salt secret when there is one (ids then
// hold across restarts and replicas); with client keys and no secret, one of
// the process's own (a key derived from the client keys let a tenant holding
// an id test guesses of other tenants' keys offline: found by the eleventh
// session's review); with no keys at all, a fixed one.
func TestResponseIDKey(t *testing.T) {
	r1, r2 := []byte("random one"), []byte("random two")
	keys := []config.APIKey{{Key: "key-team-a-0001", Tenant: "a"}}
	secret := config.Auth{Keys: keys, CacheSaltSecret: "0123456789abcdef0123456789abcdef"}
	if !bytes.Equal(respKey(secret, r1), respKey(secret, r2)) {
		t.Fatal("with a secret, the key must not depend on the process")
	}
	if k := (config.Auth{Keys: keys}); bytes.Equal(respKey(k, r1), respKey(k, r2)) {
		t.Fatal("with keys and no secret, the key must be the process's own")
	}
	if k := (config.Auth{}); !bytes.Equal(respKey(k, r1), respKey(k, r2)) {
		t.Fatal("with no keys, the key must be fixed")
	}
	other := config.Auth{Keys: []config.APIKey{{Key: "key-team-a-0002", Tenant: "a"}}}
	if !bytes.Equal(respKey(config.Auth{Keys: keys}, r1), respKey(other, r1)) {
		t.Fatal("the client keys must not enter the key: an id would be a test of guesses of them")
	}
}
