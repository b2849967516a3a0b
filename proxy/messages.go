package proxy

import (
	"bytes"
	"fmt"
	"math"
	"strconv"
	"strings"
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
	var system []byte
	for m := (members{b: r.body}); m.next(); {
		switch slot := f.slot(m.key); {
		case slot != nil:
			*slot = m.value
		case keyIs(m.key, "system"):
			system = m.value
		}
	}
	if pe := r.readCommon(); pe != nil {
		return pe
	}
	if !counting && (f.MaxTokens == nil || isNull(f.MaxTokens)) {
		return perr("max_tokens", "max_tokens: Field required") // Anthropic's words
	}
	if !counting && !positiveInt(f.MaxTokens) {
		return perr("max_tokens", "max_tokens must be a positive integer")
	}
	if pe := r.anthropicTools(f.Tools); pe != nil {
		return pe
	}
	raw := f.Messages
	if raw == nil || raw[0] != '[' {
		return perr("messages", "messages must be an array of messages")
	}
	msgs := r.anth[:0]
	for e := (elements{b: raw}); e.next(); {
		m, pe := r.anthropicRole(e.value, len(msgs))
		if pe != nil {
			return pe
		}
		msgs = append(msgs, m)
	}
	r.anth = msgs
	if len(msgs) == 0 {
		return perr("messages", "messages must not be empty")
	}
	sys, pe := r.anthropicSystem(system)
	if pe != nil {
		return pe
	}
	// Inline system messages, as vLLM places them (inline_system.py):
	// those leading the conversation join the system prompt; the others
	// stay where they are, out of a tool call's run, while there is a
	// system prompt, else are folded into the neighbouring user turns.
	lead := 0
	for lead < len(msgs) && msgs[lead].role == "system" {
		sys = joinText(sys, r.systemText(msgs[lead].content))
		lead++
	}
	if sys != "" {
		r.messages = append(r.messages, tokenize.Message{Role: "system", Content: sys})
	}
	rest := moveOutOfToolRuns(r.anthMoved[:0], msgs[lead:], r.anthHeld[:0])
	r.anthMoved = rest
	if sys == "" {
		rest = r.foldSystem(rest)
	}
	for k := range rest {
		if pe := r.anthropicMessage(&rest[k]); pe != nil {
			return pe
		}
	}
	return nil
}

// billingHeader starts the system block in which Claude Code sends a hash
// of each request: vLLM drops it, which would otherwise change the head of
// every prompt.
const billingHeader = "x-anthropic-billing-header"

// positiveInt reports whether v is a positive integer as pydantic reads
// one: 5, 5.0 or "5".
func positiveInt(v []byte) bool {
	if len(v) > 2 && v[0] == '"' {
		v = v[1 : len(v)-1]
	}
	f, err := strconv.ParseFloat(string(v), 64)
	return err == nil && f > 0 && f == math.Trunc(f) && f < 1<<53
}

// anthropicSystem is the system prompt's text: a string, or its text
// blocks concatenated; the billing header dropped.
func (r *apiRequest) anthropicSystem(raw []byte) (string, *paramError) {
	if raw == nil || isNull(raw) {
		return "", nil
	}
	if raw[0] != '"' && raw[0] != '[' {
		return "", perr("system", "system must be a string or an array of text blocks")
	}
	j := 0
	for e := (elements{b: raw}); raw[0] == '[' && e.next(); j++ {
		if typ, _ := blockOf(e.value); !knownBlock(typ) {
			return "", perr(fmt.Sprintf("system[%d]", j), "system blocks must be content blocks, such as text")
		}
	}
	return r.systemText(raw), nil
}

// systemText is the text of a system prompt or message's content: a
// string, or its text blocks concatenated, without the billing header.
func (r *apiRequest) systemText(raw []byte) string {
	if raw[0] == '"' {
		if s := r.decodeString(raw); !strings.HasPrefix(s, billingHeader) {
			return s
		}
		return ""
	}
	start := len(r.text)
	for e := (elements{b: raw}); e.next(); {
		if typ, v := blockOf(e.value); typ == "text" && v[blockText] != nil && v[blockText][0] == '"' {
			mark := len(r.text)
			r.text = appendJSONString(r.text, v[blockText])
			if bytes.HasPrefix(r.text[mark:], []byte(billingHeader)) {
				r.text = r.text[:mark]
			}
		}
	}
	return r.textFrom(start)
}

// joinText joins texts as vLLM's inline-system placement joins them.
func joinText(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "\n\n" + b
}

// anthMsg is one message of a Messages request, before it becomes chat
// messages: its role and content (raw JSON, or text when kvproxy made the
// message), and the system text folded into it.
type anthMsg struct {
	role     string
	content  []byte
	text     string
	prepend  string // before its own text
	append   string // after its own text, or its last tool result's
	i        int    // its place in the request
	from, to int    // its blocks in r.blocks
	// calls: it has a tool_use block; results: only tool_result blocks
	calls, results bool
}

// anthropicRole reads message i's role and content; Claude Code's ctx and
// msg roles are the user's, as vLLM reads them.
func (r *apiRequest) anthropicRole(raw []byte, i int) (anthMsg, *paramError) {
	if raw[0] != '{' {
		return anthMsg{}, perr(fmt.Sprintf("messages[%d]", i), "every message must be an object with a role and content")
	}
	var vals [2][]byte
	membersNamed(raw, roleMembers, vals[:])
	role := ""
	if vals[0] != nil && vals[0][0] == '"' {
		role = shortString(vals[0])
	}
	switch role {
	case "user", "assistant", "system":
	case "ctx", "msg":
		role = "user"
	default:
		return anthMsg{}, perr(fmt.Sprintf("messages[%d].role", i), "role must be user, assistant or system")
	}
	content := vals[1]
	if content == nil || content[0] != '"' && content[0] != '[' {
		return anthMsg{}, perr(fmt.Sprintf("messages[%d].content", i), "content must be a string or an array of content blocks")
	}
	m := anthMsg{role: role, content: content, i: i, from: len(r.blocks)}
	results := 0
	for e := (elements{b: content}); content[0] == '[' && e.next(); {
		typ, v := blockOf(e.value)
		if !knownBlock(typ) {
			return anthMsg{}, perr(fmt.Sprintf("messages[%d].content[%d].type", i, len(r.blocks)-m.from), "content blocks must be of type text, image, tool_use, tool_result, thinking, redacted_thinking or tool_reference")
		}
		m.calls = m.calls || typ == "tool_use"
		if typ == "tool_result" {
			results++
		}
		r.blocks = append(r.blocks, block{typ, v})
	}
	m.to = len(r.blocks)
	m.results = results > 0 && results == m.to-m.from
	return m, nil
}

func knownBlock(typ string) bool {
	switch typ {
	case "text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "tool_reference":
		return true
	}
	return false
}

// moveOutOfToolRuns moves system messages that come between an
// assistant's tool_use and the user message answering it after that
// message (vLLM's _move_out_of_tool_runs), appending to out. held is
// scratch.
func moveOutOfToolRuns(out, msgs, held []anthMsg) []anthMsg {
	awaiting := false
	for _, m := range msgs {
		if m.role == "system" {
			if awaiting {
				held = append(held, m)
			} else {
				out = append(out, m)
			}
			continue
		}
		if m.role == "assistant" {
			out, held = append(out, held...), held[:0]
		}
		out = append(out, m)
		if m.role == "user" {
			out, held = append(out, held...), held[:0]
		}
		awaiting = m.role == "assistant" && m.calls
	}
	return append(out, held...)
}

// foldSystem folds inline system messages into the user turns around them,
// as vLLM does when the request has no system prompt: after a user
// message, into its text (or its last tool result); after an assistant's,
// into the next user message, or a user message of their own.
func (r *apiRequest) foldSystem(msgs []anthMsg) []anthMsg {
	out := r.anthFolded[:0]
	defer func() { r.anthFolded = out }()
	pending := ""
	for _, m := range msgs {
		if m.role == "system" {
			text := r.systemText(m.content)
			if text == "" {
				continue
			}
			if len(out) > 0 && out[len(out)-1].role == "user" && pending == "" {
				last := &out[len(out)-1]
				last.append = joinText(last.append, text)
			} else {
				pending = joinText(pending, text)
			}
			continue
		}
		if pending != "" {
			if m.role == "user" {
				m.prepend = pending
			} else {
				out = append(out, anthMsg{role: "user", text: pending, i: m.i})
			}
			pending = ""
		}
		out = append(out, m)
	}
	if pending != "" {
		out = append(out, anthMsg{role: "user", text: pending, i: len(msgs)})
	}
	return out
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
	blockToolUseID
	blockMembersLen
)

var blockMembers = [blockMembersLen]string{"type", "text", "source", "id", "name", "input", "content", "thinking", "tool_use_id"}

// block is a scanned content block.
type block struct {
	typ string
	v   [blockMembersLen][]byte
}

var (
	typeMember      = []string{"type"}
	emptyJSONObject = []byte("{}")
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

// anthropicMessage appends the chat messages of m, as vLLM converts a
// message: a user's tool results first, as tool messages (images in them
// as a user message of their own), then the message itself, unless it
// carried nothing else.
func (r *apiRequest) anthropicMessage(m *anthMsg) *paramError {
	switch {
	case m.role == "system": // an inline system message, kept in place unless empty
		if text := r.systemText(m.content); text != "" {
			r.messages = append(r.messages, tokenize.Message{Role: "system", Content: text})
		}
		return nil
	case m.content == nil: // folded system text of its own
		r.messages = append(r.messages, tokenize.Message{Role: "user", Content: m.text})
		return nil
	case m.content[0] == '"':
		content := joinText(joinText(m.prepend, r.decodeString(m.content)), m.append)
		r.messages = append(r.messages, tokenize.Message{Role: m.role, Content: content})
		return nil
	}
	blocks := r.blocks[m.from:m.to]
	onlyResults := m.role == "user" && m.results
	if m.role == "user" {
		last := -1
		for k := range blocks {
			if blocks[k].typ == "tool_result" {
				last = k
			}
		}
		for k := range blocks {
			bl := &blocks[k]
			if bl.typ != "tool_result" {
				continue
			}
			msg := tokenize.Message{Role: "tool"}
			if id := bl.v[blockToolUseID]; id != nil && id[0] == '"' {
				msg.ToolCallID = r.decodeString(id)
			}
			folded := ""
			if onlyResults && k == last {
				folded = m.append
			}
			r.images = r.images[:0]
			start := len(r.text)
			r.text = r.appendToolResult(r.text, bl.v[blockContent], folded)
			msg.Content = r.textFrom(start)
			r.messages = append(r.messages, msg)
			// Its images follow it, as a user message of their own
			// (vLLM's _convert_user_tool_result).
			if len(r.images) > 0 {
				start := len(r.text)
				for k, url := range r.images {
					if k > 0 {
						r.text = append(r.text, '\n')
					}
					r.text = tokenize.AppendMediaStandIn(r.text, url)
				}
				r.messages = append(r.messages, tokenize.Message{Role: "user", Content: r.textFrom(start)})
			}
		}
	}
	msg := tokenize.Message{Role: m.role}
	// Its own text and images: one text is the content; more are parts,
	// joined as the chat path joins them. Folded system text joins the
	// text at either end, or is a text of its own there.
	r.parts = r.parts[:0]
	for k := range blocks {
		bl := &blocks[k]
		v := &bl.v
		switch {
		case bl.typ == "text" && v[blockText] != nil && v[blockText][0] == '"' && len(v[blockText]) > 2:
			r.parts = append(r.parts, part{text: r.decodeString(v[blockText])})
		case bl.typ == "image" && v[blockSource] != nil && v[blockSource][0] == '{' && !emptyObject(v[blockSource]):
			r.parts = append(r.parts, part{image: true, url: r.imageURL(v[blockSource])})
		case bl.typ == "tool_result" && m.role == "assistant":
			start := len(r.text)
			r.text = append(r.text, "Tool result: "...)
			r.text = r.appendToolResult(r.text, v[blockContent], "")
			r.parts = append(r.parts, part{text: r.textFrom(start)})
		}
	}
	if m.prepend != "" {
		if len(r.parts) > 0 && !r.parts[0].image {
			r.parts[0].text = joinText(m.prepend, r.parts[0].text)
		} else {
			r.parts = append(r.parts, part{})
			copy(r.parts[1:], r.parts)
			r.parts[0] = part{text: m.prepend}
		}
	}
	if m.append != "" && !onlyResults {
		if n := len(r.parts); n > 0 && !r.parts[n-1].image {
			r.parts[n-1].text = joinText(r.parts[n-1].text, m.append)
		} else {
			r.parts = append(r.parts, part{text: m.append})
		}
	}
	start := len(r.text)
	for k, p := range r.parts {
		if k > 0 {
			r.text = append(r.text, '\n')
		}
		if p.image {
			r.text = tokenize.AppendMediaStandIn(r.text, p.url)
		} else {
			r.text = append(r.text, p.text...)
		}
	}
	msg.Content = r.textFrom(start)
	start = len(r.text)
	thinking := false // a thinking block, even an empty one, keeps the message
	for k := range blocks {
		if bl := &blocks[k]; bl.typ == "thinking" && bl.v[blockThinking] != nil && bl.v[blockThinking][0] == '"' {
			r.text = appendJSONString(r.text, bl.v[blockThinking])
			thinking = true
		}
	}
	msg.Reasoning = r.textFrom(start)
	start = len(r.text)
	calls := 0
	for k := range blocks {
		bl := &blocks[k]
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
	if len(r.parts) == 0 && calls == 0 && !thinking && m.role == "user" {
		return nil // vLLM drops a user message left empty (one of tool results only)
	}
	r.messages = append(r.messages, msg)
	return nil
}

// part is a text or an image of a message's content.
type part struct {
	text  string
	image bool
	url   []byte
}

// imageURL is the URL vLLM gives an image block's source: its url, or a
// data: URL of its base64 data (JPEG unless it names its media type).
func (r *apiRequest) imageURL(source []byte) []byte {
	var v [4][]byte
	membersNamed(source, imageSourceMembers, v[:])
	str := func(raw []byte) []byte {
		if raw != nil && raw[0] == '"' {
			return r.jsonStringBytes(raw)
		}
		return nil
	}
	if t := v[0]; t != nil && t[0] == '"' && shortString(t) == "url" {
		return append([]byte(nil), str(v[1])...)
	}
	url := []byte("data:")
	if mt := str(v[2]); mt != nil {
		url = append(url, mt...)
	} else {
		url = append(url, "image/jpeg"...)
	}
	url = append(url, ";base64,"...)
	return append(url, str(v[3])...)
}

var imageSourceMembers = []string{"type", "url", "media_type", "data"}

// appendToolResult appends a tool result's content as vLLM makes the tool
// message of it: a string, or its text blocks joined by newlines (its
// images go to r.images, for a user message of their own); folded, system
// text folded into it (joined to its last text).
func (r *apiRequest) appendToolResult(dst, content []byte, folded string) []byte {
	start := len(dst)
	lastText := true // the content ends with text (or is none): folded text joins it
	switch {
	case content == nil || isNull(content):
	case content[0] == '"':
		dst = appendJSONString(dst, content)
	case content[0] == '[':
		n := 0
		for e := (elements{b: content}); e.next(); {
			typ, v := blockOf(e.value)
			lastText = typ == "text"
			switch {
			case typ == "text" && v[blockText] != nil && v[blockText][0] == '"':
				if n++; n > 1 {
					dst = append(dst, '\n')
				}
				dst = appendJSONString(dst, v[blockText])
			case typ == "image":
				// vLLM takes a missing source as {} (a data: URL of
				// nothing), and skips an image whose URL is empty.
				source := v[blockSource]
				if source == nil || source[0] != '{' {
					source = emptyJSONObject
				}
				if url := r.imageURL(source); len(url) > 0 {
					r.images = append(r.images, url)
				}
			}
		}
	}
	if folded == "" {
		return dst
	}
	switch {
	case len(dst) == start:
		return append(dst, folded...)
	case lastText:
		return append(append(dst, "\n\n"...), folded...)
	}
	return append(append(dst, '\n'), folded...)
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
		// Compact, as the engine's template writes it whatever the
		// client's spacing.
		mark := len(r.text)
		r.text = appendCompact(r.text, v[2])
		var typ [1][]byte
		switch schema := r.text[mark:]; {
		case emptyObject(schema):
			r.text = append(r.text[:mark], `{"type":"object"}`...)
		case membersNamed(schema, typeMember, typ[:])[0] == nil:
			r.text = append(r.text[:len(r.text)-1], `,"type":"object"}`...)
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
	case fasthttp.StatusGatewayTimeout:
		return "timeout_error"
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

// promptTooLong begins Anthropic's error for a prompt over the context.
const promptTooLong = "prompt is too long: "

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
			Code    any    `json:"code"`
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
	if e.Error.Code == "context_length_exceeded" && !strings.HasPrefix(msg, promptTooLong) {
		// An engine's refusal, in the words Anthropic's clients recognize.
		msg = promptTooLong + msg
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
	name, data := eventFields(ev)
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

// anthropicFailEvent is the error event that ends a stream failed with
// status.
func anthropicFailEvent(out []byte, status int, msg string) []byte {
	out = append(out, "event: error\ndata: "...)
	return append(append(out, anthropicErrorJSON(status, msg)...), "\n\n"...)
}
