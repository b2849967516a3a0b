package mockengine

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

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

// Every endpoint answers a wrong-typed member with a 400 naming it: the
// embeddings endpoint's dimensions, over HTTP.
func TestWrongTypeOverHTTP(t *testing.T) {
	_, url := startEngine(t, Config{})
	for body, want := range map[string]string{
		`{"input":"hi","dimensions":"8"}`: "dimensions must be an integer, got string",
		`{"input":"hi","dimensions":1.5}`: "dimensions must be an integer, got number 1.5",
	} {
		resp, err := http.Post(url+"/v1/embeddings", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(string(b), want) || !strings.Contains(string(b), `"param":"dimensions"`) {
			t.Errorf("%s: %d %s, want 400 naming dimensions: %q", body, resp.StatusCode, b, want)
		}
	}
}

// Sampling values vLLM refuses are refused, on chat and completions, with a
// 400 naming the member (the newcomer trial had temperature "x", -1 and
// top_p 5 answered 200).
func TestSamplingValuesChecked(t *testing.T) {
	_, url := startEngine(t, Config{})
	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		for member, want := range map[string]string{
			`"temperature":"x"`:             "temperature must be a number, got string",
			`"temperature":-1`:              "temperature must be non-negative, got -1.",
			`"top_p":5`:                     "top_p must be in (0, 1], got 5.",
			`"top_p":0`:                     "top_p must be in (0, 1], got 0.",
			`"n":0`:                         "n must be at least 1, got 0.",
			`"min_tokens":-1`:               "min_tokens must be greater than or equal to 0, got -1.",
			`"min_tokens":9,"max_tokens":8`: "min_tokens must be less than or equal to max_tokens=8, got 9.",
			`"min_tokens":17`:               "min_tokens must be less than or equal to max_tokens=16, got 17.",
		} {
			if member == `"min_tokens":17` && path == "/v1/chat/completions" {
				continue // chat's default max_tokens is the context left
			}
			body := `{"prompt":"hi",` + member + `}`
			if path == "/v1/chat/completions" {
				body = `{"messages":[{"role":"user","content":"hi"}],` + member + `}`
			}
			resp, err := http.Post(url+path, "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			param := strings.Trim(strings.Split(member, ":")[0], `"`)
			if resp.StatusCode != 400 || !strings.Contains(string(b), want) || !strings.Contains(string(b), `"param":"`+param+`"`) {
				t.Errorf("%s %s: %d %s, want 400: %q", path, member, resp.StatusCode, b, want)
			}
		}
		ok := `{"prompt":"hi","temperature":0,"top_p":1,"max_tokens":2}`
		if path == "/v1/chat/completions" {
			ok = `{"messages":[{"role":"user","content":"hi"}],"temperature":1.5,"top_p":0.9,"max_tokens":2}`
		}
		if resp, err := http.Post(url+path, "application/json", strings.NewReader(ok)); err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s %s: %v %v", path, ok, resp, err)
		} else {
			resp.Body.Close()
		}
	}
}

// min_tokens is honoured as vLLM does: no end of sequence before it (the
// operator trial: 300 asked, 29 to 226 given, each ending "stop"). Without
// a max_tokens a chat answer may be as long as it; a completion's default
// max_tokens is 16, which bounds it (the review).
func TestMinTokensHonoured(t *testing.T) {
	_, url := startEngine(t, Config{})
	for i, body := range []string{
		`{"messages":[{"role":"user","content":"q%d"}],"min_tokens":40,"max_tokens":50}`,
		`{"prompt":"q%d","min_tokens":40,"max_tokens":50}`,
		`{"messages":[{"role":"user","content":"q%d"}],"min_tokens":40}`,
	} {
		for j := 0; j < 8; j++ {
			path := "/v1/completions"
			if strings.Contains(body, "messages") {
				path = "/v1/chat/completions"
			}
			resp, err := http.Post(url+path, "application/json", strings.NewReader(fmt.Sprintf(body, j)))
			if err != nil {
				t.Fatal(err)
			}
			var a struct {
				Usage struct {
					CompletionTokens int `json:"completion_tokens"`
				}
			}
			err = json.NewDecoder(resp.Body).Decode(&a)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || a.Usage.CompletionTokens < 40 || a.Usage.CompletionTokens > 50 {
				t.Fatalf("body %d, prompt %d: %d, %d completion tokens (%v), want 40-50", i, j, resp.StatusCode, a.Usage.CompletionTokens, err)
			}
		}
	}
}
