package mockengine

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/kvproxy/kvproxy/tokenize"
)

// An Anthropic Messages request is rendered as the chat request vLLM
// builds from it (vllm/entrypoints/anthropic/serving.py,
// _convert_anthropic_to_openai_request), through the same template and
// encoder as a chat request, so the two share prompt tokens and cached
// blocks.

// messagesRequest holds the fields of POST /v1/messages (and, without
// max_tokens and stream, of /v1/messages/count_tokens) the engine reads;
// stop_sequences, temperature, top_p, top_k and metadata are only checked.
type messagesRequest struct {
	Model         string          `json:"model"`
	Messages      json.RawMessage `json:"messages"`
	MaxTokens     *int            `json:"max_tokens"`
	Metadata      map[string]any  `json:"metadata"`
	StopSequences []string        `json:"stop_sequences"`
	Stream        *bool           `json:"stream"`
	System        json.RawMessage `json:"system"`
	Temperature   *float64        `json:"temperature"`
	ToolChoice    json.RawMessage `json:"tool_choice"`
	Tools         json.RawMessage `json:"tools"`
	TopK          *int            `json:"top_k"`
	TopP          *float64        `json:"top_p"`
	IgnoreEOS     bool            `json:"ignore_eos"` // the chat path's extension
}

// anthropicChat is a Messages request converted: the chat messages and
// the template's tools ("" for none).
type anthropicChat struct {
	messages []tokenize.Message
	tools    string
}

// convertMessages is _convert_anthropic_to_openai_request.
func convertMessages(req *messagesRequest) (*anthropicChat, error) {
	if req.Model == "" {
		return nil, invalid("model", "Model is required")
	}
	c := &anthropicChat{}
	system, err := systemMessage(req.System)
	if err != nil {
		return nil, err
	}
	if system != nil {
		c.messages = append(c.messages, *system)
	}
	var msgs []json.RawMessage
	if m := bytes.TrimSpace(req.Messages); len(m) == 0 || m[0] != '[' || json.Unmarshal(m, &msgs) != nil {
		return nil, invalid("messages", "messages must be an array of messages")
	}
	if len(msgs) == 0 {
		return nil, invalid("messages", "messages must contain at least one item")
	}
	for i, raw := range msgs {
		if c.messages, err = appendAnthropicMessage(c.messages, raw, i); err != nil {
			return nil, err
		}
	}
	if c.tools, err = anthropicTools(req.Tools); err != nil {
		return nil, err
	}
	if err := checkToolChoice(req.ToolChoice); err != nil {
		return nil, err
	}
	return c, nil
}

// systemMessage is the system prompt as a message: a string as it is, a
// list of blocks as the text of its text blocks run together; nil when
// absent or empty.
func systemMessage(raw json.RawMessage) (*tokenize.Message, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return nil, invalid("system", "system is not a valid string")
		}
		if s == "" {
			return nil, nil
		}
		return &tokenize.Message{Role: "system", Content: s}, nil
	}
	var blocks []json.RawMessage
	if raw[0] != '[' || json.Unmarshal(raw, &blocks) != nil {
		return nil, invalid("system", "system must be a string or an array of content blocks")
	}
	if len(blocks) == 0 {
		return nil, nil
	}
	var sb strings.Builder
	for j, braw := range blocks {
		b, err := parseBlock(braw, "system", "system", j)
		if err != nil {
			return nil, err
		}
		if b.typ == "text" {
			sb.WriteString(b.text)
		}
	}
	return &tokenize.Message{Role: "system", Content: sb.String()}, nil
}

// contentBlock is one of a message's content blocks, with the members
// vLLM's AnthropicContentBlock declares, each checked for its type.
type contentBlock struct {
	typ      string
	text     string // text, "" when absent
	source   map[string]json.RawMessage
	id, name *string
	// rawID and rawName are id and name as sent (JSON strings), which is
	// how kvproxy writes them into a tool call
	rawID, rawName json.RawMessage
	input          json.RawMessage // an object, or nil
	content        json.RawMessage // a string, an array of objects, or nil
	thinking       *string
}

var blockTypes = map[string]bool{"text": true, "image": true, "tool_use": true, "tool_result": true, "thinking": true}

// parseBlock reads block j of list (a message's content, or the system
// prompt; param names the request member) as pydantic validates it: exact member names, a known type,
// each member null or of its declared JSON type.
func parseBlock(raw json.RawMessage, param, list string, j int) (*contentBlock, error) {
	bad := func(format string, args ...any) (*contentBlock, error) {
		return nil, invalid(param, "%s[%d]: %s", list, j, fmt.Sprintf(format, args...))
	}
	var m map[string]json.RawMessage
	if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] != '{' || json.Unmarshal(t, &m) != nil {
		return bad("a content block must be an object")
	}
	b := &contentBlock{}
	if json.Unmarshal(m["type"], &b.typ) != nil || !blockTypes[b.typ] {
		return bad("type must be one of text, image, tool_use, tool_result, thinking")
	}
	str := func(k string) (*string, bool) {
		v := m[k]
		if len(v) == 0 || string(v) == "null" {
			return nil, true
		}
		var s string
		if v[0] != '"' || json.Unmarshal(v, &s) != nil {
			return nil, false
		}
		return &s, true
	}
	obj := func(k string) (json.RawMessage, bool) {
		v := m[k]
		if len(v) == 0 || string(v) == "null" {
			return nil, true
		}
		return v, v[0] == '{'
	}
	var text, signature *string
	var ok bool
	for _, f := range []struct {
		k string
		p **string
	}{{"text", &text}, {"id", &b.id}, {"name", &b.name}, {"thinking", &b.thinking}, {"signature", &signature}} {
		if *f.p, ok = str(f.k); !ok {
			return bad("%s must be a string", f.k)
		}
	}
	if text != nil {
		b.text = *text
	}
	if b.id != nil {
		b.rawID = bytes.TrimSpace(m["id"])
	}
	if b.name != nil {
		b.rawName = bytes.TrimSpace(m["name"])
	}
	var source json.RawMessage
	if source, ok = obj("source"); !ok || source != nil && json.Unmarshal(source, &b.source) != nil {
		return bad("source must be an object")
	}
	if b.input, ok = obj("input"); !ok {
		return bad("input must be an object")
	}
	if v := m["is_error"]; len(v) > 0 && string(v) != "null" && string(v) != "true" && string(v) != "false" {
		return bad("is_error must be a boolean")
	}
	if v := bytes.TrimSpace(m["content"]); len(v) > 0 && string(v) != "null" {
		var parts []json.RawMessage
		switch {
		case v[0] == '"':
		case v[0] == '[' && json.Unmarshal(v, &parts) == nil:
			for _, p := range parts {
				if p = bytes.TrimSpace(p); p[0] != '{' {
					return bad("content must be a string or an array of objects")
				}
			}
		default:
			return bad("content must be a string or an array of objects")
		}
		b.content = v
	}
	return b, nil
}

// appendAnthropicMessage appends the chat messages of message i: the tool
// messages of its tool results (a user message's), then the message
// itself unless it ends up with nothing to say.
func appendAnthropicMessage(out []tokenize.Message, raw json.RawMessage, i int) ([]tokenize.Message, error) {
	where := fmt.Sprintf("messages[%d]", i)
	var m struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] != '{' || unmarshalExact(t, &m) != nil {
		return nil, invalid("messages", "%s must be an object with role and content", where)
	}
	if m.Role != "user" && m.Role != "assistant" {
		return nil, invalid("messages", "%s.role must be user or assistant", where)
	}
	content := bytes.TrimSpace(m.Content)
	if len(content) > 0 && content[0] == '"' {
		var s string
		if json.Unmarshal(content, &s) != nil {
			return nil, invalid("messages", "%s.content is not a valid string", where)
		}
		return append(out, tokenize.Message{Role: m.Role, Content: s}), nil
	}
	var blocks []json.RawMessage
	if len(content) == 0 || content[0] != '[' || json.Unmarshal(content, &blocks) != nil {
		return nil, invalid("messages", "%s.content must be a string or an array of content blocks", where)
	}
	msg := tokenize.Message{Role: m.Role}
	var text []byte // the content parts as the chat path joins them
	parts := 0
	addPart := func() {
		if parts++; parts > 1 {
			text = append(text, '\n')
		}
	}
	var calls []byte
	var reasoning []string
	for j, braw := range blocks {
		b, err := parseBlock(braw, "messages", where+".content", j)
		if err != nil {
			return nil, err
		}
		switch b.typ {
		case "text":
			if b.text != "" {
				addPart()
				text = append(text, b.text...)
			}
		case "image":
			if len(b.source) > 0 {
				url, err := imageURL(b.source)
				if err != nil {
					return nil, invalid("messages", "%s.content[%d]: %v", where, j, err)
				}
				addPart()
				text = tokenize.AppendMediaStandIn(text, []byte(url))
			}
		case "thinking":
			if b.thinking != nil {
				reasoning = append(reasoning, *b.thinking)
			}
		case "tool_use":
			calls = appendToolCall(calls, b)
		case "tool_result":
			result := pyStr(b.content)
			if m.Role == "user" {
				id := ""
				if b.id != nil {
					id = *b.id // vLLM reads id, not tool_use_id
				}
				out = append(out, tokenize.Message{Role: "tool", Content: result, ToolCallID: id})
			} else {
				addPart()
				text = append(append(text, "Tool result: "...), result...)
			}
		}
	}
	if calls != nil {
		msg.ToolCalls = string(append(calls, ']'))
	}
	msg.Reasoning = strings.Join(reasoning, "")
	if parts == 0 && calls == nil && reasoning == nil {
		return out, nil // vLLM drops a message left empty
	}
	msg.Content = string(text)
	return append(out, msg), nil
}

// imageURL is the image part's url vLLM makes of an image block's
// source: its data member, "" when absent.
func imageURL(source map[string]json.RawMessage) (string, error) {
	v, ok := source["data"]
	if !ok {
		return "", nil
	}
	var s string
	if len(v) == 0 || v[0] != '"' || json.Unmarshal(v, &s) != nil {
		return "", fmt.Errorf("an image's source.data must be a string")
	}
	return s, nil
}

// appendToolCall appends a tool_use block as a chat tool call, the first
// opening the array: {"id","type","function":{"name","arguments"}}, the
// arguments its input as Python's json.dumps writes it. The text is
// kvproxy's (proxy/messages.go): id and name as sent, the arguments
// quoted by json.Marshal.
func appendToolCall(calls []byte, b *contentBlock) []byte {
	if calls == nil {
		calls = []byte{'['}
	} else {
		calls = append(calls, ',')
	}
	calls = append(calls, `{"id":`...)
	if b.id != nil && *b.id != "" {
		calls = append(calls, b.rawID...)
	} else { // vLLM's stand-in
		calls = fmt.Appendf(calls, `"call_%d"`, time.Now().Unix())
	}
	calls = append(calls, `,"type":"function","function":{"name":`...)
	if b.name != nil {
		calls = append(calls, b.rawName...)
	} else {
		calls = append(calls, `""`...)
	}
	args := []byte("{}")
	if b.input != nil {
		args = pyJSONDumps(nil, decodeOrdered(b.input))
	}
	quoted, _ := json.Marshal(string(args))
	calls = append(append(calls, `,"arguments":`...), quoted...)
	return append(calls, "}}"...)
}

// anthropicTools is the request's tools as the chat tools vLLM makes of
// them: [{"type":"function","function":{"name","description",
// "parameters"}}], name, description (null when absent) and input_schema
// as sent, the schema with "type":"object" added at its end when it has
// no type (AnthropicTool's validator), as kvproxy writes them. Absent or
// null tools are none ("").
func anthropicTools(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var tools []json.RawMessage
	if raw[0] != '[' || json.Unmarshal(raw, &tools) != nil {
		return "", invalid("tools", "tools must be an array of tools")
	}
	b := []byte{'['}
	for i, t := range tools {
		var tool struct {
			Name        json.RawMessage `json:"name"`
			Description json.RawMessage `json:"description"`
			InputSchema json.RawMessage `json:"input_schema"`
		}
		if t = bytes.TrimSpace(t); t[0] != '{' || unmarshalExact(t, &tool) != nil || !isJSONString(bytes.TrimSpace(tool.Name)) {
			return "", invalid("tools", "tools[%d] must be an object with a name, a string", i)
		}
		desc := bytes.TrimSpace(tool.Description)
		if len(desc) == 0 {
			desc = []byte("null")
		} else if !isJSONString(desc) && string(desc) != "null" {
			return "", invalid("tools", "tools[%d].description must be a string", i)
		}
		schema := bytes.TrimSpace(tool.InputSchema)
		members, err := objectMembers(schema)
		if err != nil {
			return "", invalid("tools", "tools[%d].input_schema must be an object", i)
		}
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"type":"function","function":{"name":`...)
		b = append(b, bytes.TrimSpace(tool.Name)...)
		b = append(append(b, `,"description":`...), desc...)
		b = append(b, `,"parameters":`...)
		switch {
		case len(members) == 0:
			b = append(b, `{"type":"object"}`...)
		case slices.ContainsFunc(members, func(m member) bool { return m.key == "type" }):
			b = append(b, schema...)
		default:
			b = append(append(b, schema[:len(schema)-1]...), `,"type":"object"}`...)
		}
		b = append(b, "}}"...)
	}
	return string(append(b, ']')), nil
}

// checkToolChoice checks tool_choice as AnthropicToolChoice validates it;
// the engine does not constrain its output, so it has no other effect.
func checkToolChoice(raw json.RawMessage) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var tc struct {
		Type string  `json:"type"`
		Name *string `json:"name"`
	}
	if raw[0] != '{' || unmarshalExact(raw, &tc) != nil || tc.Type != "auto" && tc.Type != "any" && tc.Type != "tool" {
		return invalid("tool_choice", "tool_choice must be an object with type auto, any or tool")
	}
	return nil
}

// Values decoded from JSON as Python's json.loads makes them: objects
// keep their members' order (a repeated member keeps its first place and
// its last value), numbers stay as written.
type pyDict struct {
	keys []string
	vals map[string]any
}

// decodeOrdered decodes valid JSON into nil, bool, string, json.Number,
// []any and *pyDict.
func decodeOrdered(raw json.RawMessage) any {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, _ := decodeValue(dec)
	return v
}

func decodeValue(dec *json.Decoder) (any, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch tok {
	case json.Delim('['):
		list := []any{}
		for dec.More() {
			v, err := decodeValue(dec)
			if err != nil {
				return nil, err
			}
			list = append(list, v)
		}
		_, err := dec.Token()
		return list, err
	case json.Delim('{'):
		d := &pyDict{vals: map[string]any{}}
		for dec.More() {
			k, err := dec.Token()
			if err != nil {
				return nil, err
			}
			v, err := decodeValue(dec)
			if err != nil {
				return nil, err
			}
			key := k.(string)
			if _, seen := d.vals[key]; !seen {
				d.keys = append(d.keys, key)
			}
			d.vals[key] = v
		}
		_, err := dec.Token()
		return d, err
	}
	return tok, nil
}

// pyNumber is a JSON number as Python reads and writes it: an integer
// as written (-0 as 0), anything with a fraction or exponent as a float's
// repr; inf is a float out of range.
func pyNumber(n json.Number, inf string) string {
	s := string(n)
	if !strings.ContainsAny(s, ".eE") {
		if s == "-0" {
			return "0"
		}
		return s
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil && math.IsInf(f, 0) {
		if f < 0 {
			return "-" + inf
		}
		return inf
	}
	return pyFloatRepr(f)
}

// pyFloatRepr is Python's repr of a finite float: the shortest digits
// that round-trip, in exponent form below 1e-4 and from 1e16 on.
func pyFloatRepr(f float64) string {
	sign := ""
	if math.Signbit(f) {
		sign, f = "-", -f
	}
	if f == 0 {
		return sign + "0.0"
	}
	mant, expPart, _ := strings.Cut(strconv.FormatFloat(f, 'e', -1, 64), "e")
	digits := strings.Replace(mant, ".", "", 1)
	exp, _ := strconv.Atoi(expPart)
	if exp < -4 || exp >= 16 {
		s := digits[:1]
		if len(digits) > 1 {
			s += "." + digits[1:]
		}
		es := "+"
		if exp < 0 {
			es, exp = "-", -exp
		}
		return fmt.Sprintf("%s%se%s%02d", sign, s, es, exp)
	}
	if exp < 0 {
		return sign + "0." + strings.Repeat("0", -exp-1) + digits
	}
	if len(digits) <= exp+1 {
		return sign + digits + strings.Repeat("0", exp+1-len(digits)) + ".0"
	}
	return sign + digits[:exp+1] + "." + digits[exp+1:]
}

// pyPrinter writes decoded JSON the way one Python printer does: both
// json.dumps and repr separate with ", " and ": " and differ only in how
// they spell the scalars.
type pyPrinter struct {
	name                                   string // for the panic on a type JSON has not
	nullText, trueText, falseText, infText string
	str                                    func(dst []byte, s string) []byte
}

// pyJSON is Python's json.dumps with its defaults: every character outside
// printable ASCII escaped (\uXXXX, lowercase), floats as their repr.
var pyJSON = pyPrinter{name: "pyJSONDumps", nullText: "null", trueText: "true", falseText: "false", infText: "Infinity", str: pyJSONString}

// pyReprs is Python's repr.
var pyReprs = pyPrinter{name: "pyRepr", nullText: "None", trueText: "True", falseText: "False", infText: "inf", str: pyStringRepr}

// pyJSONDumps appends v as Python's json.dumps writes it by default.
func pyJSONDumps(dst []byte, v any) []byte { return pyJSON.append(dst, v) }

// pyRepr appends Python's repr of v.
func pyRepr(dst []byte, v any) []byte { return pyReprs.append(dst, v) }

func (p *pyPrinter) append(dst []byte, v any) []byte {
	switch v := v.(type) {
	case nil:
		return append(dst, p.nullText...)
	case bool:
		if v {
			return append(dst, p.trueText...)
		}
		return append(dst, p.falseText...)
	case json.Number:
		return append(dst, pyNumber(v, p.infText)...)
	case string:
		return p.str(dst, v)
	case []any:
		dst = append(dst, '[')
		for i, x := range v {
			if i > 0 {
				dst = append(dst, ", "...)
			}
			dst = p.append(dst, x)
		}
		return append(dst, ']')
	case *pyDict:
		dst = append(dst, '{')
		for i, k := range v.keys {
			if i > 0 {
				dst = append(dst, ", "...)
			}
			dst = append(p.str(dst, k), ": "...)
			dst = p.append(dst, v.vals[k])
		}
		return append(dst, '}')
	}
	panic(fmt.Sprintf("%s: %T", p.name, v))
}

func pyJSONString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	for _, r := range s {
		switch r {
		case '"':
			dst = append(dst, `\"`...)
		case '\\':
			dst = append(dst, `\\`...)
		case '\n':
			dst = append(dst, `\n`...)
		case '\r':
			dst = append(dst, `\r`...)
		case '\t':
			dst = append(dst, `\t`...)
		case '\b':
			dst = append(dst, `\b`...)
		case '\f':
			dst = append(dst, `\f`...)
		default:
			if r >= 0x20 && r < 0x7f {
				dst = append(dst, byte(r))
				continue
			}
			if r > 0xffff {
				hi, lo := utf16.EncodeRune(r)
				dst = fmt.Appendf(dst, `\u%04x\u%04x`, hi, lo)
			} else {
				dst = fmt.Appendf(dst, `\u%04x`, r)
			}
		}
	}
	return append(dst, '"')
}

// pyStr is str(content) of a tool result as vLLM takes it: a string as it
// is, a list of objects as Python's repr of it, "" when null or empty.
func pyStr(content json.RawMessage) string {
	if len(content) == 0 {
		return ""
	}
	if content[0] == '"' {
		var s string
		json.Unmarshal(content, &s)
		return s
	}
	v := decodeOrdered(content)
	if list, ok := v.([]any); !ok || len(list) == 0 {
		return ""
	}
	return string(pyRepr(nil, v))
}

// pyStringRepr is Python's repr of a string: single quotes unless it has
// a single quote and no double one; what is not printable escaped.
func pyStringRepr(dst []byte, s string) []byte {
	quote := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		quote = '"'
	}
	dst = append(dst, quote)
	for _, r := range s {
		switch {
		case r == rune(quote) || r == '\\':
			dst = append(dst, '\\', byte(r))
		case r == '\t':
			dst = append(dst, `\t`...)
		case r == '\n':
			dst = append(dst, `\n`...)
		case r == '\r':
			dst = append(dst, `\r`...)
		case r < 0x20 || r == 0x7f:
			dst = fmt.Appendf(dst, `\x%02x`, r)
		case r < 0x7f || unicode.IsPrint(r):
			dst = utf8.AppendRune(dst, r)
		case r <= 0xff:
			dst = fmt.Appendf(dst, `\x%02x`, r)
		case r <= 0xffff:
			dst = fmt.Appendf(dst, `\u%04x`, r)
		default:
			dst = fmt.Appendf(dst, `\U%08x`, r)
		}
	}
	return append(dst, quote)
}
