package mockengine

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/kvproxy/kvproxy/tokenize"
)

// A Responses request is rendered as the chat messages and tools vLLM
// builds from it (vllm/entrypoints/openai/responses/utils.py at 01ca842,
// construct_input_messages and construct_tool_dicts), through the same
// template and encoder as a chat request, so the two share prompt tokens
// and cached blocks.

// responsesRequest holds the fields of POST /v1/responses the engine
// understands; the rest (temperature and top_p are only echoed) is ignored.
type responsesRequest struct {
	Model              string            `json:"model"`
	Input              json.RawMessage   `json:"input"`
	Instructions       *string           `json:"instructions"`
	Tools              []json.RawMessage `json:"tools"`
	ToolChoice         json.RawMessage   `json:"tool_choice"`
	PreviousResponseID *string           `json:"previous_response_id"`
	Store              *bool             `json:"store"`
	Stream             bool              `json:"stream"`
	Background         bool              `json:"background"`
	MaxOutputTokens    *int              `json:"max_output_tokens"`
	Temperature        *float64          `json:"temperature"`
	TopP               *float64          `json:"top_p"`
	IgnoreEOS          bool              `json:"ignore_eos"`
	CacheSalt          string            `json:"cache_salt"`
}

// responsesMessages is construct_input_messages: the instructions as a
// system message, then the previous response's messages without their
// system ones (instructions do not carry over) and its output text, then
// the input.
func responsesMessages(req *responsesRequest, prev *storedResponse) ([]tokenize.Message, error) {
	var msgs []tokenize.Message
	if req.Instructions != nil && *req.Instructions != "" {
		msgs = append(msgs, tokenize.Message{Role: "system", Content: *req.Instructions})
	}
	if prev != nil {
		for _, m := range prev.messages {
			if m.Role != "system" {
				msgs = append(msgs, m)
			}
		}
		for _, text := range prev.outputTexts {
			msgs = append(msgs, tokenize.Message{Role: "assistant", Content: text})
		}
	}
	raw := bytes.TrimSpace(req.Input)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, invalid("input", "input is required")
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, invalid("input", "input is not a valid string")
		}
		return append(msgs, tokenize.Message{Role: "user", Content: s}), nil
	case '[':
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return nil, invalid("input", "input must be a string or an array of input items")
		}
		input, err := inputMessages(items)
		if err != nil {
			return nil, err
		}
		return append(msgs, input...), nil
	}
	return nil, invalid("input", "input must be a string or an array of input items")
}

// builtMessage is a chat message built from input items, with the keys
// vLLM's message dict has: a function call, a reasoning item and an
// assistant message each fill their key of the assistant message before
// them when it does not have it yet.
type builtMessage struct {
	tokenize.Message
	calls                    []string // tool_calls, each call as JSON
	hasContent, hasReasoning bool
}

// itemKind says which key of an assistant message an input item fills.
type itemKind int

const (
	ownMessage    itemKind = iota // a message of its own, never merged
	callItem                      // tool_calls
	reasoningItem                 // reasoning
	assistantItem                 // content
)

// inputMessages is construct_chat_messages_with_tool_call: the input items
// in order, each merged into the assistant message built just before it
// (only from the input, never the instructions or the history) when that
// message lacks its key, or else a message of its own.
func inputMessages(items []json.RawMessage) ([]tokenize.Message, error) {
	var built []builtMessage
	for i, raw := range items {
		m, kind, err := inputItemMessage(raw, i)
		if err != nil {
			return nil, err
		}
		var prev *builtMessage
		if n := len(built); n > 0 && built[n-1].Role == "assistant" {
			prev = &built[n-1]
		}
		switch {
		case prev != nil && kind == callItem:
			prev.calls = append(prev.calls, m.calls...)
		case prev != nil && kind == reasoningItem && !prev.hasReasoning:
			prev.Reasoning, prev.hasReasoning = m.Reasoning, true
		case prev != nil && kind == assistantItem && !prev.hasContent:
			prev.Content, prev.hasContent = m.Content, true
		default:
			built = append(built, m)
		}
	}
	msgs := make([]tokenize.Message, len(built))
	for i, b := range built {
		msgs[i] = b.Message
		if len(b.calls) > 0 {
			msgs[i].ToolCalls = "[" + strings.Join(b.calls, ",") + "]"
		}
	}
	return msgs, nil
}

// inputItem is the union of the input items the engine reads. Values that
// go into tool_calls text are kept as sent.
type inputItem struct {
	Type      string          `json:"type"`
	Role      *string         `json:"role"`
	Content   json.RawMessage `json:"content"`
	CallID    json.RawMessage `json:"call_id"`
	Name      json.RawMessage `json:"name"`
	Namespace json.RawMessage `json:"namespace"`
	Arguments json.RawMessage `json:"arguments"`
	Output    json.RawMessage `json:"output"`
	Summary   json.RawMessage `json:"summary"`
}

// inputMessageRoles are the roles an input message may have.
var inputMessageRoles = map[string]bool{"user": true, "assistant": true, "system": true, "developer": true}

// inputItemMessage converts input item i into its chat message and says
// which key of an assistant message before it the item may fill instead.
// Reasoning items and assistant messages are read as vLLM reads them in
// their dict form, the form a JSON request gives them (its encrypted
// content is not looked at).
func inputItemMessage(raw json.RawMessage, i int) (builtMessage, itemKind, error) {
	bad := func(format string, args ...any) (builtMessage, itemKind, error) {
		return builtMessage{}, 0, invalid("input", "input[%d]: %s", i, fmt.Sprintf(format, args...))
	}
	var it inputItem
	if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] != '{' {
		return bad("an input item must be an object")
	}
	if err := json.Unmarshal(raw, &it); err != nil {
		return bad("%v", err)
	}
	switch it.Type {
	case "function_call":
		if !isJSONString(it.CallID) || !isJSONString(it.Name) || !isJSONString(it.Arguments) {
			return bad("a function_call needs call_id, name and arguments, strings")
		}
		name := string(it.Name)
		if ns := bytes.TrimSpace(it.Namespace); len(ns) > 0 && string(ns) != "null" {
			if !isJSONString(ns) {
				return bad("a function_call's namespace must be a string")
			}
			if string(ns) != `""` { // flat_namespace_tool_name: namespace__name
				name = string(ns[:len(ns)-1]) + "__" + name[1:]
			}
		}
		// ChatCompletionMessageToolCallParam's member order.
		call := `{"id":` + string(it.CallID) + `,"function":{"name":` + name +
			`,"arguments":` + string(it.Arguments) + `},"type":"function"}`
		return builtMessage{Message: tokenize.Message{Role: "assistant"}, calls: []string{call}}, callItem, nil
	case "function_call_output":
		var callID string
		if !isJSONString(it.CallID) || json.Unmarshal(it.CallID, &callID) != nil {
			return bad("a function_call_output needs call_id, a string")
		}
		if o := bytes.TrimSpace(it.Output); len(o) == 0 || string(o) == "null" {
			return bad("a function_call_output needs output")
		}
		out, err := messageText(it.Output, i)
		if err != nil {
			return bad("output must be a string or an array of content parts")
		}
		return builtMessage{Message: tokenize.Message{Role: "tool", Content: out, ToolCallID: callID}, hasContent: true}, ownMessage, nil
	case "reasoning":
		// The first content part's text, else the first summary's.
		text, err := firstPartText(it.Content)
		if err == nil && text == nil {
			text, err = firstPartText(it.Summary)
		}
		if err != nil {
			return bad("a reasoning item's content and summary must be arrays of text parts")
		}
		var reasoning string
		if text != nil {
			reasoning = *text
		}
		return builtMessage{Message: tokenize.Message{Role: "assistant", Reasoning: reasoning}, hasReasoning: true}, reasoningItem, nil
	case "message", "":
		if it.Role == nil || !inputMessageRoles[*it.Role] {
			return bad("a message needs a role: user, assistant, system or developer")
		}
		c := bytes.TrimSpace(it.Content)
		if len(c) == 0 || string(c) == "null" {
			return bad("a message needs content")
		}
		if *it.Role == "assistant" {
			return assistantMessage(c, bad)
		}
		text, err := messageText(it.Content, i)
		if err != nil {
			var b *badRequest
			if errors.As(err, &b) {
				return bad("%s", b.msg)
			}
			return builtMessage{}, 0, err
		}
		return builtMessage{Message: tokenize.Message{Role: *it.Role, Content: text}, hasContent: true}, ownMessage, nil
	}
	return bad("input items of type %q are not supported", it.Type)
}

// assistantMessage is an assistant message item: its content when a
// string, else its first part's text ("" when that part has none, or
// there are no parts).
func assistantMessage(content json.RawMessage, bad func(string, ...any) (builtMessage, itemKind, error)) (builtMessage, itemKind, error) {
	var text string
	if content[0] == '"' {
		if err := json.Unmarshal(content, &text); err != nil {
			return bad("content is not a valid string")
		}
	} else {
		first, err := firstPartText(content)
		if err != nil {
			return bad("content must be a string or an array of content parts")
		}
		if first != nil {
			text = *first
		}
	}
	return builtMessage{Message: tokenize.Message{Role: "assistant", Content: text}, hasContent: true}, assistantItem, nil
}

// firstPartText is the text of the first of parts (a JSON array, or null
// or absent for none): nil when there are none, "" when the first, an
// object, has no text; a part that is a string is its own text.
func firstPartText(parts json.RawMessage) (*string, error) {
	if p := bytes.TrimSpace(parts); len(p) == 0 || string(p) == "null" {
		return nil, nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(parts, &list); err != nil {
		return nil, err
	}
	if len(list) == 0 {
		return nil, nil
	}
	var text string
	first := bytes.TrimSpace(list[0])
	if len(first) > 0 && first[0] == '"' {
		err := json.Unmarshal(first, &text)
		return &text, err
	}
	var part struct {
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(first, &part); err != nil {
		return nil, err
	}
	if part.Text != nil {
		text = *part.Text
	}
	return &text, nil
}

func isJSONString(raw json.RawMessage) bool {
	return len(raw) > 0 && raw[0] == '"'
}

// responsesTools returns the request's tools as echoed in the response
// (function tools as pydantic's FunctionTool dumps them, the others as
// sent) and, as construct_tool_dicts gives them to the template, the
// function tools as chat tools: "" (None) when the request has no tools,
// [] when it has only built-in ones. tool_choice "none" keeps them, as
// vLLM does by default (exclude_tools_when_tool_choice_none off).
func responsesTools(tools []json.RawMessage, _ json.RawMessage) (echo []byte, template string, err error) {
	if len(tools) == 0 {
		return []byte("[]"), "", nil
	}
	echo = append(echo, '[')
	wrapped := []byte{'['}
	for i, raw := range tools {
		members, err := objectMembers(raw)
		if err != nil {
			return nil, "", invalid("tools", "tools[%d] must be an object", i)
		}
		if i > 0 {
			echo = append(echo, ',')
		}
		typ := memberValue(members, "type")
		if !isJSONString(typ) {
			return nil, "", invalid("tools", "tools[%d].type must be a string", i)
		}
		if string(typ) != `"function"` { // a built-in tool: not the template's
			echo = appendObject(echo, members)
			continue
		}
		t, fn, err := functionTool(members, i)
		if err != nil {
			return nil, "", err
		}
		echo = append(echo, t...)
		if len(wrapped) > 1 {
			wrapped = append(wrapped, ',')
		}
		wrapped = append(append(append(wrapped, `{"type":"function","function":`...), fn...), '}')
	}
	return append(echo, ']'), string(append(wrapped, ']')), nil
}

// functionTool is function tool i in FunctionTool's member order and as
// vLLM's FunctionDefinition dumps it for the template (name, description,
// parameters, strict, then the other members as sent, type left out),
// compact, absent ones null.
func functionTool(members []member, i int) (tool, fn []byte, err error) {
	if !isJSONString(memberValue(members, "name")) {
		return nil, nil, invalid("tools", "tools[%d].name must be a string", i)
	}
	for _, c := range []struct {
		k     string
		first byte // of the value's JSON; 'b' for a boolean
	}{{"parameters", '{'}, {"strict", 'b'}, {"description", '"'}} {
		k, first := c.k, c.first
		v := memberValue(members, k)
		if v == nil || string(v) == "null" {
			continue
		}
		if ok := v[0] == first || first == 'b' && (string(v) == "true" || string(v) == "false"); !ok {
			return nil, nil, invalid("tools", "tools[%d].%s has the wrong type", i, k)
		}
	}
	dump := func(declared []string, skip string) []byte {
		var ms []member
		for _, k := range declared {
			v := memberValue(members, k)
			if v == nil {
				v = json.RawMessage("null")
			}
			ms = append(ms, member{key: k, value: v})
		}
		for _, m := range members {
			if !contains(declared, m.key) && m.key != skip {
				ms = append(ms, m)
			}
		}
		return appendObject(nil, ms)
	}
	return dump([]string{"name", "parameters", "strict", "type", "description"}, ""),
		dump([]string{"name", "description", "parameters", "strict"}, "type"), nil
}

// memberValue is the value of members' key k, nil when absent.
func memberValue(members []member, k string) json.RawMessage {
	for _, m := range members {
		if m.key == k {
			return m.value
		}
	}
	return nil
}

// appendObject appends members as a compact JSON object.
func appendObject(b []byte, members []member) []byte {
	b = append(b, '{')
	for j, m := range members {
		if j > 0 {
			b = append(b, ',')
		}
		kb, _ := json.Marshal(m.key)
		b = append(append(append(b, kb...), ':'), m.value...)
	}
	return append(b, '}')
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

type member struct {
	key   string
	value json.RawMessage // compact
}

// objectMembers lists a JSON object's members in the order sent, values
// compacted; a repeated key keeps its last value, as Python's json does.
func objectMembers(raw json.RawMessage) ([]member, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, errors.New("not an object")
	}
	var out []member
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key := tok.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, err
		}
		var c bytes.Buffer
		if err := json.Compact(&c, v); err != nil {
			return nil, err
		}
		m := member{key: key, value: c.Bytes()}
		replaced := false
		for j := range out {
			if out[j].key == key {
				out[j].value, replaced = m.value, true
			}
		}
		if !replaced {
			out = append(out, m)
		}
	}
	return out, nil
}

// responsesToolChoice reads what a Responses request's tool_choice forces:
// "required", or {"type":"function","name":...}.
func responsesToolChoice(raw json.RawMessage) toolChoice {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return toolChoice{forced: s == "required"}
	}
	var named struct {
		Type string `json:"type"`
		Name string `json:"name"`
	}
	if json.Unmarshal(raw, &named) == nil && named.Type == "function" && named.Name != "" {
		return toolChoice{forced: true, name: named.Name}
	}
	return toolChoice{}
}

// responsesFunctionTools lists a Responses request's function tools.
func responsesFunctionTools(tools []json.RawMessage) []toolDef {
	var defs []toolDef
	for _, raw := range tools {
		var t struct {
			Type       string          `json:"type"`
			Name       string          `json:"name"`
			Parameters json.RawMessage `json:"parameters"`
		}
		if json.Unmarshal(raw, &t) == nil && t.Type == "function" && t.Name != "" {
			defs = append(defs, toolDef{name: t.Name, schema: t.Parameters})
		}
	}
	return defs
}
