package proxy

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// jsonEngine answers every request with a 200 of the given Content-Type
// and body (sized), whatever the request asked; coding, when set, is the
// body's Content-Encoding, the body given already coded.
func jsonEngine(t *testing.T, ctype, coding, body string) *fakeEngine {
	return rawEngine(t, func(c net.Conn, rd *bufio.Reader) {
		ce := ""
		if coding != "" {
			ce = "Content-Encoding: " + coding + "\r\n"
		}
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: %s\r\n%sContent-Length: %d\r\n\r\n%s", ctype, ce, len(body), body)
	})
}

const wholeChat = `{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"m","choices":[` +
	`{"index":0,"message":{"role":"assistant","content":"hello there","tool_calls":[` +
	`{"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}},` +
	`{"id":"call_b","type":"function","function":{"name":"get_time","arguments":"{}"}}]},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null},` +
	`{"index":1,"message":{"role":"assistant","content":"second"},"logprobs":null,"finish_reason":"stop"}],` +
	`"usage":{"prompt_tokens":11,"completion_tokens":9,"total_tokens":20,"prompt_tokens_details":{"cached_tokens":3}}}`

// sseData is the data of each event of an SSE body.
func sseData(t *testing.T, body []byte) []string {
	t.Helper()
	var out []string
	for _, ev := range strings.Split(strings.TrimSuffix(string(body), "\n\n"), "\n\n") {
		if !strings.HasPrefix(ev, "data: ") || strings.Contains(ev, "\n") {
			t.Fatalf("not one data line: %q in\n%s", ev, body)
		}
		out = append(out, strings.TrimPrefix(ev, "data: "))
	}
	return out
}

// An engine that answers a streaming chat request with its whole answer as
// JSON (servers without streaming do): the client gets the stream the
// engine would have sent, one chunk per choice with the message as its
// delta and the tool calls indexed, the usage chunk it asked for, [DONE];
// the engine stays in, its usage is metered, and the log says it once.
// Before, the client got "failed mid-stream" and the engine was ejected.
func TestWholeJSONAnswerToStreamIsStreamed(t *testing.T) {
	e := jsonEngine(t, "application/json", "", wholeChat)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	for i := range 2 {
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"n":2,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`)
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
			t.Fatalf("%d %v\n%s", resp.StatusCode, resp.Header, b)
		}
		data := sseData(t, b)
		want := []string{
			`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
			`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":"hello there","tool_calls":[` +
				`{"index":0,"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}},` +
				`{"index":1,"id":"call_b","type":"function","function":{"name":"get_time","arguments":"{}"}}]},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null}]}`,
			`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":1,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
			`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":1,"delta":{"content":"second"},"logprobs":null,"finish_reason":"stop"}]}`,
			`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":9,"total_tokens":20,"prompt_tokens_details":{"cached_tokens":3}}}`,
			`[DONE]`,
		}
		if strings.Join(data, "\n") != strings.Join(want, "\n") {
			t.Fatalf("request %d: got\n%s\nwant\n%s", i, strings.Join(data, "\n"), strings.Join(want, "\n"))
		}
	}
	if ejected(p, "e0") {
		t.Fatalf("the engine is ejected: %s", p.logs.String())
	}
	p.waitIdle(t)
	logs := p.logs.String()
	if n := strings.Count(logs, "whole answer as JSON"); n != 1 {
		t.Fatalf("said %d times:\n%s", n, logs)
	}
	if !strings.Contains(logs, `"status":200`) || !strings.Contains(logs, `"prompt_tokens":11`) || strings.Contains(logs, "failed") {
		t.Fatalf("not logged as the engine's answer, with its usage:\n%s", logs)
	}
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_tokens_total{model="m",tenant="",type="cached"} 6`+"\n") ||
		!strings.Contains(m, `kvproxy_tokens_total{model="m",tenant="",type="completion"} 18`+"\n") {
		t.Fatalf("want the engine's usage, twice:\n%s", grepLines(m, "kvproxy_tokens_total{"))
	}
}

// Without include_usage there is no usage chunk; a completions answer's
// choices go as they are, typed as a stream's, with the index the SDKs
// gather a choice by when the engine left it out.
func TestWholeJSONCompletionToStream(t *testing.T) {
	body := `{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"text":" world","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}`
	e := jsonEngine(t, "application/json; charset=utf-8", "", body)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","stream":true,"prompt":"hello"}`)
	data := sseData(t, b)
	want := `{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length"}]}` + "\n[DONE]"
	if resp.StatusCode != 200 || strings.Join(data, "\n") != want {
		t.Fatalf("%d\n%s", resp.StatusCode, b)
	}
}

// A whole answer compressed by the engine (or a gateway before it) is
// decoded first; one pretty-printed makes events of one line each.
func TestWholeJSONAnswerCompressed(t *testing.T) {
	var z bytes.Buffer
	w := gzip.NewWriter(&z)
	var pretty bytes.Buffer
	json.Indent(&pretty, []byte(wholeChat), "", "  ") // as Python's json.dumps(indent=2) writes it
	w.Write(pretty.Bytes())
	w.Close()
	e := jsonEngine(t, "application/json", "gzip", z.String())
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if data := sseData(t, b); resp.StatusCode != 200 || len(data) != 5 || !strings.Contains(data[3], `"content":"second"`) || data[4] != "[DONE]" {
		t.Fatalf("%d\n%s", resp.StatusCode, b)
	}
}

// A stream typed as JSON (some servers send their SSE with the wrong
// Content-Type) is relayed as the stream it is.
func TestStreamTypedAsJSONIsRelayed(t *testing.T) {
	events := "\n data: " + quirkRole + "\n\ndata: " + quirkLast + "\n\ndata: [DONE]\n\n"
	e := jsonEngine(t, "application/json", "", events)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if out := string(b); resp.StatusCode != 200 || strings.Contains(out, "error") || !strings.Contains(out, `" end"`) || !strings.HasSuffix(out, "data: [DONE]\n\n") {
		t.Fatalf("%d\n%q", resp.StatusCode, out)
	}
	if ejected(p, "e0") {
		t.Fatal("ejected")
	}
}

// An error object answered with a 200 reaches the client as an engine's
// error event does (in OpenAI's shape, then [DONE]); a client's mistake
// does not count against the engine. JSON that is no answer is a 502 that
// says what came, and does not eject the engine either: it answers other
// requests.
func TestWholeJSONErrorsAndNonAnswers(t *testing.T) {
	t.Run("error object", func(t *testing.T) {
		e := jsonEngine(t, "application/json", "", `{"object":"error","message":"top_p must be in (0, 1]","type":"BadRequestError","param":null,"code":400}`)
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
		e2 := jsonEngine(t, "application/json", "", `{"error":{"message":"bad top_p","type":"invalid_request_error","param":"top_p","code":null}}`)
		p2 := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e2)
		for _, px := range []*testProxy{p, p2} {
			resp, b := post(t, px.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
			data := sseData(t, b)
			if resp.StatusCode != 200 || len(data) != 2 || !strings.HasPrefix(data[0], `{"error":{"message":`) ||
				!strings.Contains(data[0], `"type":"invalid_request_error"`) || data[1] != "[DONE]" {
				t.Fatalf("%d\n%s", resp.StatusCode, b)
			}
			if ejected(px, "e0") {
				t.Fatal("ejected for the client's mistake")
			}
		}
	})
	t.Run("not an answer", func(t *testing.T) {
		e := jsonEngine(t, "application/json", "", `{"status":"ok"}`)
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
		for _, path := range []string{"/v1/chat/completions", "/v1/responses"} {
			body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`
			if path == "/v1/responses" {
				body = `{"model":"m","stream":true,"input":"hi"}`
			}
			resp, b := post(t, p.url+path, body)
			if resp.StatusCode != 502 || !strings.Contains(string(b), "answered a streaming request with a JSON body that is not a streamable answer") ||
				strings.Contains(string(b), "127.0.0.1") {
				t.Fatalf("%s: %d\n%s", path, resp.StatusCode, b)
			}
		}
		if ejected(p, "e0") {
			t.Fatal("ejected")
		}
		p.waitIdle(t)
	})
}

func TestWholeAnswerEventsRefusesNonAnswers(t *testing.T) {
	for _, body := range []string{
		`[]`, `{"choices":[]}`, `{"choices":[{"index":0}]}`, `{"choices":[{"index":0,"message":"x"}]}`,
		`{"choices":[{"index":0,"message":{"tool_calls":{}}}]}`, `{"choices":{}}`, `{"id":1`,
	} {
		if ev, ok := wholeAnswerEvents(apiChat, []byte(body), true); ok {
			t.Errorf("%s: made %q", body, ev)
		}
	}
	if ev, ok := wholeAnswerEvents(apiCompletions, []byte(`{"choices":[{"index":0,"message":{}}]}`), true); ok {
		t.Errorf("a chat answer made a completions stream: %q", ev)
	}
}

func TestIsJSONType(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/json": true, "Application/JSON; charset=utf-8": true, " application/problem+json ": true, "application/vnd.x+JSON;q=1": true,
		"text/event-stream": false, "text/event-stream; charset=utf-8": false, "": false, "+json": false, "application/jsonl": false, "text/plain": false,
	} {
		if got := isJSONType([]byte(ct)); got != want {
			t.Errorf("%q: %v", ct, got)
		}
	}
	if n := testing.AllocsPerRun(100, func() { isJSONType([]byte("text/event-stream; charset=utf-8")) }); n != 0 {
		t.Errorf("%v allocations", n)
	}
}

// A stream moving (limits.migration_limit) to an engine that answers the
// continuation with its whole answer as JSON goes on with that answer,
// streamed: the client gets every token once, one role and no error, and
// the engine stays in (the review: its raw JSON reached the client, and it
// was ejected).
func TestStreamMovesToAnEngineAnsweringWhole(t *testing.T) {
	dies := startFake(t, "dies", func(f *fakeEngine) { f.tokens, f.dieAfter = 10, 3 })
	next := jsonEngine(t, "application/json", "", `{"id":"c2","object":"chat.completion","created":9,"model":"engine-m","choices":[`+
		`{"index":0,"message":{"role":"assistant","content":"t3 t4"},"finish_reason":"stop"}],"usage":{"prompt_tokens":13,"completion_tokens":2,"total_tokens":15}}`)
	p := startProxyYAML(t, fmt.Sprintf(migrateYAML, "vllm", 1), dies, next)
	resp, body := post(t, p.url+"/v1/chat/completions", migrateBody)
	got := string(body)
	if resp.StatusCode != 200 || strings.Contains(got, "error") || !strings.HasSuffix(got, "data: [DONE]\n\n") ||
		!strings.Contains(got, `"content":"t3 t4"`) || strings.Count(got, `"role"`) != 1 || strings.Contains(got, `"object":"chat.completion"`) {
		t.Fatalf("status %d, stream:\n%s", resp.StatusCode, got)
	}
	if ejected(p, "next") {
		t.Fatalf("the engine that continued the stream is ejected:\n%s", p.logs.String())
	}
	p.waitIdle(t)
}

// A whole answer that stops coming mid-body is the engine gone silent: a
// 504 and an ejection for a timeout, as for a stream (the review: a 502
// and an ejection as a connection failure).
func TestWholeAnswerStallingIsATimeout(t *testing.T) {
	e := rawEngine(t, func(c net.Conn, rd *bufio.Reader) {
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(wholeChat), wholeChat[:40])
		time.Sleep(3 * time.Second) // past the timeout and its slack (backends.deadlineSlack)
	})
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {stream_idle_timeout: 300ms}\n", e)
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 504 || !strings.Contains(string(b), "sent nothing for 300ms (limits.stream_idle_timeout)") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
	if logs := p.logs.String(); !strings.Contains(logs, `"ejected_by":"timeout"`) {
		t.Fatalf("not ejected for a timeout:\n%s", logs)
	}
}

// A whole answer cut before its end has reached the client in no part: a
// request that may move (limits.migration_limit) goes whole to another
// engine, as one whose engine dropped it before answering does.
func TestWholeAnswerCutMovesWhole(t *testing.T) {
	cut := rawEngine(t, func(c net.Conn, rd *bufio.Reader) {
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(wholeChat), wholeChat[:40])
	})
	next := startFake(t, "next", func(f *fakeEngine) { f.tokens = 4 })
	p := startProxyYAML(t, strings.Replace(fmt.Sprintf(migrateYAML, "vllm", 1), "id: dies", "id: cut", 1), cut, next)
	resp, body := post(t, p.url+"/v1/chat/completions", migrateBody)
	if got := string(body); resp.StatusCode != 200 || strings.Contains(got, "error") || resp.Header.Get(WorkerHeader) != "next" ||
		strings.Count(got, `"content":"t`) != 4 || !strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Fatalf("%d from %q:\n%s", resp.StatusCode, resp.Header.Get(WorkerHeader), got)
	}
	p.waitIdle(t)
	if logs := p.logs.String(); !strings.Contains(logs, `"retried_after":"backend cut closed the connection before its answer was complete"`) {
		t.Fatalf("the engine that cut its answer was not tried first:\n%s", logs)
	}
}

// A whole answer to a streaming request is charged to limits.body_memory_mb
// while its stream lasts (read, and its events), and given back after: with
// the room held by other bodies the client gets 503 body_memory_full, and
// one larger than the whole budget a 502; the engine stays in.
func TestWholeJSONAnswerToStreamIsCharged(t *testing.T) {
	big := strings.Repeat("word ", 3<<20) // 15 MiB of content
	answer := `{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"` + big + `"},"finish_reason":"stop"}]}`
	e := jsonEngine(t, "application/json", "", answer)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {body_memory_mb: 256}\n", e)
	req := `POST /v1/chat/completions HTTP/1.1` + "\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, req, len(body), body)
	rd := bufio.NewReader(c)
	if line, err := rd.ReadString('\n'); err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
		t.Fatalf("%q %v", line, err)
	}
	// The client reads no more: the relay waits on it, the answer held.
	for deadline := time.Now().Add(5 * time.Second); p.s.bodyMem.Used() < 15<<20; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes charged while a 15 MiB answer streams", p.s.bodyMem.Used())
		}
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var rest bytes.Buffer
	for !bytes.HasSuffix(rest.Bytes(), []byte("data: [DONE]\n\n\r\n0\r\n\r\n")) {
		chunk := make([]byte, 1<<20)
		n, err := rd.Read(chunk)
		rest.Write(chunk[:n])
		if err != nil {
			t.Fatalf("%v after %d bytes", err, rest.Len())
		}
	}
	p.waitIdle(t)
	for deadline := time.Now().Add(5 * time.Second); p.s.bodyMem.Used() != 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes still charged after the stream", p.s.bodyMem.Used())
		}
	}

	// Others hold the room: 503, to retry.
	p.s.bodyMem.SetLimit(32 << 20)
	if !p.s.bodyMem.Take(24 << 20) {
		t.Fatal("could not take the room")
	}
	resp, b := post(t, p.url+"/v1/chat/completions", body)
	if resp.StatusCode != 503 || !strings.Contains(string(b), "body_memory_full") {
		t.Fatalf("with the room held: %d %.300s", resp.StatusCode, b)
	}
	p.s.bodyMem.Give(24 << 20)
	// Larger than the whole budget: 502.
	p.s.bodyMem.SetLimit(8 << 20)
	resp, b = post(t, p.url+"/v1/chat/completions", body)
	if resp.StatusCode != 502 || !strings.Contains(string(b), "larger than kvproxy holds at once") {
		t.Fatalf("over the budget: %d %.300s", resp.StatusCode, b)
	}
	p.waitIdle(t)
	if used := p.s.bodyMem.Used(); used != 0 {
		t.Fatalf("%d bytes charged after the refusals", used)
	}
	if ejected(p, "e0") {
		t.Fatal("the engine is ejected for kvproxy's want of room")
	}
}

// A 200 that is no answer, retried on another engine, gives back at once
// what its decoding held of limits.body_memory_mb: it stayed charged while
// the next engine worked, until the request ended.
func TestNoAnswerGivesBackItsDecoding(t *testing.T) {
	var z bytes.Buffer
	w := gzip.NewWriter(&z)
	w.Write([]byte("<html>" + strings.Repeat("<p>log in</p>", 300<<10) + "</html>")) // 3.9 MB
	w.Close()
	var asked atomic.Int64
	page := rawEngine(t, func(c net.Conn, rd *bufio.Reader) {
		asked.Add(1)
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s", z.Len(), z.String())
	})
	next := startFake(t, "next", func(f *fakeEngine) { f.prefillDelay = 500 * time.Millisecond })
	p := startProxyYAML(t, "models: [{name: m, aliases: [alias-m]}]\nbackends: [{id: page, url: 'http://{{e0}}', model: m}, {id: next, url: 'http://{{e1}}', model: m}]\nrouter: {policy: round_robin}\n", page, next)
	for range 2 { // one of them goes to the page first
		done := make(chan struct{})
		var peak int64
		go func() {
			defer close(done)
			for deadline := time.Now().Add(5 * time.Second); next.current.Load() == 0; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					peak = -1
					return
				}
			}
			time.Sleep(50 * time.Millisecond)
			peak = p.s.bodyMem.Used()
		}()
		resp, b := post(t, p.url+"/v1/chat/completions", chatBody)
		<-done
		if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "next" {
			t.Fatalf("%d from %q: %.200s", resp.StatusCode, resp.Header.Get(WorkerHeader), b)
		}
		if peak != 0 {
			t.Fatalf("%d bytes charged while the next engine worked", peak)
		}
	}
	if asked.Load() == 0 {
		t.Fatal("the page was never asked")
	}
}
