package proxy

// Fuzz targets (twenty-sixth session's fuzzing trial) for the parsers of
// untrusted bytes that had none: the
// Responses and Messages request parsers, the JSON scanners (members,
// elements, appendUnquoted, appendPyDumps, keyIs) held to encoding/json,
// the engine error normalizer, the stream chunk scanners, a stream's
// continuation body (migration) and the request body decoders.

import (
	"bytes"
	stdjson "encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/goccy/go-json"
	"github.com/klauspost/compress/zstd"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/router"
	"github.com/kvproxy/kvproxy/tokenize"
)

// checkConverted holds a converted request (Responses, Messages) to what
// its consumers need: tools and every tool_calls valid JSON (the template
// decodes them; the engine's /tokenize takes chatJSON), and the body
// re-encodable for the engine.
func checkConverted(t *testing.T, r *apiRequest) {
	t.Helper()
	if r.tools != "" && !stdjson.Valid([]byte(r.tools)) {
		t.Fatalf("tools are not JSON: %s", r.tools)
	}
	for i, m := range r.messages {
		if m.ToolCalls != "" && !stdjson.Valid([]byte(m.ToolCalls)) {
			t.Fatalf("messages[%d].tool_calls are not JSON: %s", i, m.ToolCalls)
		}
	}
	if c := r.chatJSON(); !stdjson.Valid(c) {
		t.Fatalf("chatJSON is not JSON: %s", c)
	}
	out, err := r.forwardBody(nil, "served", "salt")
	if err != nil || !stdjson.Valid(out) {
		t.Fatalf("engine body (%v): %s", err, out)
	}
}

// reparsed parses body again into a request whose buffers held another
// request first: pooled buffers must not leak into the result.
func reparsed(body []byte, parse func(*apiRequest, []byte) *paramError, other []byte) *apiRequest {
	r := &apiRequest{}
	parse(r, other)
	r.reset()
	parse(r, body)
	return r
}

func FuzzParseResponsesRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","input":"hi"}`,
		`{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"x"},{"type":"function_call","call_id":"c","name":"f","arguments":"{}","namespace":"ns"},{"type":"function_call","call_id":"d","name":"g","arguments":"{\"a\":1}"},{"type":"function_call_output","call_id":"c","output":"r"},{"type":"reasoning","summary":[{"text":"s"}]},{"role":"assistant","content":[{"type":"output_text","text":"t"}]}]}`,
		`{"model":"m","input":[{"id":"ref"}],"previous_response_id":"resp_1"}`,
		`{"model":"m","tools":[{"type":"function","name":"f","parameters":{"type":"object"},"strict":true,"x-own":[1, 2]},{"type":"web_search"}],"input":"q"}`,
		`{"model":"m","input":[{"type":"message","role":"developer","content":[{"type":"input_text","text":"a"},{"type":"input_image","image_url":"data:x"}]}]}`,
		`{"model":"m","input":[{"type":"reasoning","content":[{"type":"reasoning_text","text":"r"}]},{"type":"function_call","call_id":"\u0063","name":"n\"","arguments":""}]}`,
	} {
		f.Add([]byte(s))
	}
	other := []byte(`{"model":"o","instructions":"\u00e9\u00e9\u00e9 other","input":[{"role":"user","content":"\u00e9 padding padding padding"},{"type":"function_call","call_id":"z","name":"zz","arguments":"{}"}]}`)
	f.Fuzz(func(t *testing.T, body []byte) {
		r := &apiRequest{}
		pe := r.parseResponses(body)
		if pe != nil {
			if pe.msg == "" {
				t.Fatal("an error without a message")
			}
			return
		}
		checkConverted(t, r)
		r2 := reparsed(body, (*apiRequest).parseResponses, other)
		if !sameMessages(r.messages, r2.messages) || r.tools != r2.tools {
			t.Fatalf("a reused request parses otherwise:\n%q\n%q", r.messages, r2.messages)
		}
	})
}

func FuzzParseMessagesRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","max_tokens":"5","system":[{"type":"text","text":"x-anthropic-billing-header: a"},{"type":"text","text":"S"}],"messages":[{"role":"system","content":"inline"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA"}}]},{"role":"assistant","content":[{"type":"thinking","thinking":"t"},{"type":"tool_use","id":"u","name":"f","input":{"a":[1.5e300,-0,"\u00e9\ud83d\ude00"]}}]},{"role":"system","content":[{"type":"text","text":"mid"}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"u","content":[{"type":"text","text":"r"},{"type":"image","source":{"type":"url","url":"http://x"}}]}]}],"tools":[{"name":"f","description":"d","input_schema":{"properties":{}}},{"name":"g","input_schema":{ }}]}`,
		`{"model":"m","max_tokens":1.0,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}}]},{"role":"system","content":"s"},{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"ok"}]},{"role":"ctx","content":"c"}]}`,
		`{"model":"m","messages":[{"role":"system","content":"only"},{"role":"assistant","content":[{"type":"tool_result","content":null}]}]}`,
	} {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	other := []byte(`{"model":"o","max_tokens":9,"system":"\u00e9 sys padding","messages":[{"role":"user","content":[{"type":"text","text":"\u00e9 other padding"},{"type":"tool_result","tool_use_id":"x","content":"\u00e9"}]},{"role":"assistant","content":[{"type":"tool_use","id":"x","name":"n","input":{"k":"\u00e9"}}]}]}`)
	f.Fuzz(func(t *testing.T, body []byte, counting bool) {
		r := &apiRequest{}
		pe := r.parseAnthropic(body, counting)
		if pe != nil {
			if pe.msg == "" {
				t.Fatal("an error without a message")
			}
			return
		}
		checkConverted(t, r)
		parse := func(r *apiRequest, b []byte) *paramError { return r.parseAnthropic(b, counting) }
		r2 := reparsed(body, parse, other)
		if !sameMessages(r.messages, r2.messages) || r.tools != r2.tools {
			t.Fatalf("a reused request parses otherwise:\n%q\n%q", r.messages, r2.messages)
		}
	})
}

func sameMessages(a, b []tokenize.Message) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// stdMembers is the members of a JSON object as encoding/json reads them,
// in order: decoded names and raw values.
func stdMembers(doc []byte) (keys []string, vals [][]byte, ok bool) {
	dec := stdjson.NewDecoder(bytes.NewReader(doc))
	if tok, err := dec.Token(); err != nil || tok != stdjson.Delim('{') {
		return nil, nil, false
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, false
		}
		var raw stdjson.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, nil, false
		}
		keys, vals = append(keys, tok.(string)), append(vals, raw)
	}
	return keys, vals, true
}

func compact(b []byte) []byte {
	var buf bytes.Buffer
	if stdjson.Compact(&buf, b) != nil {
		return nil
	}
	return buf.Bytes()
}

// anyOf is v decoded by encoding/json, numbers as float64.
func anyOf(b []byte) (v any, ok bool) {
	return v, stdjson.Unmarshal(b, &v) == nil
}

// FuzzJSONScanners: on what json.Valid accepts (the scanners' premise),
// members, elements and appendUnquoted agree with encoding/json, keyIs
// matches a name exactly as decoded, and appendPyDumps writes JSON of the
// same value. goccy's Valid, which guards the scanners, agrees with
// encoding/json's.
func FuzzJSONScanners(f *testing.F) {
	for _, s := range []string{
		`{"a":1,"b":[true,null,{"c":"d"}],"e":"\u00e9\ud83d\ude00\\\"","\u0073tream":false}`,
		`[1, "x" , {"y": [ ]}, -0.5e-3]`,
		`"\ud800\u0041\udc00x\ud83d"`,
		`{"k\\":"v\\\\","":{}} `,
		"\t{\"a\" : 1e400 , \"b\":\"\xff\xfe\"}\n",
		`{"a":1,"a":2}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		sv := stdjson.Valid(doc)
		if gv := json.Valid(doc); gv != sv {
			t.Fatalf("goccy Valid %v, encoding/json Valid %v: %q", gv, sv, doc)
		}
		if !sv {
			return
		}
		trimmed := bytes.TrimSpace(doc)
		switch trimmed[0] {
		case '{':
			keys, vals, ok := stdMembers(trimmed)
			if !ok {
				t.Fatal("encoding/json cannot walk a valid object")
			}
			n := 0
			m := members{b: trimmed}
			for ; m.next(); n++ {
				if n >= len(keys) {
					t.Fatalf("more members than encoding/json sees")
				}
				if got := string(appendUnquoted(nil, m.key)); got != keys[n] {
					t.Fatalf("member %d: name %q, encoding/json %q", n, got, keys[n])
				}
				if !bytes.Equal(compact(m.value), compact(vals[n])) {
					t.Fatalf("member %d: value %q, encoding/json %q", n, m.value, vals[n])
				}
				if !bytes.HasPrefix(m.member, []byte{'"'}) || !bytes.HasSuffix(m.member, m.value) {
					t.Fatalf("member %d: %q", n, m.member)
				}
				if k := keys[n]; k != "" && len(k) <= 20 && isASCII(k) && !keyIs(m.key, k) {
					t.Fatalf("keyIs(%q, %q) is false", m.key, k)
				}
			}
			if m.err != nil || n != len(keys) {
				t.Fatalf("%d members (err %v), encoding/json %d", n, m.err, len(keys))
			}
		case '[':
			var vals []stdjson.RawMessage
			if stdjson.Unmarshal(trimmed, &vals) != nil {
				t.Fatal("encoding/json cannot read a valid array")
			}
			n := 0
			for e := (elements{b: trimmed}); e.next(); n++ {
				if n >= len(vals) || !bytes.Equal(compact(e.value), compact(vals[n])) {
					t.Fatalf("element %d: %q", n, e.value)
				}
			}
			if n != len(vals) {
				t.Fatalf("%d elements, encoding/json %d", n, len(vals))
			}
		case '"':
			var s string
			if stdjson.Unmarshal(trimmed, &s) != nil {
				t.Fatal("encoding/json cannot read a valid string")
			}
			if got := string(appendJSONString(nil, trimmed)); got != s {
				t.Fatalf("decoded %q, encoding/json %q", got, s)
			}
		}
		// json.dumps of the value: JSON, ASCII, of the same value.
		py := appendPyDumps(nil, doc)
		want, ok := anyOf(doc)
		if !ok {
			return // a number out of float64's range
		}
		got, ok := anyOf(py)
		if !ok || !reflect.DeepEqual(got, want) {
			t.Fatalf("json.dumps %s of %s", py, doc)
		}
		for _, c := range py {
			if c >= utf8.RuneSelf {
				t.Fatalf("json.dumps (ensure_ascii) wrote a non-ASCII byte: %s", py)
			}
		}
	})
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// FuzzNormalizeEngineError: whatever an engine answers with, the client
// gets an OpenAI error: JSON whose error is an object with a string
// message.
func FuzzNormalizeEngineError(f *testing.F) {
	for _, s := range []string{
		`{"error":{"message":"m","type":"BadRequestError","param":null,"code":400}}`,
		`{"object":"error","message":"This model's maximum context length is 10 tokens. However, you requested 20 tokens (5 in the messages, 15 in the completion).","type":"BadRequestError","param":null,"code":400}`,
		`{"error":"Input validation error: ` + "`inputs`" + ` must have less than 5 tokens","error_type":"validation"}`,
		`{"detail":[{"loc":["body"],"msg":"x"}]}`,
		`<html>502</html>`,
		``,
	} {
		f.Add(400, []byte(s))
	}
	f.Fuzz(func(t *testing.T, status int, body []byte) {
		out := normalizeEngineError(status, body)
		var e struct {
			Error *struct {
				Message *string `json:"message"`
				Type    *string `json:"type"`
			} `json:"error"`
		}
		if err := stdjson.Unmarshal(out, &e); err != nil || e.Error == nil || e.Error.Message == nil || e.Error.Type == nil {
			t.Fatalf("not an OpenAI error (%v): %s", err, out)
		}
		engineMessage(status, body)
		engineErrorKind(body)
		requestsFault(out)
	})
}

// FuzzEngineChunkScanners runs the scanners of a stream's chunks (the
// engine's bytes, not validated) and checks the rewrites keep valid JSON
// valid.
func FuzzEngineChunkScanners(f *testing.F) {
	for _, s := range []string{
		`{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"x"},"finish_reason":null}],"usage":{"prompt_tokens":5,"completion_tokens":1}}`,
		`{"choices":[{"index":0,"delta":{"content":" the", "role": "assistant"},"finish_reason":"stop"}]}`,
		`{"error":{"message":"boom"}}`,
		`{"object":"error","message":"x"}`,
		`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":2}}}`,
		`{"choices":[{"delta":{"role":"assistant"}}]}`,
	} {
		f.Add([]byte(s), uint8(3))
	}
	f.Fuzz(func(t *testing.T, data []byte, c uint8) {
		isErrorFrame(data)
		finishValue(data)
		noChoices(data)
		hasUsage(data)
		k, v := outputOf(data)
		var u tokenUsage
		u.read(data)
		for _, chat := range []bool{false, true} {
			m := &migration{chat: chat}
			m.note(data, k, v)
		}
		valid := stdjson.Valid(data)
		if w := withoutRole(data); w != nil && valid && !stdjson.Valid(w) {
			t.Fatalf("withoutRole broke JSON: %s -> %s", data, w)
		}
		for _, key := range [][]byte{promptKey, completionKey} {
			if s := shiftInt(data, key, int(c)-128); valid && !stdjson.Valid(s) {
				t.Fatalf("shiftInt broke JSON: %s -> %s", data, s)
			}
		}
	})
}

// FuzzContinuation: a stream that may migrate continues as a request the
// proxy accepts again, its prompt (or last message) the original one
// followed by the text relayed.
func FuzzContinuation(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","stream":true,"max_tokens":100,"min_tokens":10,"messages":[{"role":"user","content":"hi"} ]}`,
		`{"model":"m","stream":true,"prompt":[ "Once upon" ],"max_tokens":30}`,
		`{"model":"m","stream":true,"max_tokens":null,"prompt":"Once upon"}`,
		`{"model":"m","stream":true,"prompt":[],"prompt":"Once"}`,
	} {
		f.Add([]byte(s), strings.Contains(s, "messages"), " a time", uint8(2))
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool, partial string, emitted uint8) {
		var req apiRequest
		if req.parse(body, chat) != nil {
			return
		}
		kind := apiCompletions
		if chat {
			kind = apiChat
		}
		if !migratable(&req, kind, &router.Request{}) {
			return
		}
		// What note collects: a relayed text's JSON string contents.
		q := appendJSONQuoted(nil, partial)
		m := &migration{chat: chat, body: req.body, partial: q[1 : len(q)-1], maxTokens: req.maxTokens}
		if !chat && m.maxTokens == 0 {
			m.maxTokens, m.defaultMax = completionsDefaultMax, true
		}
		var cont []byte
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("continuation of %s panicked: %v", body, p)
				}
			}()
			cont = m.continuation(int(emitted))
		}()
		var again apiRequest
		if pe := again.parse(cont, chat); pe != nil {
			t.Fatalf("the continuation is refused (%s: %s): %s", pe.param, pe.msg, cont)
		}
		var decoded string
		stdjson.Unmarshal(q, &decoded) // invalid UTF-8: U+FFFD a byte, as the engine reads it
		if !chat && partial != "" && again.promptText != req.promptText+decoded {
			t.Fatalf("prompt %q, want %q + %q", again.promptText, req.promptText, partial)
		}
	})
}

var zstdFuzzEnc, _ = zstd.NewWriter(nil, zstd.WithEncoderConcurrency(1), zstd.WithEncoderLevel(zstd.SpeedFastest))

// zstdOf is p compressed as zstd.
func zstdOf(p []byte) []byte { return zstdFuzzEnc.EncodeAll(p, nil) }

// FuzzDecodedBody: a compressed body decodes to at most max bytes, or
// fails with ErrBodyTooLarge past it; within it, to the bytes compressed.
func FuzzDecodedBody(f *testing.F) {
	f.Add([]byte("hello hello hello"), uint16(100), uint8(0), false)
	f.Add(bytes.Repeat([]byte{'a'}, 5000), uint16(4096), uint8(3), false)
	f.Add([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff}, uint16(10), uint8(0), true)
	f.Fuzz(func(t *testing.T, data []byte, limit uint16, coding uint8, raw bool) {
		if len(data) > 1<<16 {
			return
		}
		codings := []string{"gzip", "deflate", "br", "zstd"}
		name := codings[int(coding)%len(codings)]
		max := int(limit)
		body := data
		if !raw {
			switch name {
			case "gzip":
				body = fasthttp.AppendGzipBytesLevel(nil, data, fasthttp.CompressBestSpeed)
			case "deflate":
				body = fasthttp.AppendDeflateBytesLevel(nil, data, fasthttp.CompressBestSpeed)
			case "br":
				body = fasthttp.AppendBrotliBytesLevel(nil, data, fasthttp.CompressBrotliBestSpeed)
			case "zstd":
				body = zstdOf(data)
			}
		}
		out, _, err := decoded([]byte(name), body, max, budgetShare{})
		if err == nil && len(out) > max {
			t.Fatalf("%s: %d bytes decoded past the limit %d", name, len(out), max)
		}
		if !raw {
			switch {
			case len(data) > max && !errors.Is(err, fasthttp.ErrBodyTooLarge):
				t.Fatalf("%s: %d bytes over the limit %d: %v", name, len(data), max, err)
			case len(data) <= max && (err != nil || !bytes.Equal(out, data)):
				t.Fatalf("%s: round trip failed: %v", name, err)
			}
		}
	})
}

// FuzzWholeAnswerEvents: a whole (unstreamed) engine answer turned into a
// stream gives events of valid JSON, ended by [DONE].
func FuzzWholeAnswerEvents(f *testing.F) {
	f.Add([]byte(`{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi","tool_calls":[{"id":"t","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"stop"}],"usage":{"prompt_tokens":1}}`), true)
	f.Add([]byte(`{"id":"c","choices":[{"text":"x","finish_reason":"length"},{"index":1,"text":"y"}],"usage":null}`), false)
	f.Add([]byte(`{"error":{"message":"m"}}`), true)
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		a := apiCompletions
		if chat {
			a = apiChat
		}
		events, ok := wholeAnswerEvents(a, body, true)
		if !ok {
			return
		}
		if !bytes.HasSuffix(events, doneEvent) {
			t.Fatalf("no [DONE]: %q", events)
		}
		for _, ev := range bytes.Split(bytes.TrimSuffix(events, doneEvent), []byte("\n\n")) {
			if len(ev) == 0 {
				continue
			}
			data, found := bytes.CutPrefix(ev, []byte("data: "))
			if !found || !stdjson.Valid(data) {
				t.Fatalf("event %q of %s", ev, body)
			}
		}
	})
}
