package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/router"
)

type memBody struct{ r *bytes.Reader }

func (m *memBody) Read(p []byte) (int, error) {
	// Engines send one event per write; reads see about one event each.
	if len(p) > 256 {
		p = p[:256]
	}
	return m.r.Read(p)
}
func (m *memBody) Close()              {}
func (m *memBody) Buffered() int       { return 0 }
func (m *memBody) EndBy(time.Duration) {}

// BenchmarkSSERelay measures the relay's own work per streamed event:
// framing, inspection (first token, output blocks), writing and flushing.
func BenchmarkSSERelay(b *testing.B) {
	const events = 256
	stream := chatStream(events)
	benchRelay(b, stream, events, func(*exchange) {}, func(x *exchange) string {
		if x.outputTokens != events {
			return fmt.Sprintf("counted %d tokens", x.outputTokens)
		}
		return ""
	})
}

// BenchmarkSSERelayMigratable is BenchmarkSSERelay for a stream that may be
// continued on another engine (limits.migration_limit): the relay keeps the
// text it passes on.
func BenchmarkSSERelayMigratable(b *testing.B) {
	const events = 256
	stream := chatStream(events)
	benchRelay(b, stream, events, func(x *exchange) { x.mig, x.migrations = &migration{chat: true, partial: make([]byte, 0, 1024)}, 1 }, func(x *exchange) string {
		if x.outputTokens != events || !bytes.HasSuffix(x.mig.partial, []byte(" tok255")) {
			return fmt.Sprintf("counted %d tokens, kept %q", x.outputTokens, x.mig.partial)
		}
		return ""
	})
}

// chatStream is a chat stream of n one-token chunks and [DONE], as vLLM
// sends it.
func chatStream(n int) []byte {
	var stream bytes.Buffer
	for i := 0; i < n; i++ {
		fmt.Fprintf(&stream, `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" tok%d"},"logprobs":null,"finish_reason":null}]}`+"\n\n", i)
	}
	stream.WriteString("data: [DONE]\n\n")
	return stream.Bytes()
}

// benchRelay relays raw, an engine's stream of events, through a new
// exchange set up by setup in each iteration; check says what is wrong
// with the exchange afterwards ("" for nothing).
func benchRelay(b *testing.B, raw []byte, events int, setup func(*exchange), check func(*exchange) string) {
	s, p, be := relayFixture(b)
	w := bufio.NewWriterSize(io.Discard, 4096)
	req := router.Request{PromptTokens: 100}
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		_, active, _ := p.rt.Route(&req)
		// One choice, as most requests ask (a stream of several choices
		// follows each chunk's choice: noteChoice).
		x := &exchange{s: s, p: p, b: be, active: active, ab: &backends.Abort{}, stream: true, usage: tokenUsage{-1, -1, -1}, choices: 1}
		setup(x)
		s.live.add(x)
		rl := newRelay(x, &memBody{bytes.NewReader(raw)}, fasthttp.AcquireResponse())
		if _, err := rl.WriteTo(w); err != nil {
			b.Fatal(err)
		}
		rl.Close()
		if msg := check(x); msg != "" {
			b.Fatal(msg)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*events), "ns/event")
}

// BenchmarkParseChat8k parses an 8k-token chat request (about 32 KiB).
func BenchmarkParseChat8k(b *testing.B) {
	body := []byte(`{"model":"m","stream":true,"max_tokens":128,"messages":[{"role":"system","content":"` +
		strings.Repeat("You are a helpful assistant. ", 400) + `"},{"role":"user","content":"` + strings.Repeat("Tell me more. ", 600) + `"}]}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		req, pe := parseRequest(body, true)
		if pe != nil {
			b.Fatal(pe.msg)
		}
		if _, err := req.forwardBody(nil, "served", "salt"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkParseChatSmall parses and re-encodes BenchmarkProxyChat's request,
// reusing the request as the handler does.
func BenchmarkParseChatSmall(b *testing.B) {
	body := []byte(`{"model":"m","max_tokens":1,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hi to the whole wide world, please."}]}`)
	var req apiRequest
	var out []byte
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		req.reset()
		if pe := req.parse(body, true); pe != nil {
			b.Fatal(pe.msg)
		}
		var err error
		if out, err = req.forwardBody(out[:0], "served", "salt"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkParseChatImage1MB parses a chat request with a 1 MB photo as a
// data: URL, which the routed prompt replaces by a digest of the URL.
func BenchmarkParseChatImage1MB(b *testing.B) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is this?"},` +
		`{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,` + strings.Repeat("QUJD", 250_000) + `"}}]}]}`)
	var req apiRequest
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		req.reset()
		if pe := req.parse(body, true); pe != nil {
			b.Fatal(pe.msg)
		}
	}
}

// BenchmarkSSERelayResponses relays a streamed response as vLLM sends it
// (event: lines, a delta per token, the response object at both ends),
// rewriting its ids; compare ns/event with BenchmarkSSERelay.
func BenchmarkSSERelayResponses(b *testing.B) {
	const tokens = 256
	obj := `{"id":"resp_0123456789abcdef0123456789abcdef","created_at":1,"instructions":null,"model":"m","object":"response","output":[],"status":"in_progress","usage":null}`
	var stream bytes.Buffer
	seq := 0
	event := func(typ, fields string) {
		fmt.Fprintf(&stream, "event: %s\ndata: {%s\"sequence_number\":%d,\"type\":%q}\n\n", typ, fields, seq, typ)
		seq++
	}
	event("response.created", `"response":`+obj+`,`)
	event("response.in_progress", `"response":`+obj+`,`)
	event("response.output_item.added", `"item":{"id":"msg_1","content":[],"role":"assistant","status":"in_progress","type":"message"},"output_index":0,`)
	for i := 0; i < tokens; i++ {
		event("response.output_text.delta", fmt.Sprintf(`"content_index":0,"delta":" tok%d","item_id":"msg_1","logprobs":[],"output_index":0,`, i))
	}
	event("response.output_text.done", `"content_index":0,"item_id":"msg_1","logprobs":[],"output_index":0,"text":"...",`)
	event("response.completed", `"response":`+strings.Replace(obj, `"usage":null`, `"usage":{"input_tokens":100,"input_tokens_details":{"cached_tokens":64},"output_tokens":256,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":356}`, 1)+`,`)
	macs := newRespMACs([]byte("k")) // one per configuration
	benchRelay(b, stream.Bytes(), seq, func(x *exchange) {
		x.resp, x.api = &respIDs{signer: respSigner{macs: macs, backend: "b"}}, apiResponses
	}, func(x *exchange) string {
		if x.outputTokens != tokens || x.usage.completion != tokens || x.resp.orig == nil || x.errMsg != "" {
			return fmt.Sprintf("counted %d tokens, usage %+v, id %s, error %q", x.outputTokens, x.usage, x.resp.orig, x.errMsg)
		}
		return ""
	})
}

// BenchmarkParseResponsesSmall parses and re-encodes a small Responses
// request (instructions and a string input), as BenchmarkParseChatSmall.
func BenchmarkParseResponsesSmall(b *testing.B) {
	benchParse(b, []byte(`{"model":"m","max_output_tokens":1,"instructions":"You are terse.","input":"Say hi to the whole wide world, please."}`), (*apiRequest).parseResponses)
}

// benchParse parses body with parse and makes the engine body, reusing
// the request as the handler does.
func benchParse(b *testing.B, body []byte, parse func(*apiRequest, []byte) *paramError) {
	var req apiRequest
	var out []byte
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		req.reset()
		if pe := parse(&req, body); pe != nil {
			b.Fatal(pe.msg)
		}
		var err error
		if out, err = req.forwardBody(out[:0], "served", "salt"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSSERelayMessages relays a streamed Anthropic message as vLLM
// sends it (event: lines, a content_block_delta per token, usage at both
// ends, [DONE]); compare ns/event with BenchmarkSSERelay.
func BenchmarkSSERelayMessages(b *testing.B) {
	const tokens = 256
	var stream bytes.Buffer
	event := func(typ, data string) { fmt.Fprintf(&stream, "event: %s\ndata: %s\n\n", typ, data) }
	event("message_start", `{"type":"message_start","message":{"id":"chatcmpl-1","type":"message","role":"assistant","content":[],"model":"m","usage":{"input_tokens":100,"output_tokens":0}}}`)
	event("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`)
	for i := 0; i < tokens; i++ {
		event("content_block_delta", fmt.Sprintf(`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" tok%d"}}`, i))
	}
	event("content_block_stop", `{"type":"content_block_stop","index":0}`)
	event("message_delta", `{"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":100,"output_tokens":256}}`)
	event("message_stop", `{"type":"message_stop"}`)
	stream.WriteString("data: [DONE]\n\n")
	benchRelay(b, stream.Bytes(), tokens+6, func(x *exchange) { x.api = apiMessages }, func(x *exchange) string {
		if x.outputTokens != tokens || x.usage.completion != tokens || x.errMsg != "" {
			return fmt.Sprintf("counted %d tokens, usage %+v, error %q", x.outputTokens, x.usage, x.errMsg)
		}
		return ""
	})
}

// BenchmarkParseMessagesAgentTurn parses an agent's turn in Anthropic's
// shape (system blocks, a tool call and its result, two tools), as Claude
// Code sends it, with the engine body.
func BenchmarkParseMessagesAgentTurn(b *testing.B) {
	body := []byte(`{"model":"m","max_tokens":1024,"stream":true,"system":[{"type":"text","text":"You are an agent.","cache_control":{"type":"ephemeral"}}],` +
		`"messages":[{"role":"user","content":"List the files."},{"role":"assistant","content":[{"type":"text","text":"Listing."},{"type":"tool_use","id":"toolu_1","name":"bash","input":{"command":"ls -la","timeout":30.5}}]},` +
		`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"a.go\nb.go"}]},{"type":"text","text":"Now read a.go."}]}],` +
		`"tools":[{"name":"bash","description":"Run a command","input_schema":{"type":"object","properties":{"command":{"type":"string"}}}},{"name":"read","input_schema":{"properties":{"path":{"type":"string"}}}}]}`)
	benchParse(b, body, func(r *apiRequest, body []byte) *paramError { return r.parseAnthropic(body, false) })
}
