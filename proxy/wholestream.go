package proxy

import (
	"bytes"
	"strconv"
	"time"

	json "github.com/goccy/go-json"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
)

// Some OpenAI-compatible servers answer a streaming request with the whole
// answer as one JSON object (servers without streaming, or without it for
// some requests, and gateways in front of them). Relayed as a stream it was
// no answer at all: the client got an error event and the engine was
// ejected, though it had answered in full. kvproxy streams such an answer
// to the client as the engine would have: its choices as chunks, the usage
// chunk when the client asked for one, and [DONE].

// maxWholeAnswer bounds an answer read whole, as for non-streamed requests.
const maxWholeAnswer = 64 << 20

// isJSONType reports whether a Content-Type names JSON (application/json,
// or a +json type), in any case.
func isJSONType(ct []byte) bool {
	if i := bytes.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	ct = bytes.TrimSpace(ct)
	return bytes.EqualFold(ct, appJSON) || len(ct) > len(plusJSON) && bytes.EqualFold(ct[len(ct)-len(plusJSON):], plusJSON)
}

var appJSON, plusJSON = []byte("application/json"), []byte("+json")

// wholeAnswerEvents is the SSE stream of a whole chat or completions
// answer: one chunk per choice, holding all of its output (a chat choice's
// message becomes its delta, its tool calls indexed as in a stream), then
// the usage chunk if includeUsage, then [DONE]. Members keep the engine's
// order. An error object (as isErrorFrame knows one) becomes an error
// event, which the relay reads as it reads an engine's own. ok is false for
// anything else.
func wholeAnswerEvents(a api, body []byte, includeUsage bool) (events []byte, ok bool) {
	// One line per event: an engine's JSON may be pretty-printed.
	var compact bytes.Buffer
	if json.Compact(&compact, body) != nil {
		return nil, false
	}
	body = compact.Bytes()
	top, err := membersOf(body)
	if err != nil {
		return nil, false
	}
	if isErrorFrame(body) {
		return append(append(append([]byte("data: "), body...), "\n\n"...), doneEvent...), true
	}
	var choices []json.RawMessage
	if json.Unmarshal(top.get("choices"), &choices) != nil || len(choices) == 0 {
		return nil, false
	}
	object := `"text_completion"`
	if a == apiChat {
		object = `"chat.completion.chunk"`
	}
	usage := top.get("usage")
	top = top.without("usage")
	top.set("object", json.RawMessage(object))
	var out []byte
	for _, raw := range choices {
		c, err := membersOf(raw)
		if err != nil {
			return nil, false
		}
		if a == apiChat {
			delta, err := chunkDelta(c.get("message"))
			if err != nil {
				return nil, false
			}
			c.rename("message", "delta", delta)
		} else if c.get("text") == nil {
			return nil, false
		}
		top.set("choices", append(append([]byte{'['}, c.marshal()...), ']'))
		out = appendEvent(out, top.marshal())
	}
	if includeUsage && len(usage) > 0 && !bytes.Equal(usage, []byte("null")) {
		top.set("choices", json.RawMessage("[]"))
		top.set("usage", usage)
		out = appendEvent(out, top.marshal())
	}
	return append(out, doneEvent...), true
}

// chunkDelta is a chat message as a stream's delta: its tool calls get the
// index a stream gives each (the SDKs gather a call's parts by it).
func chunkDelta(msg json.RawMessage) (json.RawMessage, error) {
	m, err := membersOf(msg)
	if err != nil {
		return nil, err
	}
	if tc := bytes.TrimSpace(m.get("tool_calls")); len(tc) > 0 && !bytes.Equal(tc, []byte("null")) {
		var calls []json.RawMessage
		if err := json.Unmarshal(tc, &calls); err != nil {
			return nil, err
		}
		indexed := []byte{'['}
		for i, raw := range calls {
			c, err := membersOf(raw)
			if err != nil {
				return nil, err
			}
			if c.get("index") == nil {
				c = append(jsonObject{{"index", json.RawMessage(strconv.Itoa(i))}}, c...)
			}
			if i > 0 {
				indexed = append(indexed, ',')
			}
			indexed = append(indexed, c.marshal()...)
		}
		m.set("tool_calls", append(indexed, ']'))
	}
	return m.marshal(), nil
}

func appendEvent(out, chunk []byte) []byte {
	return append(append(append(out, "data: "...), chunk...), "\n\n"...)
}

// jsonObject is a JSON object's members in their order.
type jsonObject []member

type member struct {
	name  string // as written, without its quotes
	value json.RawMessage
}

// membersOf splits a JSON object into its members (names as they are
// written, escapes kept), with jsonscan's members.
func membersOf(b []byte) (jsonObject, error) {
	if !json.Valid(b) {
		return nil, errNotObject
	}
	var o jsonObject
	m := members{b: b}
	for m.next() {
		o = append(o, member{string(m.key), m.value})
	}
	return o, m.err
}

func (m jsonObject) get(name string) json.RawMessage {
	for _, x := range m {
		if x.name == name {
			return x.value
		}
	}
	return nil
}

// set replaces the member's value, or adds the member at the end.
func (m *jsonObject) set(name string, v json.RawMessage) {
	for i := range *m {
		if (*m)[i].name == name {
			(*m)[i].value = v
			return
		}
	}
	*m = append(*m, member{name, v})
}

func (m *jsonObject) rename(from, to string, v json.RawMessage) {
	for i := range *m {
		if (*m)[i].name == from {
			(*m)[i] = member{to, v}
		}
	}
}

func (m jsonObject) without(name string) jsonObject {
	var out jsonObject
	for _, x := range m {
		if x.name != name {
			out = append(out, x)
		}
	}
	return out
}

func (m jsonObject) marshal() []byte {
	out := []byte{'{'}
	for i, x := range m {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(append(append(append(out, '"'), x.name...), '"', ':'), x.value...)
	}
	return append(out, '}')
}

// wantsUsage reports whether a request body asks for the usage chunk
// (stream_options.include_usage), names read exactly.
func wantsUsage(body []byte) bool {
	top, err := membersOf(body)
	if err != nil {
		return false
	}
	opts, err := membersOf(top.get("stream_options"))
	return err == nil && bytes.Equal(bytes.TrimSpace(opts.get("include_usage")), []byte("true"))
}

// eventsBody serves a stream kvproxy made of a whole answer to the relay.
type eventsBody struct{ r bytes.Reader }

func newEventsBody(events []byte) *eventsBody {
	b := &eventsBody{}
	b.r.Reset(events)
	return b
}

func (b *eventsBody) Read(p []byte) (int, error) { return b.r.Read(p) }
func (b *eventsBody) Buffered() int              { return b.r.Len() }
func (b *eventsBody) Close()                     {}
func (b *eventsBody) EndBy(time.Duration)        {}

// prefixedBody is an engine's stream with the bytes read ahead of it (to
// see whether it began a JSON object) served first.
type prefixedBody struct {
	pre []byte
	err error // what the read ahead ended with, if it did
	streamBody
}

func (b *prefixedBody) Read(p []byte) (int, error) {
	if len(b.pre) > 0 {
		n := copy(p, b.pre)
		b.pre = b.pre[n:]
		return n, nil
	}
	if b.err != nil {
		return 0, b.err
	}
	return b.streamBody.Read(p)
}

func (b *prefixedBody) Buffered() int { return len(b.pre) + b.streamBody.Buffered() }

// streamOfWhole looks at the start of a JSON-typed answer to a streaming
// chat or completions request. A stream (some servers type theirs as JSON)
// is returned as it is, with the bytes read ahead; a whole answer is read
// and returned as the events of its stream. nil when the client has been
// answered otherwise (the read failed, or the answer is not one kvproxy can
// stream).
func (x *exchange) streamOfWhole(ctx *fasthttp.RequestCtx, stream *backends.Body, resp *fasthttp.Response, reqBody []byte) streamBody {
	b := x.b
	coding := bytes.TrimSpace(resp.Header.ContentEncoding())
	coded := len(coding) > 0 && !bytes.EqualFold(coding, []byte("identity"))
	var pre []byte
	var preErr error
	if !coded {
		pre, preErr = readStart(stream)
		if i := skipSpace(pre, 0); i >= len(pre) || pre[i] != '{' {
			return &prefixedBody{pre: pre, err: preErr, streamBody: stream}
		}
	}
	if !x.readWhole(ctx, stream, resp, pre, preErr, maxWholeAnswer+1) {
		return nil
	}
	body, enc := plainBody(resp)
	if len(body) > maxWholeAnswer || enc != nil {
		x.failUpstream(ctx, fasthttp.StatusBadGateway, "backend "+b.cfg.ID+" sent an answer kvproxy could not read")
		x.errMsg += ": a JSON answer to a streaming request, larger than 64 MiB or not decodable"
		return nil
	}
	if i := skipSpace(body, 0); coded && (i >= len(body) || body[i] != '{') {
		return newEventsBody(body) // a stream, compressed
	}
	var events []byte
	ok := false
	if x.api == apiChat || x.api == apiCompletions {
		events, ok = wholeAnswerEvents(x.api, body, wantsUsage(reqBody))
	}
	if !ok {
		msg := "backend " + b.cfg.ID + " answered a streaming request with a JSON body that is not a streamable answer; send the request unstreamed"
		x.failUpstream(ctx, fasthttp.StatusBadGateway, msg)
		return nil
	}
	x.wholeAnswer = true
	x.usage.read(body)
	if b.wholeAnswerSaid.CompareAndSwap(false, true) {
		b.log.Warn().Str("backend", b.cfg.ID).
			Msg("the engine answered a streaming request with its whole answer as JSON: kvproxy streams it to the client in one piece")
	}
	return newEventsBody(events)
}

// readStart reads an answer until its first byte that is not a space, or
// 512 bytes, or the end.
func readStart(stream streamBody) ([]byte, error) {
	buf := make([]byte, 0, 512)
	for {
		n, err := stream.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err != nil || skipSpace(buf, 0) < len(buf) || len(buf) == cap(buf) {
			return buf, err
		}
	}
}
