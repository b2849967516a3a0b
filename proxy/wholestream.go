package proxy

import (
	"bytes"
	"errors"
	"io"
	"strconv"
	"time"

	json "github.com/goccy/go-json"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
)

// Some OpenAI-compatible servers answer a streaming request with the whole
// answer as one JSON object (servers without streaming, or without it for
// some requests, and gateways in front of them). Relayed as a stream it
// would be no answer at all: an error event for the client and an ejection
// for an engine that answered in full. kvproxy streams such an answer to
// the client as the engine would have (forward, and a migrated stream's
// continuation): its choices as chunks, the usage chunk when the client
// asked for one, and [DONE].

// maxWholeAnswer bounds an answer read whole, as for non-streamed requests.
const maxWholeAnswer = 64 << 20

// isJSONType reports whether a Content-Type names JSON (application/json,
// or a +json type), in any case.
func isJSONType(ct []byte) bool {
	ct = mediaType(ct)
	return bytes.EqualFold(ct, appJSON) || len(ct) > len(plusJSON) && bytes.EqualFold(ct[len(ct)-len(plusJSON):], plusJSON)
}

var appJSON, plusJSON = []byte("application/json"), []byte("+json")

// sniffStream looks at the first bytes of an engine's 200 to a stream
// request typed as neither an event stream nor JSON (ct): some servers
// leave their streams so (Flask's text/html, aiohttp's octet-stream), so
// the type alone does not refuse one. It reports whether the bytes show no
// stream (a page's '<', JSON's '{' or '['), and returns the stream to
// relay, those bytes first. A read that fails is left to the relay.
func sniffStream(stream *backends.Body, ct []byte) (streamBody, bool) {
	if isJSONType(ct) || mayBeEventStream(ct) {
		return stream, false
	}
	head, err := readStart(stream)
	t := bytes.TrimPrefix(head, utf8BOM)
	if i := skipSpace(t, 0); i < len(t) && (t[i] == '<' || t[i] == '{' || t[i] == '[') {
		return stream, true
	}
	return &prefixedBody{pre: head, err: err, streamBody: stream}, false
}

// mayBeEventStream reports whether an answer of Content-Type ct may be an
// SSE stream: text/event-stream, or none, or text/plain (the default type
// of some servers, which may leave their streams typed so).
func mayBeEventStream(ct []byte) bool {
	ct = mediaType(ct)
	return len(ct) == 0 || bytes.EqualFold(ct, eventStreamType) || bytes.EqualFold(ct, textPlainType)
}

// mediaType is a Content-Type without its parameters.
func mediaType(ct []byte) []byte {
	if i := bytes.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	return bytes.TrimSpace(ct)
}

var eventStreamType, textPlainType = []byte("text/event-stream"), []byte("text/plain")

// looksLikeJSONObject reports whether b, an engine's whole answer, has the ends of
// a JSON object (a full parse is left to the client: the check is for
// what is no answer at all).
func looksLikeJSONObject(b []byte) bool {
	b = bytes.TrimSpace(b)
	return len(b) >= 2 && b[0] == '{' && b[len(b)-1] == '}'
}

// quotedType is an engine's Content-Type for a message: quoted, and cut at
// 64 bytes.
func quotedType(ct []byte) string {
	return strconv.Quote(string(ct[:min(len(ct), 64)]))
}

// wholeAnswerEvents is the SSE stream of a whole chat or completions
// answer: for each choice, a chat's role-only first chunk (as engines send
// it: the OpenAI SDKs' stream helpers start a choice from its first chunk,
// and counted logprobs twice from one that carried them), then one chunk
// with all of its output (a chat message as the delta, tool calls indexed
// as in a stream, the choice's index added if missing), then the usage
// chunk if includeUsage, then [DONE]. Members keep the engine's order. An
// error object (as isErrorFrame knows one) becomes an error event, which
// the relay reads as it reads an engine's own. ok is false for anything
// else.
func wholeAnswerEvents(a api, body []byte, includeUsage bool) (events []byte, ok bool) {
	// One line per event: an engine's JSON may be pretty-printed. Compact
	// also checks the syntax, once for what is read below.
	var compact bytes.Buffer
	if json.Compact(&compact, body) != nil {
		return nil, false
	}
	body = compact.Bytes()
	top, ok := membersOf(body)
	if !ok {
		return nil, false
	}
	if isErrorFrame(body) {
		return append(appendEvent(nil, body), doneEvent...), true
	}
	choices := top.get("choices")
	if len(choices) < 3 || choices[0] != '[' { // none, or []
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
	i := 0
	for e := (elements{b: choices}); e.next(); i++ {
		c, ok := membersOf(e.value)
		if !ok {
			return nil, false
		}
		index := c.get("index")
		if index == nil {
			index = json.RawMessage(strconv.Itoa(i))
			c = append(jsonObject{{"index", index}}, c...)
		}
		if a == apiChat {
			delta, ok := chunkDelta(c.get("message"))
			if !ok {
				return nil, false
			}
			first := `[{"index":` + string(index) + `,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]`
			top.set("choices", json.RawMessage(first))
			out = appendEvent(out, top.marshal())
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

// chunkDelta is a chat message as a stream's content delta: no role (the
// first chunk gave it), its tool calls with the index a stream gives each
// (the SDKs gather a call's parts by it).
func chunkDelta(msg json.RawMessage) (json.RawMessage, bool) {
	m, ok := membersOf(msg)
	if !ok {
		return nil, false
	}
	m = m.without("role")
	if tc := m.get("tool_calls"); len(tc) > 0 && !bytes.Equal(tc, []byte("null")) {
		if tc[0] != '[' {
			return nil, false
		}
		indexed := []byte{'['}
		i := 0
		for e := (elements{b: tc}); e.next(); i++ {
			c, ok := membersOf(e.value)
			if !ok {
				return nil, false
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
	return m.marshal(), true
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

// membersOf splits a JSON object, of JSON already checked, into its
// members (names as they are written, escapes kept), with jsonscan's
// members; ok is false when it is not an object.
func membersOf(b []byte) (jsonObject, bool) {
	var o jsonObject
	m := members{b: b}
	for m.next() {
		o = append(o, member{string(m.key), m.value})
	}
	return o, m.err == nil
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
	top, _ := membersOf(body) // the request's, which its parse checked
	opts, ok := membersOf(top.get("stream_options"))
	return ok && bytes.Equal(opts.get("include_usage"), []byte("true"))
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
// see whether it began a JSON object, or what a stream typed as none
// begins with: sniffStream) served first.
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

// wholeStream looks at the start of a JSON-typed answer to a streaming
// chat or completions request. A stream (some servers type theirs as JSON)
// is returned as it is, with the bytes read ahead; a whole answer is read
// and returned as the events of its stream. Otherwise the error is the
// read's, or a notStreamable.
func (x *exchange) wholeStream(stream *backends.Body, resp *fasthttp.Response, reqBody []byte, reqHeld int64) (streamBody, error) {
	b, mem := x.b, x.s.bodyMem
	coding := bytes.TrimSpace(resp.Header.ContentEncoding())
	coded := len(coding) > 0 && !bytes.EqualFold(coding, []byte("identity"))
	var pre []byte
	var preErr error
	if !coded {
		pre, preErr = readStart(stream)
		if i := skipSpace(pre, 0); i >= len(pre) || pre[i] != '{' {
			return &prefixedBody{pre: pre, err: preErr, streamBody: stream}, nil
		}
	}
	// What it holds is charged to limits.body_memory_mb as it is read and
	// decoded (64 MiB a stream went uncounted); once made into events, only
	// those stay, charged with the exchange until the stream ends.
	var held int64
	charged := false
	defer func() {
		if !charged {
			mem.Give(held)
		}
	}()
	own := reqHeld + x.answerHeld // what the request holds besides
	raw, err := readRestCharged(stream, resp, pre, preErr, mem, own, &held)
	if errors.Is(err, fasthttp.ErrBodyTooLarge) {
		return nil, notStreamable("sent a JSON answer to a streaming request larger than 64 MiB")
	}
	if err != nil {
		return nil, err
	}
	resp.SetBodyRaw(raw)
	resp.StreamBody = false
	body, enc, decodedHeld, err := plainBodyUpTo(resp, maxWholeAnswer, budgetShare{mem, own + held})
	if overBudget(err) {
		return nil, err
	}
	if enc != nil {
		return nil, notStreamable("sent a JSON answer to a streaming request larger than 64 MiB once decompressed, or not decodable")
	}
	held += decodedHeld
	if i := skipSpace(body, 0); coded && (i >= len(body) || body[i] != '{') {
		x.wholeAnswer = true // read whole too
		x.answerHeld += held
		charged = true
		return newEventsBody(body), nil // a stream, compressed
	}
	var events []byte
	ok := false
	if x.api == apiChat || x.api == apiCompletions {
		events, ok = wholeAnswerEvents(x.api, body, wantsUsage(reqBody))
	}
	if !ok {
		return nil, notStreamable("answered a streaming request with a JSON body that is not a streamable answer; send the request unstreamed")
	}
	var eventsHeld int64
	if n := int64(cap(events)); n > backends.Untracked {
		if err := mem.Reserve(n, own+held+n); err != nil {
			return nil, err
		}
		eventsHeld = n
	}
	// The answer as read and decoded is let go: its events stay.
	mem.Give(held)
	held = eventsHeld
	resp.SetBodyRaw(nil)
	x.answerHeld += held
	charged = true
	// Whole before the client has a byte of it, and no time to a first
	// token: kept out of calibration and time per token.
	x.wholeAnswer = true
	x.usage.read(body)
	if b.wholeAnswerSaid.CompareAndSwap(false, true) {
		b.log.Warn().Str("backend", b.cfg.ID).
			Msg("the engine answered a streaming request with its whole answer as JSON: kvproxy streams it to the client in one piece")
	}
	return newEventsBody(events), nil
}

// readRestCharged reads the rest of a streamed answer after pre, the bytes
// already read of it (preErr: what that read ended with), up to
// maxWholeAnswer in all, its buffer charged to mem as it grows (*held; own:
// what the request holds besides), and releases the stream.
func readRestCharged(stream *backends.Body, resp *fasthttp.Response, pre []byte, preErr error, mem *backends.Budget, own int64, held *int64) ([]byte, error) {
	defer stream.Close()
	buf := pre
	if n := resp.Header.ContentLength(); n > len(pre) && n <= maxWholeAnswer {
		// One buffer of the declared length, charged before the bytes
		// come (as DoWhole's), with room to read its end without growing:
		// a doubling series held up to twice the answer.
		size := n + 1
		if size > backends.Untracked {
			if err := mem.Reserve(int64(size), own+int64(size)); err != nil {
				return nil, err
			}
			*held = int64(size)
		}
		buf = append(make([]byte, 0, size), pre...)
	}
	if preErr != nil || resp.BodyStream() == nil {
		if preErr == io.EOF {
			preErr = nil
		}
		return buf, preErr
	}
	return mem.ReadGrowing(stream, buf, maxWholeAnswer, own, held)
}

// notStreamable is a JSON answer to a streaming request that kvproxy
// cannot stream: no fault of the engine's health (it may serve unstreamed
// requests).
type notStreamable string

func (e notStreamable) Error() string { return string(e) }

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
