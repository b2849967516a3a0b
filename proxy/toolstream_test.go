package proxy

import (
	"bufio"
	"bytes"
	"io"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/router"
)

// relayed relays raw, an engine's stream for api, through a relay and
// returns the exchange it recorded.
func relayed(t *testing.T, api api, raw string) *exchange {
	t.Helper()
	s, p, be := relayFixture(t)
	_, active, _ := p.rt.Route(&router.Request{PromptTokens: 10})
	x := &exchange{s: s, p: p, b: be, active: active, ab: &backends.Abort{}, stream: true, usage: tokenUsage{-1, -1, -1}, api: api}
	if api == apiResponses {
		x.resp = &respIDs{signer: respSigner{macs: newRespMACs([]byte("k")), backend: "b"}}
	}
	s.live.add(x)
	rl := newRelay(x, &memBody{bytes.NewReader([]byte(raw))}, fasthttp.AcquireResponse())
	if _, err := rl.WriteTo(bufio.NewWriter(io.Discard)); err != nil {
		t.Fatal(err)
	}
	rl.Close()
	return x
}

// An agent's turn streams reasoning and a tool call's arguments, not
// text: they are output all the same, the first of them the end of the
// prefill, and the stream ends cleanly.
func TestToolCallStreamsCountAsOutput(t *testing.T) {
	responses := "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\"}}\n\n" +
		"event: response.reasoning_text.delta\ndata: {\"type\":\"response.reasoning_text.delta\",\"delta\":\"think\"}\n\n" +
		"event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"function_call\",\"name\":\"f\",\"arguments\":\"\"}}\n\n" +
		"event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{\\\"x\\\":\"}\n\n" +
		"event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"1}\"}\n\n" +
		"event: response.function_call_arguments.done\ndata: {\"type\":\"response.function_call_arguments.done\",\"arguments\":\"{\\\"x\\\":1}\"}\n\n" +
		"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"usage\":{\"input_tokens\":9,\"output_tokens\":3}}}\n\n"
	messages := "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":0}}}\n\n" +
		"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"think\"}}\n\n" +
		"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n" +
		"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"f\",\"input\":{}}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"x\\\":\"}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"1}\"}}\n\n" +
		"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":1}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"},\"usage\":{\"input_tokens\":9,\"output_tokens\":3}}\n\n" +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
	for name, c := range map[string]struct {
		api api
		raw string
	}{"responses": {apiResponses, responses}, "messages": {apiMessages, messages}} {
		x := relayed(t, c.api, c.raw)
		if x.outputTokens != 3 || x.ttft == 0 || x.errMsg != "" || x.usage.prompt != 9 || x.usage.completion != 3 {
			t.Errorf("%s: %d output events, ttft %v, error %q, usage %+v", name, x.outputTokens, x.ttft, x.errMsg, x.usage)
		}
	}
}

// pacedBody is an engine's stream read one piece at a time, each piece
// after its delay.
type pacedBody struct {
	pieces []string
	delays []time.Duration
}

func (p *pacedBody) Read(b []byte) (int, error) {
	if len(p.pieces) == 0 {
		return 0, io.EOF
	}
	time.Sleep(p.delays[0])
	n := copy(b, p.pieces[0])
	p.pieces[0] = p.pieces[0][n:]
	if p.pieces[0] == "" {
		p.pieces, p.delays = p.pieces[1:], p.delays[1:]
	}
	return n, nil
}
func (p *pacedBody) Close()              {}
func (p *pacedBody) Buffered() int       { return 0 }
func (p *pacedBody) EndBy(time.Duration) {}

// Azure OpenAI's first chunk carries only the prompt's filter results,
// with no choices, as soon as the request is taken: the prefill ends with
// the first chunk that has a choice, not with it (it ended it, and the TTFT
// read tens of milliseconds for a prefill of seconds).
func TestChunkWithoutChoicesDoesNotEndThePrefill(t *testing.T) {
	s, p, be := relayFixture(t)
	_, active, _ := p.rt.Route(&router.Request{PromptTokens: 10})
	x := &exchange{s: s, p: p, b: be, active: active, ab: &backends.Abort{}, stream: true, usage: tokenUsage{-1, -1, -1}, api: apiChat, choices: 1,
		start: time.Now(), sent: time.Now()}
	s.live.add(x)
	const prefill = 150 * time.Millisecond
	body := &pacedBody{
		pieces: []string{
			`data: {"choices":[],"created":0,"id":"","model":"","object":"","prompt_filter_results":[{"prompt_index":0,"content_filter_results":{}}]}` + "\n\n",
			`data: {"choices":[{"delta":{"role":"assistant","content":"Hi"},"finish_reason":null,"index":0}],"id":"c","object":"chat.completion.chunk"}` + "\n\n" +
				`data: {"choices":[{"delta":{},"finish_reason":"stop","index":0}],"id":"c","object":"chat.completion.chunk"}` + "\n\n" +
				`data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}` + "\n\ndata: [DONE]\n\n",
		},
		delays: []time.Duration{0, prefill},
	}
	rl := newRelay(x, body, fasthttp.AcquireResponse())
	if _, err := rl.WriteTo(bufio.NewWriter(io.Discard)); err != nil {
		t.Fatal(err)
	}
	rl.Close()
	if x.ttft < prefill || x.outputTokens != 1 || x.errMsg != "" || x.usage.completion != 1 {
		t.Fatalf("ttft %v (the first choice came after %v), %d output events, error %q, usage %+v", x.ttft, prefill, x.outputTokens, x.errMsg, x.usage)
	}
}
