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
	"unicode/utf16"

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
	CacheSalt     string          `json:"cache_salt"` // current vLLM passes it on (_build_base_request)
}

// anthropicChat is a Messages request converted: the chat messages and
// the template's tools ("" for none).
type anthropicChat struct {
	messages []tokenize.Message
	tools    string
}

// convertMessages is _convert_anthropic_to_openai_request, with vLLM's
// placement of inline system messages (inline_system.py): those leading
// messages join the system prompt, the others stay in place when there is
// a system prompt and are folded into their neighbours when there is not.
func convertMessages(req *messagesRequest) (*anthropicChat, error) {
	if req.Model == "" {
		return nil, invalid("model", "Model is required")
	}
	system, err := systemPromptText(req.System)
	if err != nil {
		return nil, err
	}
	var raws []json.RawMessage
	if m := bytes.TrimSpace(req.Messages); len(m) == 0 || m[0] != '[' || json.Unmarshal(m, &raws) != nil {
		return nil, invalid("messages", "messages must be an array of messages")
	}
	if len(raws) == 0 {
		return nil, invalid("messages", "messages must contain at least one item")
	}
	msgs := make([]*inMessage, len(raws))
	for i, raw := range raws {
		if msgs[i], err = parseMessage(raw, i); err != nil {
			return nil, err
		}
	}
	leading := 0
	for leading < len(msgs) && msgs[leading].role == "system" {
		system = joinTexts(system, msgs[leading].systemText())
		leading++
	}
	rest := moveOutOfToolRuns(msgs[leading:])
	if system == "" {
		rest = foldInlineSystem(rest)
	}
	c := &anthropicChat{}
	if system != "" {
		c.messages = append(c.messages, tokenize.Message{Role: "system", Content: system})
	}
	for _, m := range rest {
		c.messages = m.appendChat(c.messages)
	}
	if c.tools, err = anthropicTools(req.Tools); err != nil {
		return nil, err
	}
	if err := checkToolChoice(req.ToolChoice); err != nil {
		return nil, err
	}
	return c, nil
}

// billingHeader starts the per-request hash Claude Code puts in its
// system prompt; vLLM drops it, as it would defeat prefix caching.
const billingHeader = "x-anthropic-billing-header"

// joinTexts is inline_system._join: the non-empty texts joined by a blank
// line.
func joinTexts(texts ...string) string {
	var b strings.Builder
	for _, t := range texts {
		if t == "" {
			continue
		}
		if b.Len() > 0 {
			b.WriteString("\n\n")
		}
		b.WriteString(t)
	}
	return b.String()
}

// blocksText is the text of a list of blocks: its text blocks' texts
// run together, billing headers left out.
func blocksText(blocks []*contentBlock) string {
	var b strings.Builder
	for _, blk := range blocks {
		if blk.typ == "text" && !strings.HasPrefix(blk.text, billingHeader) {
			b.WriteString(blk.text)
		}
	}
	return b.String()
}

// systemPromptText is the text of the system prompt: a string as it is
// ("" when it is a billing header), a list of blocks as blocksText.
func systemPromptText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return "", invalid("system", "system is not a valid string")
		}
		if strings.HasPrefix(s, billingHeader) {
			return "", nil
		}
		return s, nil
	}
	var raws []json.RawMessage
	if raw[0] != '[' || json.Unmarshal(raw, &raws) != nil {
		return "", invalid("system", "system must be a string or an array of content blocks")
	}
	blocks := make([]*contentBlock, len(raws))
	for j, braw := range raws {
		var err error
		if blocks[j], err = parseBlock(braw, "system", "system", j); err != nil {
			return "", err
		}
	}
	return blocksText(blocks), nil
}

// inMessage is one message of the request: its role (ctx and msg read
// as user) and its content, a string or a list of blocks.
type inMessage struct {
	role     string
	isString bool
	str      string
	blocks   []*contentBlock
}

// systemText is inline_system.system_text: the text of a system message
// without the billing header.
func (m *inMessage) systemText() string {
	if m.isString {
		if strings.HasPrefix(m.str, billingHeader) {
			return ""
		}
		return m.str
	}
	return blocksText(m.blocks)
}

func (m *inMessage) hasToolUse() bool {
	return slices.ContainsFunc(m.blocks, func(b *contentBlock) bool { return b.typ == "tool_use" })
}

var messageRoles = map[string]string{"user": "user", "assistant": "assistant", "system": "system", "ctx": "user", "msg": "user"}

// parseMessage reads message i of messages.
func parseMessage(raw json.RawMessage, i int) (*inMessage, error) {
	where := fmt.Sprintf("messages[%d]", i)
	var m struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] != '{' || unmarshalExact(t, &m) != nil {
		return nil, invalid("messages", "%s must be an object with role and content", where)
	}
	msg := &inMessage{role: messageRoles[m.Role]}
	if msg.role == "" {
		return nil, invalid("messages", "%s.role must be user, assistant or system", where)
	}
	content := bytes.TrimSpace(m.Content)
	if len(content) > 0 && content[0] == '"' {
		if json.Unmarshal(content, &msg.str) != nil {
			return nil, invalid("messages", "%s.content is not a valid string", where)
		}
		msg.isString = true
		return msg, nil
	}
	var raws []json.RawMessage
	if len(content) == 0 || content[0] != '[' || json.Unmarshal(content, &raws) != nil {
		return nil, invalid("messages", "%s.content must be a string or an array of content blocks", where)
	}
	msg.blocks = make([]*contentBlock, len(raws))
	for j, braw := range raws {
		var err error
		if msg.blocks[j], err = parseBlock(braw, "messages", where+".content", j); err != nil {
			return nil, err
		}
	}
	return msg, nil
}

// moveOutOfToolRuns is inline_system._move_out_of_tool_runs: a system
// message between an assistant's tool_use and the user message answering
// it moves to just after that user message (or before the next assistant
// message).
func moveOutOfToolRuns(msgs []*inMessage) []*inMessage {
	var out, held []*inMessage
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
		awaiting = m.role == "assistant" && m.hasToolUse()
	}
	return append(out, held...)
}

// foldInlineSystem is normalize_inline_system's loop: each system
// message's text goes into the user message before it, or (after an
// assistant message) into the next user message, a new one when an
// assistant message or the end comes first.
func foldInlineSystem(msgs []*inMessage) []*inMessage {
	var out []*inMessage
	var pending []string
	for _, m := range msgs {
		if m.role == "system" {
			text := m.systemText()
			switch {
			case text == "":
			case len(out) > 0 && out[len(out)-1].role == "user" && pending == nil:
				out[len(out)-1].appendText(text)
			default:
				pending = append(pending, text)
			}
			continue
		}
		if pending != nil {
			text := joinTexts(pending...)
			pending = nil
			if m.role == "user" {
				m.prependText(text)
			} else {
				out = append(out, &inMessage{role: "user", isString: true, str: text})
			}
		}
		out = append(out, m)
	}
	if pending != nil {
		out = append(out, &inMessage{role: "user", isString: true, str: joinTexts(pending...)})
	}
	return out
}

// appendText is inline_system._append_to_user: text joins the last tool
// result when the message is all tool results, else the message's own
// last text (a new text block when its last own block is not text).
func (m *inMessage) appendText(text string) {
	if m.isString {
		m.str = joinTexts(m.str, text)
		return
	}
	if len(m.blocks) > 0 && !slices.ContainsFunc(m.blocks, func(b *contentBlock) bool { return b.typ != "tool_result" }) {
		m.blocks[len(m.blocks)-1].result.appendText(text)
		return
	}
	for j := len(m.blocks) - 1; j >= 0; j-- {
		if b := m.blocks[j]; b.typ != "tool_result" {
			if b.typ == "text" {
				b.text = joinTexts(b.text, text)
				return
			}
			break
		}
	}
	m.blocks = append(m.blocks, &contentBlock{typ: "text", text: text})
}

// prependText puts text before a user message's own text, a new text
// block when its first own block is not text.
func (m *inMessage) prependText(text string) {
	if m.isString {
		m.str = joinTexts(text, m.str)
		return
	}
	for _, b := range m.blocks {
		if b.typ != "tool_result" {
			if b.typ == "text" {
				b.text = joinTexts(text, b.text)
				return
			}
			break
		}
	}
	m.blocks = slices.Insert(m.blocks, 0, &contentBlock{typ: "text", text: text})
}

// appendChat appends the chat messages of m: a system message's text
// unless empty, a string message as it is; from a list of blocks, the tool messages of its tool results
// (a user message's) and a user message of their images, then the message
// itself unless it ends up with nothing to say.
func (m *inMessage) appendChat(out []tokenize.Message) []tokenize.Message {
	if m.role == "system" {
		if text := m.systemText(); text != "" {
			return append(out, tokenize.Message{Role: "system", Content: text})
		}
		return out
	}
	if m.isString {
		return append(out, tokenize.Message{Role: m.role, Content: m.str})
	}
	msg := tokenize.Message{Role: m.role}
	var own chatParts
	var calls []byte
	var reasoning []string
	for _, b := range m.blocks {
		switch b.typ {
		case "text":
			if b.text != "" {
				own.addText(b.text)
			}
		case "image":
			if len(b.source) > 0 {
				own.addImage(b.imageURL)
			}
		case "thinking":
			if b.thinking != nil {
				reasoning = append(reasoning, *b.thinking)
			}
		case "tool_use":
			calls = appendToolCall(calls, b)
		case "tool_result":
			if m.role == "user" {
				out = append(out, tokenize.Message{Role: "tool", Content: b.result.text(), ToolCallID: b.toolUseID})
				// Its images follow it, as a user message of their own
				// (vLLM's _convert_user_tool_result).
				var images chatParts
				for _, url := range b.result.images() {
					images.addImage(url)
				}
				if images.n > 0 {
					out = append(out, tokenize.Message{Role: "user", Content: string(images.text)})
				}
			} else {
				own.addText("Tool result: " + b.result.text())
			}
		}
	}
	if calls != nil {
		msg.ToolCalls = string(append(calls, ']'))
	}
	msg.Reasoning = strings.Join(reasoning, "")
	if own.n == 0 && calls == nil && reasoning == nil && m.role == "user" {
		return out // vLLM drops a user message left empty
	}
	msg.Content = string(own.text)
	return append(out, msg)
}

// chatParts is a message's content parts as the chat path joins them:
// text as it is, an image as its media stand-in, one line each.
type chatParts struct {
	text []byte
	n    int
}

func (p *chatParts) next() {
	if p.n++; p.n > 1 {
		p.text = append(p.text, '\n')
	}
}

func (p *chatParts) addText(s string) {
	p.next()
	p.text = append(p.text, s...)
}

func (p *chatParts) addImage(url string) {
	p.next()
	p.text = tokenize.AppendMediaStandIn(p.text, []byte(url))
}

// toolResult is a tool_result block's content: a string, or a list of
// items of which text and image ones count; nil when null or absent.
type toolResult struct {
	isList bool
	str    string
	items  []resultItem
}

type resultItem struct {
	typ, text string
	url       string // an image's
	hasURL    bool   // url is not empty
}

// text is the tool message's content: a string as it is, a list's texts
// one a line.
func (r *toolResult) text() string {
	if r == nil {
		return ""
	}
	if !r.isList {
		return r.str
	}
	var texts []string
	for _, it := range r.items {
		if it.typ == "text" {
			texts = append(texts, it.text)
		}
	}
	return strings.Join(texts, "\n")
}

func (r *toolResult) images() []string {
	var urls []string
	if r != nil {
		for _, it := range r.items {
			if it.hasURL {
				urls = append(urls, it.url)
			}
		}
	}
	return urls
}

// appendText is _add_text at the end of the content: joined onto a
// string or a last text item, else a new text item.
func (r *toolResult) appendText(text string) {
	switch {
	case !r.isList:
		r.str = joinTexts(r.str, text)
	case len(r.items) > 0 && r.items[len(r.items)-1].typ == "text":
		r.items[len(r.items)-1].text = joinTexts(r.items[len(r.items)-1].text, text)
	default:
		r.items = append(r.items, resultItem{typ: "text", text: text})
	}
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
	thinking       *string
	imageURL       string      // an image's, from its source
	toolUseID      string      // a tool result's, "" when absent
	result         *toolResult // a tool result's content
}

// blockTypes are the block types vLLM accepts; redacted_thinking and
// tool_reference blocks say nothing in the prompt.
var blockTypes = map[string]bool{"text": true, "image": true, "tool_use": true, "tool_result": true, "thinking": true,
	"redacted_thinking": true, "tool_reference": true}

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
		return bad("type must be one of text, image, tool_use, tool_result, thinking, redacted_thinking, tool_reference")
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
	var text, signature, toolUseID *string
	var ok bool
	for _, f := range []struct {
		k string
		p **string
	}{{"text", &text}, {"id", &b.id}, {"name", &b.name}, {"thinking", &b.thinking}, {"signature", &signature}, {"tool_use_id", &toolUseID}} {
		if *f.p, ok = str(f.k); !ok {
			return bad("%s must be a string", f.k)
		}
	}
	if text != nil {
		b.text = *text
	}
	if toolUseID != nil {
		b.toolUseID = *toolUseID
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
	if b.typ == "image" && len(b.source) > 0 {
		var err error
		if b.imageURL, err = imageURL(b.source); err != nil {
			return bad("%v", err)
		}
	}
	if b.input, ok = obj("input"); !ok {
		return bad("input must be an object")
	}
	if v := m["is_error"]; len(v) > 0 && string(v) != "null" && string(v) != "true" && string(v) != "false" {
		return bad("is_error must be a boolean")
	}
	result, err := parseToolResult(bytes.TrimSpace(m["content"]))
	if err != nil {
		return bad("%v", err)
	}
	if b.typ == "tool_result" {
		b.result = result
	}
	return b, nil
}

// parseToolResult reads a block's content: null, a string or a list of
// objects, the text and image ones kept.
func parseToolResult(v json.RawMessage) (*toolResult, error) {
	r := &toolResult{}
	if len(v) == 0 || string(v) == "null" {
		return r, nil
	}
	if v[0] == '"' {
		return r, json.Unmarshal(v, &r.str)
	}
	var items []json.RawMessage
	if v[0] != '[' || json.Unmarshal(v, &items) != nil {
		return nil, fmt.Errorf("content must be a string or an array of objects")
	}
	r.isList = true
	for _, raw := range items {
		var it map[string]json.RawMessage
		if raw = bytes.TrimSpace(raw); raw[0] != '{' || json.Unmarshal(raw, &it) != nil {
			return nil, fmt.Errorf("content must be a string or an array of objects")
		}
		var item resultItem
		json.Unmarshal(it["type"], &item.typ)
		switch item.typ {
		case "text":
			json.Unmarshal(it["text"], &item.text)
		case "image":
			var source map[string]json.RawMessage // absent: vLLM's {}
			json.Unmarshal(it["source"], &source)
			var err error
			if item.url, err = imageURL(source); err != nil {
				return nil, err
			}
			item.hasURL = item.url != ""
		}
		r.items = append(r.items, item)
	}
	return r, nil
}

// imageURL is the url vLLM makes of an image's source: the url of a
// "url" source, else a base64 data: URL of its data.
func imageURL(source map[string]json.RawMessage) (string, error) {
	str := func(k string) (string, error) {
		v, ok := source[k]
		if !ok || string(v) == "null" {
			return "", nil
		}
		var s string
		if len(v) == 0 || v[0] != '"' || json.Unmarshal(v, &s) != nil {
			return "", fmt.Errorf("an image's source.%s must be a string", k)
		}
		return s, nil
	}
	typ, err := str("type")
	if err != nil {
		return "", err
	}
	if typ == "url" {
		return str("url")
	}
	mediaType, err := str("media_type")
	if err != nil {
		return "", err
	}
	if mediaType == "" {
		mediaType = "image/jpeg"
	}
	data, err := str("data")
	return "data:" + mediaType + ";base64," + data, err
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
// "parameters"}}], name, description (null when absent) as sent and
// input_schema compacted, with "type":"object" added at its end when it
// has no type (AnthropicTool's validator), as kvproxy writes them. Absent or
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
		// Compact, as a template's tojson writes it whatever the client's
		// spacing (and as kvproxy writes it).
		var compact bytes.Buffer
		if json.Compact(&compact, tool.InputSchema) != nil {
			return "", invalid("tools", "tools[%d].input_schema must be an object", i)
		}
		schema := compact.Bytes()
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

// messagesToolChoice reads what a Messages request's tool_choice forces,
// as vLLM converts it: {"type":"any"} is "required", {"type":"tool",
// "name"} names the function.
func messagesToolChoice(raw json.RawMessage) toolChoice {
	var tc struct {
		Type string `json:"type"`
		Name string `json:"name"`
	}
	json.Unmarshal(raw, &tc)
	switch {
	case tc.Type == "any":
		return toolChoice{forced: true}
	case tc.Type == "tool" && tc.Name != "":
		return toolChoice{forced: true, name: tc.Name}
	}
	return toolChoice{}
}

// messagesFunctionTools lists a Messages request's tools as functions.
func messagesFunctionTools(raw json.RawMessage) []toolDef {
	var tools []struct {
		Name        string          `json:"name"`
		InputSchema json.RawMessage `json:"input_schema"`
	}
	json.Unmarshal(raw, &tools)
	var defs []toolDef
	for _, t := range tools {
		if t.Name != "" {
			defs = append(defs, toolDef{name: t.Name, schema: t.InputSchema})
		}
	}
	return defs
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

// pyPrinter writes decoded JSON the way a Python printer does, with ", "
// and ": " between items; json.dumps is the one the engine needs.
type pyPrinter struct {
	name                                   string // for the panic on a type JSON has not
	nullText, trueText, falseText, infText string
	str                                    func(dst []byte, s string) []byte
}

// pyJSON is Python's json.dumps with its defaults: every character outside
// printable ASCII escaped (\uXXXX, lowercase), floats as their repr.
var pyJSON = pyPrinter{name: "pyJSONDumps", nullText: "null", trueText: "true", falseText: "false", infText: "Infinity", str: pyJSONString}

// pyJSONDumps appends v as Python's json.dumps writes it by default.
func pyJSONDumps(dst []byte, v any) []byte { return pyJSON.append(dst, v) }

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
