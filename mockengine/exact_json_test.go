package mockengine

import "testing"

// Member names are matched exactly, as vLLM's pydantic models match them:
// "Stream": true does not stream, and "Max_Tokens" sets nothing.
func TestMembersMatchExactly(t *testing.T) {
	_, url := startEngine(t, Config{})
	code, r := post(t, url+"/v1/completions", map[string]any{"prompt": "Once upon a time", "Stream": true, "Max_Tokens": 1, "max_tokens": 3, "ignore_eos": true})
	if code != 200 || r.Object != "text_completion" || r.Usage == nil || r.Usage.CompletionTokens != 3 {
		t.Fatalf("%d %+v", code, r)
	}
	ev := streamEvents(t, url+"/v1/completions", map[string]any{"prompt": "Once upon a time", "stream": true, "STREAM": false, "max_tokens": 2, "ignore_eos": true})
	if len(ev) < 3 || ev[len(ev)-1] != "[DONE]" {
		t.Fatalf("stream: %q", ev)
	}
	var req apiRequest
	if err := unmarshalExact([]byte(`{"model":"m","Model":"x","messages":[{"role":"user","content":"hi"}]}`), &req); err != nil || req.Model != "m" || len(req.Messages) != 1 {
		t.Fatalf("%v %+v", err, req)
	}
}

// A member of the wrong type is named with the JSON type it wants, not a
// Go type (found by the seventh session's trial).
func TestWrongTypeNamesTheField(t *testing.T) {
	var req apiRequest
	fe := fieldError(unmarshalExact([]byte(`{"model":"m","prompt":"x","stream_options":"yes"}`), &req))
	if fe == nil || fe.param != "stream_options" || fe.msg != "stream_options must be an object, got string" {
		t.Fatalf("%+v", fe)
	}
}
