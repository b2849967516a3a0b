package proxy

import (
	"bytes"
	"fmt"
	"strconv"
	"unsafe"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/tokenize"
)

// The Anthropic Messages API (POST /v1/messages), which vLLM serves by
// turning the request into a chat request (_convert_anthropic_to_openai_request)
// and the chat answer back. parseAnthropic makes the same chat messages and
// tools, so a message is tokenized, hashed and counted like its chat
// equivalent. Errors on this path are in Anthropic's shape
// ({"type":"error","error":{"type","message"}}), which its SDKs read.

var messagesPath = []byte("/v1/messages")

// parseAnthropic fills r, new or reset, from a Messages API request. A
// count_tokens request (counting) needs no max_tokens.
func (r *apiRequest) parseAnthropic(body []byte, counting bool) *paramError {
	r.addGenPrompt = true
	r.converted = true
	if pe := r.setBody(body); pe != nil {
		return pe
	}
	f := &r.fields
	var maxTokens, system []byte
	for m := (members{b: r.body}); m.next(); {
		switch slot := f.slot(m.key); {
		case slot != nil:
			*slot = m.value
		case keyIs(m.key, "max_tokens"):
			maxTokens = m.value
		case keyIs(m.key, "system"):
			system = m.value
		}
	}
	if pe := r.readCommon(); pe != nil {
		return pe
	}
	if !counting {
		if n, err := strconv.Atoi(string(maxTokens)); err != nil || n <= 0 {
			return perr("max_tokens", "max_tokens must be a positive integer")
		}
	}
	if pe := r.anthropicSystem(system); pe != nil {
		return pe
	}
	if pe := r.anthropicTools(f.Tools); pe != nil {
		return pe
	}
	raw := f.Messages
	if raw == nil || raw[0] != '[' {
		return perr("messages", "messages must be an array of messages")
	}
	i := 0
	for e := (elements{b: raw}); e.next(); i++ {
		if pe := r.anthropicMessage(e.value, i); pe != nil {
			return pe
		}
	}
	if i == 0 {
		return perr("messages", "messages must not be empty")
	}
	return nil
}

// anthropicSystem: a string, or text blocks concatenated, is the system
// message.
func (r *apiRequest) anthropicSystem(raw []byte) *paramError {
	if raw == nil || isNull(raw) {
		return nil
	}
	switch raw[0] {
	case '"':
		if s := r.decodeString(raw); s != "" {
			r.messages = append(r.messages, tokenize.Message{Role: "system", Content: s})
		}
		return nil
	case '[':
		if emptyArray(raw) {
			return nil // vLLM: an empty list is no system prompt
		}
		start := len(r.text)
		for e := (elements{b: raw}); e.next(); {
			typ, v := blockOf(e.value)
			if typ == "" {
				return perr("system", "system must be a string or an array of text blocks")
			}
			if typ == "text" && v[blockText] != nil && v[blockText][0] == '"' {
				r.text = appendJSONString(r.text, v[blockText])
			}
		}
		r.messages = append(r.messages, tokenize.Message{Role: "system", Content: r.textFrom(start)})
		return nil
	}
	return perr("system", "system must be a string or an array of text blocks")
}

// The members of a content block parseAnthropic reads.
const (
	blockType = iota
	blockText
	blockSource
	blockID
	blockName
	blockInput
	blockContent
	blockThinking
	blockMembersLen
)

var blockMembers = [blockMembersLen]string{"type", "text", "source", "id", "name", "input", "content", "thinking"}

// block is a scanned content block.
type block struct {
	typ string
	v   [blockMembersLen][]byte
}

var (
	emptyJSONObject = []byte("{}")
	sourceMembers   = []string{"data"}
	roleMembers     = []string{"role", "content"}
)

// blockOf reads a content block: its type ("" when it is not an object
// with a string type) and members.
func blockOf(raw []byte) (string, [blockMembersLen][]byte) {
	var v [blockMembersLen][]byte
	if raw[0] != '{' {
		return "", v
	}
	membersNamed(raw, blockMembers[:], v[:])
	if t := v[blockType]; t != nil && t[0] == '"' && len(t) > 2 {
		return shortString(t), v
	}
	return "", v
}

// anthropicMessage appends the chat messages of message i: its tool
// results in a user message first (as tool messages), then the message
// itself, unless it carried nothing else.
func (r *apiRequest) anthropicMessage(raw []byte, i int) *paramError {
	if raw[0] != '{' {
		return perr(fmt.Sprintf("messages[%d]", i), "every message must be an object with a role and content")
	}
	var vals [2][]byte
	membersNamed(raw, roleMembers, vals[:])
	role := ""
	if vals[0] != nil && vals[0][0] == '"' {
		role = shortString(vals[0])
	}
	if role != "user" && role != "assistant" {
		return perr(fmt.Sprintf("messages[%d].role", i), "role must be user or assistant")
	}
	content := vals[1]
	if content == nil || content[0] != '"' && content[0] != '[' {
		return perr(fmt.Sprintf("messages[%d].content", i), "content must be a string or an array of content blocks")
	}
	if content[0] == '"' {
		r.messages = append(r.messages, tokenize.Message{Role: role, Content: r.decodeString(content)})
		return nil
	}
	// Scanned once; an unknown block fails the request before anything
	// is kept.
	r.blocks = r.blocks[:0]
	j := 0
	for e := (elements{b: content}); e.next(); j++ {
		typ, v := blockOf(e.value)
		switch typ {
		case "text", "image", "tool_use", "tool_result", "thinking":
		default:
			return perr(fmt.Sprintf("messages[%d].content[%d].type", i, j), "content blocks must be of type text, image, tool_use, tool_result or thinking")
		}
		r.blocks = append(r.blocks, block{typ, v})
	}
	if role == "user" {
		for k := range r.blocks {
			if bl := &r.blocks[k]; bl.typ == "tool_result" {
				msg := tokenize.Message{Role: "tool"}
				if id := bl.v[blockID]; id != nil && id[0] == '"' {
					msg.ToolCallID = r.decodeString(id) // vLLM reads id, not tool_use_id
				}
				start := len(r.text)
				r.text = r.appendToolResult(r.text, bl.v[blockContent])
				msg.Content = r.textFrom(start)
				r.messages = append(r.messages, msg)
			}
		}
	}
	msg := tokenize.Message{Role: role}
	// Text and images: one text block is the content; more are parts,
	// joined as the chat path joins them.
	start, parts := len(r.text), 0
	for k := range r.blocks {
		bl := &r.blocks[k]
		v := &bl.v
		switch {
		case bl.typ == "text" && v[blockText] != nil && v[blockText][0] == '"' && len(v[blockText]) > 2:
		case bl.typ == "image" && v[blockSource] != nil && v[blockSource][0] == '{' && !emptyObject(v[blockSource]):
		case bl.typ == "tool_result" && role == "assistant":
		default:
			continue
		}
		if parts++; parts > 1 {
			r.text = append(r.text, '\n')
		}
		switch bl.typ {
		case "text":
			r.text = appendJSONString(r.text, v[blockText])
		case "image":
			var data [1][]byte
			membersNamed(v[blockSource], sourceMembers, data[:])
			url := []byte{}
			if data[0] != nil && data[0][0] == '"' {
				url = r.jsonStringBytes(data[0])
			}
			r.text = tokenize.AppendMediaStandIn(r.text, url)
		default:
			r.text = append(r.text, "Tool result: "...)
			r.text = r.appendToolResult(r.text, v[blockContent])
		}
	}
	msg.Content = r.textFrom(start)
	start = len(r.text)
	thinking := false // a thinking block, even an empty one, keeps the message
	for k := range r.blocks {
		if bl := &r.blocks[k]; bl.typ == "thinking" && bl.v[blockThinking] != nil && bl.v[blockThinking][0] == '"' {
			r.text = appendJSONString(r.text, bl.v[blockThinking])
			thinking = true
		}
	}
	msg.Reasoning = r.textFrom(start)
	start = len(r.text)
	calls := 0
	for k := range r.blocks {
		bl := &r.blocks[k]
		if bl.typ != "tool_use" {
			continue
		}
		v := &bl.v
		if calls++; calls == 1 {
			r.text = append(r.text, '[')
		} else {
			r.text = append(r.text, ',')
		}
		r.text = append(r.text, `{"id":`...)
		r.text = appendStringOr(r.text, v[blockID], `""`)
		r.text = append(r.text, `,"type":"function","function":{"name":`...)
		r.text = appendStringOr(r.text, v[blockName], `""`)
		r.text = append(r.text, `,"arguments":`...)
		input := v[blockInput]
		if input == nil || isNull(input) || input[0] != '{' || emptyObject(input) {
			input = emptyJSONObject
		}
		r.media = appendPyDumps(r.media[:0], input)
		r.text = appendJSONQuoted(r.text, unsafe.String(unsafe.SliceData(r.media), len(r.media)))
		r.text = append(r.text, "}}"...)
	}
	if calls > 0 {
		r.text = append(r.text, ']')
		msg.ToolCalls = r.textFrom(start)
	}
	if parts == 0 && calls == 0 && !thinking {
		return nil // vLLM drops it (a user message of tool results only)
	}
	r.messages = append(r.messages, msg)
	return nil
}

// appendToolResult appends str(content) of a tool result as vLLM renders
// it: the string, Python's repr of blocks, or nothing.
func (r *apiRequest) appendToolResult(dst, content []byte) []byte {
	switch {
	case content == nil || isNull(content) || string(content) == `""` || emptyArray(content):
		return dst
	case content[0] == '"':
		return appendJSONString(dst, content)
	}
	return appendPyRepr(dst, content)
}

func appendStringOr(dst, v []byte, or string) []byte {
	if v != nil && v[0] == '"' {
		return append(dst, v...)
	}
	return append(dst, or...)
}

// emptyObject reports whether v, valid JSON, is an empty object.
func emptyObject(v []byte) bool {
	return v[0] == '{' && len(bytes.TrimSpace(v[1:len(v)-1])) == 0
}

// anthropicTools makes the chat tools vLLM gives the template: each
// {"type": "function", "function": {name, description, parameters}}, the
// input_schema as parameters with "type": "object" added when it has no
// type. No tools member is no tools.
func (r *apiRequest) anthropicTools(raw []byte) *paramError {
	if raw == nil || isNull(raw) {
		return nil
	}
	if raw[0] != '[' {
		return perr("tools", "tools must be an array of tools")
	}
	start := len(r.text)
	r.text = append(r.text, '[')
	n := 0
	for e := (elements{b: raw}); e.next(); n++ {
		var v [3][]byte
		if e.value[0] == '{' {
			membersNamed(e.value, []string{"name", "description", "input_schema"}, v[:])
		}
		if v[0] == nil || v[0][0] != '"' || v[2] == nil || v[2][0] != '{' {
			return perr(fmt.Sprintf("tools[%d]", n), "a tool needs a name (a string) and an input_schema (an object)")
		}
		if n > 0 {
			r.text = append(r.text, ',')
		}
		r.text = append(r.text, `{"type":"function","function":{"name":`...)
		r.text = append(r.text, v[0]...)
		r.text = append(r.text, `,"description":`...)
		r.text = appendOrNull(r.text, v[1])
		r.text = append(r.text, `,"parameters":`...)
		schema := v[2]
		var typ [1][]byte
		if membersNamed(schema, []string{"type"}, typ[:])[0] != nil || emptyObject(schema) {
			if emptyObject(schema) {
				schema = []byte(`{"type":"object"}`)
			}
			r.text = append(r.text, schema...)
		} else {
			end := bytes.LastIndexByte(schema, '}')
			r.text = append(r.text, schema[:end]...)
			r.text = append(r.text, `,"type":"object"}`...)
		}
		r.text = append(r.text, "}}"...)
	}
	r.text = append(r.text, ']')
	r.tools = r.textFrom(start)
	return nil
}

// anthropicErrorType is Anthropic's error type for a status.
func anthropicErrorType(status int) string {
	switch status {
	case fasthttp.StatusBadRequest:
		return "invalid_request_error"
	case fasthttp.StatusUnauthorized:
		return "authentication_error"
	case fasthttp.StatusForbidden:
		return "permission_error"
	case fasthttp.StatusNotFound:
		return "not_found_error"
	case fasthttp.StatusRequestEntityTooLarge:
		return "request_too_large"
	case fasthttp.StatusTooManyRequests:
		return "rate_limit_error"
	case fasthttp.StatusServiceUnavailable, 529:
		return "overloaded_error"
	}
	if status >= 400 && status < 500 {
		return "invalid_request_error"
	}
	return "api_error"
}

// anthropicErrorJSON is an Anthropic error object.
func anthropicErrorJSON(status int, msg string) []byte {
	b := append([]byte(`{"type":"error","error":{"type":`), strconv.Quote(anthropicErrorType(status))...)
	b = append(b, `,"message":`...)
	b = appendJSONQuoted(b, msg)
	return append(b, "}}"...)
}

// toAnthropicError turns the error answer of a Messages API request, in
// OpenAI's shape (kvproxy's own, or an engine's reshaped), into
// Anthropic's. An answer already in Anthropic's shape stays as it is.
func toAnthropicError(ctx *fasthttp.RequestCtx) {
	status := ctx.Response.StatusCode()
	if status < 400 || ctx.Response.IsBodyStream() {
		return
	}
	var e struct {
		Type  string `json:"type"`
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	body := ctx.Response.Body()
	if json.Unmarshal(body, &e) != nil || e.Type == "error" {
		return
	}
	msg := e.Error.Message
	if msg == "" {
		msg = string(body)
	}
	ctx.Response.Header.SetContentType("application/json")
	ctx.SetBody(anthropicErrorJSON(status, msg))
}

// onAnthropicEvent inspects one event of a streamed message: a
// content_block_delta carries output (text, thinking, a tool call's
// input), the first of them ending the prefill; message_stop (or vLLM's
// [DONE] after it) ends the stream; usage comes in message_start and
// message_delta.
func (r *relay) onAnthropicEvent(ev []byte) {
	var name, data []byte
	for len(ev) > 0 {
		line := ev
		if k, n := lineEnd(ev); k >= 0 {
			line, ev = ev[:k], ev[k+n:]
		} else {
			line, ev = bytes.TrimSuffix(ev, cr), nil
		}
		switch {
		case bytes.HasPrefix(line, eventPrefix):
			name = bytes.TrimLeft(line[len(eventPrefix):], " ")
		case bytes.HasPrefix(line, dataPrefix) && data == nil:
			data = bytes.TrimLeft(line[len(dataPrefix):], " ")
		}
	}
	if data == nil {
		return
	}
	if bytes.Equal(data, doneData) {
		r.sawDone = true
		return
	}
	if name == nil {
		name = typeOf(data)
	}
	switch string(name) {
	case "content_block_delta":
		r.onToken()
		return
	case "message_stop":
		r.sawDone = true
	case "error":
		r.sawDone = true // terminal: the engine ended the message itself
		r.x.errMsg = "engine error event"
	}
	r.x.usage.read(data)
}

// anthropicFailEvent is the error event that ends a failed stream.
func anthropicFailEvent(out []byte, msg string) []byte {
	out = append(out, "event: error\ndata: "...)
	return append(append(out, anthropicErrorJSON(fasthttp.StatusBadGateway, msg)...), "\n\n"...)
}
