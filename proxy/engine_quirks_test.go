package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

// streamEnd is how chunkedEngine's stream ends.
type streamEnd int

const (
	endClean streamEnd = iota // the chunked terminator
	endReset                  // the connection reset
	endCut                    // the connection closed, no terminator
	endHold                   // open until kvproxy closes it
)

// chunkedEngine answers every request with a chunked 200 event stream
// holding events (as one chunk, framing included, if any), ended as end
// says.
func chunkedEngine(t *testing.T, events string, end streamEnd) *fakeEngine {
	return rawEngine(t, func(c net.Conn, rd *bufio.Reader) {
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		if events != "" {
			fmt.Fprintf(c, "%x\r\n%s\r\n", len(events), events)
		}
		switch end {
		case endClean:
			c.Write([]byte("0\r\n\r\n"))
		case endReset:
			c.(*net.TCPConn).SetLinger(0) // the close sends RST
		case endHold:
			io.Copy(io.Discard, rd)
		}
	})
}

// quirkEngine is chunkedEngine ending cleanly, or with a reset.
func quirkEngine(t *testing.T, events string, reset bool) *fakeEngine {
	if reset {
		return chunkedEngine(t, events, endReset)
	}
	return chunkedEngine(t, events, endClean)
}

const (
	quirkRole  = `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`
	quirkToken = `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}`
	quirkLast  = `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" end"},"finish_reason":"stop"}]}`
)

// Answers the OpenAI SDKs take as complete, from engines that end them in
// ways of their own: each reaches the client whole, ends with one [DONE] and
// no error event, and leaves the engine in (each was a "failed mid-stream",
// an error event after the answer and the engine ejected; the quirks trial).
func TestEngineStreamEndingsTheSDKsAccept(t *testing.T) {
	for _, tc := range []struct {
		name, events string
		reset        bool
	}{
		// The connection reset right after [DONE], before the chunked end.
		{"reset after [DONE]", "data: " + quirkRole + "\n\ndata: " + quirkLast + "\n\ndata: [DONE]\n\n", true},
		// [DONE] without its blank line, and the body ends.
		{"[DONE] unterminated", "data: " + quirkRole + "\n\ndata: " + quirkLast + "\n\ndata: [DONE]", false},
		{"[DONE] with one line end", "data: " + quirkRole + "\n\ndata: " + quirkLast + "\n\ndata: [DONE]\n", false},
		// The last chunk (with its finish_reason) ends in one \n, no [DONE].
		{"last chunk with one line end", "data: " + quirkRole + "\n\ndata: " + quirkToken + "\n\ndata: " + quirkLast + "\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := quirkEngine(t, tc.events, tc.reset)
			p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
			resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
			out := string(b)
			if resp.StatusCode != 200 || strings.Contains(out, "error") || !strings.Contains(out, `" end"`) ||
				!strings.HasSuffix(out, "}\n\ndata: [DONE]\n\n") || strings.Count(out, "[DONE]") != 1 {
				t.Fatalf("%d\n%q", resp.StatusCode, out)
			}
			if ejected(p, "e0") {
				t.Fatalf("the engine is ejected: %s", p.logs.String())
			}
			p.waitIdle(t)
			if logs := p.logs.String(); strings.Contains(logs, "failed mid-stream") {
				t.Fatalf("logged as a failure: %s", logs)
			}
		})
	}
}

// A body cut inside its last event is still a failure: only an event whose
// lines all ended is taken as whole. The engine is ejected, but not a
// model's only one (nor more than half), as for its error answers: a
// gateway cutting long answers took a model out for everyone, the
// engine's probe passing (the SDK trial).
func TestStreamCutInsideAnEventStillFails(t *testing.T) {
	for _, only := range []bool{false, true} {
		e := quirkEngine(t, "data: "+quirkRole+"\n\ndata: "+quirkLast[:40], false)
		yaml := "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}, {id: e1, url: 'http://127.0.0.1:1', model: m}]\n"
		if only {
			yaml = "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n"
		}
		p := startProxyYAML(t, yaml, e)
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"nvext":{"backend_instance_id":"e0"}}`)
		if out := string(b); resp.StatusCode != 200 || !strings.Contains(out, `"code":"backend_failed"`) || strings.Count(out, `data: {"id"`) != 1 {
			t.Fatalf("%d\n%q", resp.StatusCode, out)
		}
		if ejected(p, "e0") == only {
			t.Fatalf("the model's only engine %v, ejected %v: %s", only, !only, p.logs.String())
		}
		if kept := strings.Contains(p.logs.String(), "backend dropped a request it took, and is kept in"); kept != only {
			t.Fatalf("the model's only engine %v, said kept in %v: %s", only, kept, p.logs.String())
		}
		p.waitIdle(t)
	}
}

// TGI's error frame ({"error": "...", "error_type": ...}), and a body that
// ends after it without [DONE] (TGI before mid-2024): the client gets the
// error in OpenAI's shape and a [DONE]; the engine answered, so it is
// neither ejected nor the request moved to another one (a client's bad
// request took out every engine it was moved to).
func TestTGIErrorFrameEndsTheStream(t *testing.T) {
	frame := "{\"error\":\"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`\",\"error_type\":\"validation\"}"
	e0 := quirkEngine(t, "data: "+frame+"\n\n", false)
	e1 := quirkEngine(t, "data: "+frame+"\n\n", false)
	e1.id = "e1"
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}, {id: e1, url: 'http://{{e1}}', model: m}]\n"+
		"router: {policy: round_robin}\nlimits: {migration_limit: 1}\n", e0, e1)
	for i := 0; i < 2*errorAnswerLimit; i++ {
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
		out := string(b)
		want := "data: {\"error\":{\"message\":\"Input validation error: `inputs` tokens + `max_new_tokens` must be \\u003c= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`\"," +
			"\"type\":\"invalid_request_error\",\"param\":null,\"code\":\"context_length_exceeded\"}}\n\ndata: [DONE]\n\n"
		if resp.StatusCode != 200 || out != want {
			t.Fatalf("request %d: %d\n%q\nwant\n%q", i, resp.StatusCode, out, want)
		}
	}
	if ejected(p, "e0") || ejected(p, "e1") {
		t.Fatalf("an engine that answered with an error is ejected: %s", p.logs.String())
	}
	p.waitIdle(t)
	if logs := p.logs.String(); strings.Contains(logs, "failed mid-stream") || strings.Contains(logs, "migrat") {
		t.Fatalf("logged as a failure, or moved: %s", logs)
	}
}

// TGI sends a stream's usage in the chunk of its last token, not after it:
// kvproxy meters the engine's count, not its own estimate.
func TestUsageWithTheLastToken(t *testing.T) {
	last := `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":" end"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1234,"completion_tokens":11,"total_tokens":1245}}`
	e := quirkEngine(t, "data: "+quirkToken+"\n\ndata: "+last+"\n\ndata: [DONE]\n\n", false)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
	m := p.metrics(t)
	if !strings.Contains(m, `kvproxy_tokens_total{model="m",tenant="",type="prompt"} 1234`+"\n") || !strings.Contains(m, `kvproxy_tokens_total{model="m",tenant="",type="completion"} 11`+"\n") {
		t.Fatalf("want the engine's usage (1234 prompt, 11 completion tokens):\n%s", grepLines(m, "kvproxy_tokens_total{"))
	}
}

// An error frame of the engine's own making (TGI's generation error: CUDA
// out of memory) counts against it as a 500 answer does: an engine that
// fails every stream so is ejected after errorAnswerLimit in a row (the
// first version took any error frame for a success; the re-review). One
// of the request's making (TestTGIErrorFrameEndsTheStream) does not.
func TestEngineErrorFramesCountAgainstTheEngine(t *testing.T) {
	frame := `{"error":"Request failed during generation: Server error: CUDA out of memory","error_type":"generation"}`
	e0 := quirkEngine(t, "data: "+quirkRole+"\n\ndata: "+quirkToken+"\n\ndata: "+frame+"\n\n", false)
	e1 := startFake(t, "e1", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}, {id: e1, url: 'http://{{e1}}', model: m}]\n"+
		"health: {eject_base: 1m, eject_max: 1m}\n", e0, e1)
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"nvext":{"backend_instance_id":"e0"}}`
	for i := 0; i < errorAnswerLimit; i++ {
		resp, b := post(t, p.url+"/v1/chat/completions", body)
		if out := string(b); resp.StatusCode != 200 || !strings.Contains(out, `"message":"Request failed during generation: Server error: CUDA out of memory","type":"server_error"`) ||
			!strings.HasSuffix(out, "data: [DONE]\n\n") {
			t.Fatalf("stream %d: %d %s", i, resp.StatusCode, out)
		}
	}
	if !ejected(p, "e0") {
		t.Fatalf("%d streams in a row ended by the engine's own error, and it is still in", errorAnswerLimit)
	}
	p.waitIdle(t)
}

// An answer to a stream request that is no event stream (an HTML page of a
// gateway in front of the engine, Ollama's NDJSON) is no stream: the client
// gets kvproxy's 502 in OpenAI's shape, not a 200 with the page's bytes and
// an error event, and the engine is not taken for a dead one (a model's
// only one was ejected, and its next requests got 503s). A request that may
// go elsewhere goes to the next engine. A stream typed as no stream (Flask's
// default text/html, an octet-stream, text/plain) or not typed is an event
// stream all the same when its bytes are: it is relayed, as before (the
// second quirks trial: typed so, they were refused).
func TestStreamThatIsNoEventStream(t *testing.T) {
	const sse = "data: " + quirkLast + "\n\ndata: [DONE]\n\n"
	typed := func(ct, body string) *fakeEngine {
		return rawEngine(t, func(c net.Conn, _ *bufio.Reader) {
			header := ""
			if ct != "" {
				header = "Content-Type: " + ct + "\r\n"
			}
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s", header, len(body), body)
		})
	}
	const page = "\n <html><body>Bad gateway</body></html>"
	const req = `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`
	for ct, body := range map[string]string{"text/html; charset=utf-8": page, "application/x-ndjson": `{"message":{"content":"hi"},"done":false}` + "\n",
		"application/octet-stream": `[{"a":1}]`, "text/html": "\xef\xbb\xbf" + page} {
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", typed(ct, body))
		for range 4 { // past the error answers' streak of 3
			resp, b := post(t, p.url+"/v1/chat/completions", req)
			if out := string(b); resp.StatusCode != 502 || !strings.Contains(out, `"code":"backend_failed"`) || strings.Contains(out, "<html>") ||
				!strings.Contains(out, "no event stream") || strings.HasPrefix(out, "data:") {
				t.Fatalf("%s: %d\n%s", ct, resp.StatusCode, out)
			}
		}
		if ejected(p, "e0") {
			t.Fatalf("%s: a model's only engine is ejected: %s", ct, p.logs.String())
		}
		p.waitIdle(t)
	}
	p := startProxyYAML(t, "models: [{name: m}]\nrouter: {policy: round_robin}\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}, {id: e1, url: 'http://{{e1}}', model: m}]\n",
		typed("text/html", page), typed("text/plain", sse))
	for range 4 {
		if resp, b := post(t, p.url+"/v1/chat/completions", req); resp.StatusCode != 200 || !strings.Contains(string(b), `" end"`) {
			t.Fatalf("with another engine: %d\n%s", resp.StatusCode, b)
		}
	}
	p.waitIdle(t)
	for _, ct := range []string{"", "text/html", "application/octet-stream"} {
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", typed(ct, sse))
		if resp, b := post(t, p.url+"/v1/chat/completions", req); resp.StatusCode != 200 || string(b) != sse {
			t.Fatalf("an event stream typed %q: %d\n%q", ct, resp.StatusCode, b)
		}
		p.waitIdle(t)
	}
}

// A 200 to a request not streamed whose body is no JSON answer (a
// gateway's login page, text, nothing, a body cut off, bytes) is a 502,
// not relayed as the answer; the request goes to the next engine, and the
// engine is counted as answering in error (it was relayed as a success,
// and the engine, fastest to answer, drew the traffic: the chaos trial).
func TestWholeAnswerThatIsNoJSON(t *testing.T) {
	answering := func(ct, body string, framed bool) *fakeEngine {
		return rawEngine(t, func(c net.Conn, _ *bufio.Reader) {
			if framed {
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s", ct, len(body), body)
			} else { // ended by closing the connection
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: %s\r\nConnection: close\r\n\r\n%s", ct, body)
			}
		})
	}
	const req = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	for _, c := range []struct {
		ct, body string
		framed   bool
	}{
		{"text/html", "<html><body>Sign in</body></html>", true},
		{"text/plain", "upstream connect error", true},
		{"application/json", "", true},
		{"application/json", "", false},
		{"application/json", `{"id":"x","object":"chat.comp`, false},
		{"application/octet-stream", "\x00\xff\xfe junk", true},
	} {
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", answering(c.ct, c.body, c.framed))
		for range 4 { // past the error answers' streak of 3
			resp, b := post(t, p.url+"/v1/chat/completions", req)
			if out := string(b); resp.StatusCode != 502 || !strings.Contains(out, `"code":"backend_failed"`) || !strings.Contains(out, "no JSON answer") ||
				(c.body != "" && strings.Contains(out, c.body)) {
				t.Fatalf("%q: %d\n%s", c.body, resp.StatusCode, out)
			}
		}
		if !strings.Contains(p.logs.String(), "no JSON answer") {
			t.Fatalf("%q: not counted against the engine: %s", c.body, p.logs.String())
		}
		p.waitIdle(t)
	}
	// Compressed: whole, it is the answer; cut off, it is none (it went
	// out as a 200 the client could not decompress: the review).
	zipped := string(fasthttp.AppendGzipBytes(nil, []byte(`{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`)))
	for _, whole := range []bool{true, false} {
		body := zipped
		if !whole {
			body = zipped[:len(zipped)/2]
		}
		e := rawEngine(t, func(c net.Conn, _ *bufio.Reader) {
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		})
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
		resp, b := post(t, p.url+"/v1/chat/completions", req)
		if whole && (resp.StatusCode != 200 || !strings.Contains(string(b), `"content":"hi"`)) || !whole && (resp.StatusCode != 502 || !strings.Contains(string(b), "no JSON answer")) {
			t.Fatalf("gzip, whole %v: %d %q", whole, resp.StatusCode, b)
		}
		p.waitIdle(t)
	}
	p := startProxyYAML(t, "models: [{name: m}]\nrouter: {policy: round_robin}\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}, {id: e1, url: 'http://{{e1}}', model: m}]\n",
		answering("text/html", "<html>Sign in</html>", true), startFake(t, "e1", nil))
	for range 4 {
		if resp, b := post(t, p.url+"/v1/chat/completions", req); resp.StatusCode != 200 || !strings.Contains(string(b), `"choices"`) {
			t.Fatalf("with another engine: %d\n%s", resp.StatusCode, b)
		}
	}
	p.waitIdle(t)
}

// A stream typed as an event stream whose first bytes hold no event (no
// data, event, id or retry line, no comment: junk, a page) is a 502, the
// engine counted as answering in error; the bytes reach no client (the
// chaos trial: they went out in a 200, NULs and all).
func TestEventStreamOfNoEvents(t *testing.T) {
	for in, want := range map[string]bool{"data: x": true, ": ping": true, "event: a\ndata: b": true, "id:1": true, "retry: 5": true,
		"data": true, "junk\r\ndata: x": true, " data: x": true, "junk": false, "\x00\xff\xfe": false, "Data: x": false, "<html>": false} {
		if hasSSEField([]byte(in)) != want {
			t.Errorf("hasSSEField(%q) = %v", in, !want)
		}
	}
	const junk = "\x00\xff\xfegarbage\r\n\r\ndata: " + quirkLast + "\n\ndata: [DONE]\n\n"
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", quirkEngine(t, junk, false))
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if out := string(b); resp.StatusCode != 502 || !strings.Contains(out, `"code":"backend_failed"`) || strings.Contains(out, "garbage") {
		t.Fatalf("%d\n%q", resp.StatusCode, out)
	}
	if !strings.Contains(p.logs.String(), "bytes that hold no event") {
		t.Fatalf("not counted against the engine: %s", p.logs.String())
	}
	p.waitIdle(t)
	// A stream beginning with a byte order mark (which SSE strips), or
	// with an event of blanks (which it ignores), is one (the review).
	for _, opening := range []string{"\xef\xbb\xbf", "   \n\n"} {
		stream := opening + "data: " + quirkRole + "\n\ndata: " + quirkLast + "\n\ndata: [DONE]\n\n"
		p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", quirkEngine(t, stream, false))
		if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 || !strings.Contains(string(b), `" end"`) {
			t.Fatalf("opening %q: %d %q", opening, resp.StatusCode, b)
		}
		p.waitIdle(t)
	}
}

// An engine's error answer over 1 MiB once decompressed (a gateway's
// gzip of a 400 quoting a long prompt) keeps the engine's words: decoded
// to 1 MiB only, they became "bytes that are no text" (the review).
func TestLargeCompressedErrorKeepsItsMessage(t *testing.T) {
	msg := "prompt: " + strings.Repeat("x", 2<<20)
	zipped := fasthttp.AppendGzipBytes(nil, []byte(fmt.Sprintf(`{"error":{"message":%q,"type":"BadRequestError","param":null,"code":400}}`, msg)))
	e := rawEngine(t, func(c net.Conn, _ *bufio.Reader) {
		fmt.Fprintf(c, "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s", len(zipped), zipped)
	})
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 400 || !strings.Contains(string(b), `"message":"prompt: xxxx`) {
		t.Fatalf("%d %.200q", resp.StatusCode, b)
	}
	p.waitIdle(t)
	if used := p.s.bodyMem.Used(); used != 0 {
		t.Fatalf("%d still charged", used)
	}
}
