package proxy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// noDoneEngine streams answers as engines that leave out data: [DONE] do
// (llama.cpp before late 2024, TGI before mid-2024): the body ends after
// the chunk with the finish_reason. A prompt "cut" ends the body before
// any finish_reason, as an engine that gave up mid-answer.
func noDoneEngine(t *testing.T) *httptest.Server {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return // the probe and the scrape
		}
		var req struct {
			Prompt   json.RawMessage
			Messages []struct{ Content string }
		}
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "text/event-stream")
		chunk := func(s string) { io.WriteString(w, "data: "+s+"\n\n") }
		var prompts []string
		if json.Unmarshal(req.Prompt, &prompts) == nil { // a batch: a choice each, numbered as vLLM does
			for i, p := range prompts {
				if p != "cut" {
					chunk(fmt.Sprintf(`{"choices":[{"finish_reason":"length","index":%d,"text":"lo"}],"object":"text_completion"}`, i))
				}
			}
			return
		}
		if r.URL.Path == "/v1/completions" {
			// llama.cpp's member order: finish_reason before the text.
			chunk(`{"choices":[{"finish_reason":null,"index":0,"text":"hel"}],"object":"text_completion"}`)
			if string(req.Prompt) != `"cut"` {
				chunk(`{"choices":[{"finish_reason":"length","index":0,"text":"lo"}],"object":"text_completion"}`)
			}
			return
		}
		chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`)
		switch req.Messages[0].Content {
		case "cut":
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":null,"stop_reason":null}]}`)
			return
		case "empty": // SGLang 0.4.3's mid-answer finish_reason
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":""}]}`)
			return
		case "two": // n 2: choice 1 finishes, choice 0 does not
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}`)
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":1,"delta":{"content":"yo"},"finish_reason":"stop"}]}`)
			return
		case "three": // n 3: choices 0 and 1 finish, choice 2 never comes
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}`)
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":1,"delta":{"content":"yo"},"finish_reason":"stop"}]}`)
			return
		case "together": // n 2 in one chunk: choice 0 finishes, choice 1 does not
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"},{"index":1,"delta":{"content":"yo"},"finish_reason":null}]}`)
			return
		case "both": // n 2: both finish, side by side
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":1,"delta":{"content":"yo"},"finish_reason":null}]}`)
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"length"}]}`)
			chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":1,"delta":{"content":"!"},"finish_reason":"stop"}]}`)
			return
		}
		chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":null,"stop_reason":null}]}`)
		chunk(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" there"},"logprobs":null,"finish_reason": "stop","stop_reason":null}]}`)
		if req.Messages[0].Content == "no usage" {
			return
		}
		chunk(`{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`)
	}))
	t.Cleanup(engine.Close)
	return engine
}

// An engine that ends its stream after the finish_reason without [DONE]
// answered in full: the client's stream ends with the [DONE] OpenAI sends
// and no error event, and the engine stays in (it was ejected after every
// stream, the client's complete answer ending in "failed mid-stream").
func TestEngineWithoutDoneAnswersInFull(t *testing.T) {
	engine := noDoneEngine(t)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: '"+engine.URL+"', model: m}]\n")
	for i := 0; i < 2; i++ {
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`)
		out := string(b)
		if resp.StatusCode != 200 || strings.Contains(out, "error") || !strings.Contains(out, `" there"`) ||
			!strings.Contains(out, `"total_tokens":5`) || !strings.HasSuffix(out, "}\n\ndata: [DONE]\n\n") || strings.Count(out, "[DONE]") != 1 {
			t.Fatalf("chat stream %d: %d\n%s", i, resp.StatusCode, out)
		}
		resp, b = post(t, p.url+"/v1/completions", `{"model":"m","stream":true,"prompt":"hi"}`)
		if out := string(b); resp.StatusCode != 200 || strings.Contains(out, "error") || !strings.HasSuffix(out, `"text":"lo"}],"object":"text_completion"}`+"\n\ndata: [DONE]\n\n") {
			t.Fatalf("completion stream %d: %d\n%s", i, resp.StatusCode, out)
		}
		// An engine that ignores include_usage (TGI): the answer is whole.
		resp, b = post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"no usage"}]}`)
		if out := string(b); resp.StatusCode != 200 || strings.Contains(out, "error") || !strings.HasSuffix(out, `"finish_reason": "stop","stop_reason":null}]}`+"\n\ndata: [DONE]\n\n") {
			t.Fatalf("chat stream %d without its usage chunk: %d\n%s", i, resp.StatusCode, out)
		}
		// A batch of prompts, each answered.
		resp, b = post(t, p.url+"/v1/completions", `{"model":"m","stream":true,"prompt":["a","b","c"]}`)
		if out := string(b); resp.StatusCode != 200 || strings.Contains(out, "error") || strings.Count(out, `"finish_reason":"length"`) != 3 {
			t.Fatalf("a batch of 3, stream %d: %d\n%s", i, resp.StatusCode, out)
		}
		// Several choices, each finished (and an engine that ignores n,
		// llama.cpp's, with its one choice finished).
		for _, content := range []string{"both", "hi"} {
			resp, b = post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"n":2,"messages":[{"role":"user","content":"`+content+`"}]}`)
			if out := string(b); resp.StatusCode != 200 || strings.Contains(out, "error") || !strings.HasSuffix(out, "}\n\ndata: [DONE]\n\n") {
				t.Fatalf("n 2, %q, stream %d: %d\n%s", content, i, resp.StatusCode, out)
			}
		}
		if ejected(p, "e0") {
			t.Fatalf("after stream %d the engine is ejected: %s", i, p.logs.String())
		}
	}
	p.waitIdle(t)
	logs := p.logs.String()
	if strings.Count(logs, "the engine ends its streams without data: [DONE]") != 1 || strings.Contains(logs, "failed mid-stream") {
		t.Fatalf("want the engine's missing [DONE] said once, and no failure: %s", logs)
	}
}

// Without the answer's end, a body that ends is an answer cut short: the
// client is told so with an error event, and the engine is taken out. Its
// end is a finish_reason (not "", which SGLang 0.4.3 sent mid-answer) for
// the one choice asked for, or for every choice asked for (one choice of
// two finishing says nothing of the other, nor two of three: the reviews).
func TestEngineEndingBeforeTheFinishFailsTheStream(t *testing.T) {
	chat := func(content, more string) string {
		return `{"model":"m","stream":true` + more + `,"messages":[{"role":"user","content":"` + content + `"}]}`
	}
	for _, tc := range []struct{ path, body string }{
		{"/v1/chat/completions", chat("cut", "")},
		{"/v1/completions", `{"model":"m","stream":true,"prompt":"cut"}`},
		{"/v1/chat/completions", chat("empty", "")},
		{"/v1/chat/completions", chat("two", `,"n":2`)},
		{"/v1/chat/completions", chat("three", `,"n":3`)},
		{"/v1/chat/completions", chat("together", `,"n":2`)},
		{"/v1/completions", `{"model":"m","stream":true,"prompt":["a","b","cut"]}`}, // the third choice never comes
	} {
		engine := noDoneEngine(t)
		// A second engine: a model's only one is not ejected.
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: '"+engine.URL+"', model: m}, {id: e1, url: 'http://127.0.0.1:1', model: m}]\n")
		resp, b := post(t, p.url+tc.path, strings.Replace(tc.body, `{"model":"m",`, `{"model":"m","nvext":{"backend_instance_id":"e0"},`, 1))
		out := string(b)
		if resp.StatusCode != 200 || !strings.Contains(out, `"code":"backend_failed"`) || !strings.HasSuffix(out, "data: [DONE]\n\n") {
			t.Errorf("%s %s: %d\n%s", tc.path, tc.body, resp.StatusCode, out)
		} else if !ejected(p, "e0") {
			t.Errorf("%s %s: an engine that cut its answer short is not ejected", tc.path, tc.body)
		}
		p.waitIdle(t)
	}
}

// A body that ends with its connection (no length, not chunked) ends the
// same way when the engine crashes: it is not taken for a whole answer.
func TestCloseDelimitedStreamWithoutDoneFails(t *testing.T) {
	e := rawEngine(t, func(c net.Conn, _ *bufio.Reader) {
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"+
			`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}`+"\n\n")
	})
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://"+e.addr+"', model: m}]\n")
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if out := string(b); resp.StatusCode != 200 || !strings.Contains(out, `"code":"backend_failed"`) {
		t.Fatalf("%d\n%s", resp.StatusCode, out)
	}
	p.waitIdle(t)
}
