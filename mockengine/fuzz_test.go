package mockengine

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
)

// FuzzParseRequest feeds arbitrary bodies to the request parser: it must
// answer every one with a request or a client error, never panic.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"mock-model","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"}]}]}`,
		`{"prompt":[1,2,3],"max_completion_tokens":2,"ignore_eos":true,"cache_salt":"x"}`,
		`{"prompt":[[1,2]]}`, `{"prompt":["x"]}`, `{"prompt":null}`, `{"messages":null}`, `[]`, `{`, `""`,
	} {
		f.Add(s, strings.Contains(s, "messages"))
	}
	e, err := New(Config{})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { e.Close() })
	f.Fuzz(func(t *testing.T, body string, chat bool) {
		r := httptest.NewRequest("POST", "/v1/completions", strings.NewReader(body))
		w := httptest.NewRecorder()
		req, prompt, maxTokens, err := e.parse(w, r, chat)
		if err != nil {
			if _, ok := err.(*badRequest); !ok {
				t.Fatalf("non-client error %T %v", err, err)
			}
			return
		}
		if req == nil || len(prompt) == 0 || maxTokens < 1 {
			t.Fatalf("accepted a request with prompt %d tokens, max_tokens %d", len(prompt), maxTokens)
		}
	})
}

// FuzzParseResponses is FuzzParseRequest for POST /v1/responses.
func FuzzParseResponses(f *testing.F) {
	for _, s := range []string{
		`{"input":"hi","instructions":"be brief","max_output_tokens":3,"stream":true}`,
		`{"input":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_image","image_url":"x"}]},{"type":"reasoning","summary":[{"text":"r"}]}]}`,
		`{"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"ok"}],"tools":[{"type":"function","name":"f","parameters":{"type":"object"},"x":1,"x":2}]}`,
		`{"input":"x","previous_response_id":"resp_1"}`, `{"input":null}`, `{"input":[7]}`, `{"tools":[[]]}`, `[]`, `{`,
	} {
		f.Add(s)
	}
	e, err := New(Config{})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { e.Close() })
	f.Fuzz(func(t *testing.T, body string) {
		r := httptest.NewRequest("POST", "/v1/responses", strings.NewReader(body))
		c, err := e.parseResponses(httptest.NewRecorder(), r)
		if err != nil {
			if _, ok := err.(*badRequest); !ok {
				t.Fatalf("non-client error %T %v", err, err)
			}
			return
		}
		if len(c.prompt) == 0 || c.maxTokens < 1 || !json.Valid(c.tools) {
			t.Fatalf("accepted a request with prompt %d tokens, max_output_tokens %d, tools %s", len(c.prompt), c.maxTokens, c.tools)
		}
	})
}

// FuzzParseMessages is FuzzParseRequest for POST /v1/messages and its
// count_tokens.
func FuzzParseMessages(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","max_tokens":3,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":"hi"}],"stream":true}`,
		`{"model":"m","max_tokens":3,"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image","source":{"data":"x"}},{"type":"tool_result","id":"t","content":[{"a":1.5e300,"b":[null,true,"é'"]}]}]}]}`,
		`{"model":"m","max_tokens":3,"messages":[{"role":"assistant","content":[{"type":"thinking","thinking":"t"},{"type":"tool_use","id":"t","name":"f","input":{"k":[1,-0,2e-9,"\u00e9\ud83d\ude00"],"k":{}}},{"type":"tool_result","content":"r"}]}],"tools":[{"name":"f","input_schema":{"properties":{}}}],"tool_choice":{"type":"any"}}`,
		`{"model":"m","messages":[{"role":"user","content":[]}]}`, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text"}]}]}`,
		`{"messages":null}`, `[]`, `{`, `""`,
	} {
		f.Add(s, !strings.Contains(s, "max_tokens"))
	}
	e, err := New(Config{Model: "m"})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { e.Close() })
	f.Fuzz(func(t *testing.T, body string, count bool) {
		r := httptest.NewRequest("POST", "/v1/messages", strings.NewReader(body))
		c, err := e.parseMessages(httptest.NewRecorder(), r, count)
		if err != nil {
			if _, ok := err.(*badRequest); !ok {
				t.Fatalf("non-client error %T %v", err, err)
			}
			return
		}
		if len(c.prompt) == 0 || !count && c.maxTokens < 1 {
			t.Fatalf("accepted a request with prompt %d tokens, max_tokens %d", len(c.prompt), c.maxTokens)
		}
	})
}
