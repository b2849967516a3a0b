package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"slices"

	"github.com/goccy/go-json"

	"github.com/kvproxy/kvproxy/tokenize"
)

// The request parser as it was when it decoded with goccy/go-json into
// RawMessages: the reference FuzzParseRequestMatchesDecoder holds the
// scanning parser to, error for error and string for string. Objects are
// decoded into maps, so member names match exactly and the last of a
// repeated member wins, as in the engines' Python parsers.

type refRequest struct {
	refFields    refWireFields
	body         []byte
	model        string
	stream       bool
	nv           nvext
	messages     []tokenize.Message
	promptText   string
	promptTokens []uint32
	hasTokens    bool
	addGenPrompt bool
	tools        string
	cacheSalt    string
	batchTexts   []string
	batchTokens  [][]uint32
}

type refWireFields struct {
	Model               json.RawMessage `json:"model"`
	Stream              json.RawMessage `json:"stream"`
	Nvext               json.RawMessage `json:"nvext"`
	AddGenerationPrompt json.RawMessage `json:"add_generation_prompt"`
	Messages            json.RawMessage `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
}

func refParseRequest(body []byte, chat bool) (*refRequest, *paramError) {
	r := &refRequest{addGenPrompt: true}
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, perr("", "the request body is empty; expected a JSON object")
	}
	trimmed := bytes.TrimSpace(body)
	if trimmed[0] != '{' {
		return nil, perr("", "the request body is not a valid JSON object")
	}
	if !json.Valid(trimmed) {
		return nil, perr("", "the request body is not a valid JSON object: %s", jsonSyntaxError(trimmed))
	}
	top, err := refObject(trimmed)
	if err != nil {
		return nil, perr("", "the request body is not a valid JSON object%s", refJSONErrMsg(err))
	}
	r.refFields = refWireFields{Model: top["model"], Stream: top["stream"], Nvext: top["nvext"],
		AddGenerationPrompt: top["add_generation_prompt"], Messages: top["messages"], Prompt: top["prompt"]}
	r.body = trimmed
	if string(r.refFields.Model) == "null" || string(r.refFields.Model) == `""` {
		r.refFields.Model = nil
	}
	if raw := r.refFields.Model; raw != nil {
		if err := json.Unmarshal(raw, &r.model); err != nil || r.model == "" {
			return nil, perr("model", "model must be a string")
		}
	}
	if raw := r.refFields.Stream; raw != nil && string(raw) != "null" {
		if err := json.Unmarshal(raw, &r.stream); err != nil {
			return nil, perr("stream", "stream must be a boolean")
		}
	}
	if raw := r.refFields.Nvext; raw != nil && string(raw) != "null" {
		if err := refNvext(raw, &r.nv); err != nil {
			return nil, perr("nvext", "nvext must be an object with token_data (token ids), backend_instance_id, annotations (strings) and greed_sampling (a boolean)")
		}
	}
	if raw := top["cache_salt"]; raw != nil && string(raw) != "null" {
		if raw[0] != '"' {
			return nil, perr("cache_salt", "cache_salt must be a string")
		}
		if json.Unmarshal(raw, &r.cacheSalt); r.cacheSalt == "" {
			return nil, perr("cache_salt", "cache_salt must be a non-empty string if provided")
		}
	}
	if raw := r.refFields.AddGenerationPrompt; raw != nil && chat {
		if err := json.Unmarshal(raw, &r.addGenPrompt); err != nil {
			return nil, perr("add_generation_prompt", "add_generation_prompt must be a boolean")
		}
	}
	if chat {
		if pe := r.refParseTools(top["tools"]); pe != nil {
			return nil, pe
		}
		if pe := r.refParseMessages(); pe != nil {
			return nil, pe
		}
	} else if pe := r.refParsePrompt(); pe != nil {
		return nil, pe
	}
	return r, nil
}

// refJSONErrMsg describes a JSON syntax error without Go type names.
func refJSONErrMsg(err error) string {
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Sprintf(" (syntax error at byte %d)", se.Offset)
	}
	return ""
}

// refObject decodes the JSON object raw into its members, exactly named.
func refObject(raw []byte) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, err
	}
	if m == nil && string(raw) != "null" {
		return nil, errNotObject
	}
	return m, nil
}

// refMembers decodes an element that must be an object or null (no
// members).
func refMembers(raw json.RawMessage) (map[string]json.RawMessage, error) {
	if string(raw) == "null" {
		return nil, nil
	}
	if raw[0] != '{' {
		return nil, errNotObject
	}
	return refObject(raw)
}

// refString decodes a string member that may be absent or null ("").
func refString(raw json.RawMessage) (string, error) {
	var s string
	if raw == nil {
		return "", nil
	}
	err := json.Unmarshal(raw, &s)
	return s, err
}

func refNvext(raw []byte, n *nvext) error {
	if raw[0] != '{' {
		return errNotObject
	}
	m, err := refObject(raw)
	if err != nil {
		return err
	}
	if raw := m["token_data"]; raw != nil {
		if err := json.Unmarshal(raw, &n.TokenData); err != nil {
			return err
		}
	}
	if raw := m["annotations"]; raw != nil {
		if err := json.Unmarshal(raw, &n.Annotations); err != nil {
			return err
		}
	}
	if raw := m["greed_sampling"]; raw != nil && string(raw) != "null" {
		if err := json.Unmarshal(raw, &n.greedy); err != nil {
			return err
		}
	}
	for i, k := range nvextSampling {
		if raw := m[k]; raw != nil && string(raw) != "null" {
			n.sampling[i] = raw
		}
	}
	n.BackendInstanceID = m["backend_instance_id"]
	return nil
}

func (r *refRequest) refParseTools(raw json.RawMessage) *paramError {
	if raw == nil || string(raw) == "null" {
		return nil
	}
	var tools []json.RawMessage
	if err := json.Unmarshal(raw, &tools); err != nil {
		return perr("tools", "tools must be an array of tool objects")
	}
	for i, t := range tools {
		if t[0] != '{' {
			return perr(fmt.Sprintf("tools[%d]", i), "tools must be an array of tool objects")
		}
	}
	r.tools = string(raw)
	return nil
}

type refWireMessage struct {
	Role                        string
	Content                     json.RawMessage
	ToolCalls                   json.RawMessage
	ToolCallID, Name, Reasoning string
}

// refMessage decodes a message: err for one that is not an object with a
// string role, pe for a member of the wrong type.
func refMessage(raw json.RawMessage, i int) (w refWireMessage, err error, pe *paramError) {
	m, err := refMembers(raw)
	if err != nil {
		return w, err, nil
	}
	if w.Role, err = refString(m["role"]); err != nil {
		return w, err, nil
	}
	w.Content, w.ToolCalls = m["content"], m["tool_calls"]
	if v := w.ToolCalls; v != nil && v[0] != '[' && string(v) != "null" {
		return w, nil, perr(fmt.Sprintf("messages[%d].tool_calls", i), "tool_calls must be an array of tool calls")
	}
	if w.ToolCallID, err = refString(m["tool_call_id"]); err != nil {
		return w, nil, perr(fmt.Sprintf("messages[%d].tool_call_id", i), "tool_call_id must be a string")
	}
	if w.Name, err = refString(m["name"]); err != nil {
		return w, nil, perr(fmt.Sprintf("messages[%d].name", i), "name must be a string")
	}
	if w.Reasoning, _ = refString(m["reasoning"]); w.Reasoning == "" { // not a string: none
		w.Reasoning, _ = refString(m["reasoning_content"])
	}
	return w, nil, nil
}

type refContentPart struct {
	Type    string
	Text    string
	HasText bool   // text is there, not null
	key     string // the member holding the text
}

func refPart(raw json.RawMessage) (refContentPart, error) {
	var cp refContentPart
	m, err := refMembers(raw)
	if err != nil {
		return cp, err
	}
	if cp.Type, err = refString(m["type"]); err != nil {
		return cp, err
	}
	key, isText := map[string]string{"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}[cp.Type]
	if cp.Type == "" {
		return cp, nil // refused by the caller
	}
	if !isText {
		cp.Type = "media"
		return cp, nil
	}
	cp.Type, cp.key = "text", key
	cp.Text, err = refString(m[key])
	cp.HasText = m[key] != nil && string(m[key]) != "null"
	return cp, err
}

func (r *refRequest) refParseMessages() *paramError {
	raw := r.refFields.Messages
	if raw == nil {
		return perr("messages", "you must provide a messages parameter")
	}
	var rawMsgs []json.RawMessage
	if err := json.Unmarshal(raw, &rawMsgs); err != nil {
		return perr("messages", "messages must be an array of message objects with a string role")
	}
	msgs := make([]refWireMessage, len(rawMsgs))
	for i, m := range rawMsgs {
		var err error
		var pe *paramError
		if msgs[i], err, pe = refMessage(m, i); err != nil {
			return perr("messages", "messages must be an array of message objects with a string role")
		} else if pe != nil {
			return pe
		}
	}
	if len(msgs) == 0 {
		return perr("messages", "messages must contain at least one message")
	}
	r.messages = make([]tokenize.Message, len(msgs))
	for i, m := range msgs {
		if m.Role == "" {
			return perr(fmt.Sprintf("messages[%d].role", i), "every message needs a role: a non-empty string such as system, user, assistant or tool")
		}
		content, pe := refFlattenContent(m.Content, i)
		if pe != nil {
			return pe
		}
		r.messages[i] = tokenize.Message{Role: m.Role, Content: content, ToolCallID: m.ToolCallID, Name: m.Name, Reasoning: m.Reasoning}
		var calls []json.RawMessage
		if json.Unmarshal(m.ToolCalls, &calls) == nil && len(calls) > 0 {
			r.messages[i].ToolCalls = string(m.ToolCalls)
		}
	}
	return nil
}

func refFlattenContent(raw json.RawMessage, i int) (string, *paramError) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", perr(fmt.Sprintf("messages[%d].content", i), "content is not a valid string")
		}
		return s, nil
	case '[':
		var parts []json.RawMessage
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", perr(fmt.Sprintf("messages[%d].content", i), "content must be a string or an array of content parts")
		}
		var b []byte
		n := 0
		for j, p := range parts {
			cp, err := refPart(p)
			if p[0] == '"' { // a plain string is a text part
				var text string
				err = json.Unmarshal(p, &text)
				cp = refContentPart{Type: "text", Text: text, HasText: true}
			}
			if err != nil && cp.Type == "text" {
				return "", perr(fmt.Sprintf("messages[%d].content[%d]", i, j), "a content part's %s must be a string", cp.key)
			}
			if err != nil || cp.Type == "" {
				return "", perr(fmt.Sprintf("messages[%d].content[%d]", i, j), "content part must be an object with a type, or a string")
			}
			if cp.Type == "text" && !cp.HasText {
				continue // vLLM skips it
			}
			if n++; n > 1 { // vLLM joins the parts with newlines
				b = append(b, '\n')
			}
			if cp.Type == "text" {
				b = append(b, cp.Text...)
			} else {
				b = tokenize.AppendMediaStandIn(b, tokenize.MediaOf(p))
			}
		}
		return string(b), nil
	}
	return "", perr(fmt.Sprintf("messages[%d].content", i), "content must be a string or an array of content parts")
}

func (r *refRequest) refParsePrompt() *paramError {
	raw := r.refFields.Prompt
	if raw == nil || string(raw) == "null" {
		return perr("prompt", "you must provide a prompt parameter")
	}
	switch raw[0] {
	case '"':
		if err := json.Unmarshal(raw, &r.promptText); err != nil {
			return perr("prompt", "prompt is not a valid string")
		}
		return nil
	case '[':
		// An array of token ids, an array of strings, or an array of token
		// arrays (a batch: routed by its first prompt).
		var ids []uint32
		if err := json.Unmarshal(raw, &ids); err == nil {
			if len(ids) == 0 {
				return perr("prompt", "prompt must not be empty")
			}
			r.promptTokens, r.hasTokens = ids, true
			return nil
		}
		var strs []string
		if err := json.Unmarshal(raw, &strs); err == nil {
			if len(strs) == 0 {
				return perr("prompt", "prompt must not be empty")
			}
			r.promptText, r.batchTexts = strs[0], strs[1:]
			return nil
		}
		var batch [][]uint32
		if err := json.Unmarshal(raw, &batch); err == nil {
			if len(batch) == 0 || len(batch[0]) == 0 {
				return perr("prompt", "prompt must not be empty")
			}
			r.promptTokens, r.hasTokens, r.batchTokens = batch[0], true, batch[1:]
			return nil
		}
	}
	return perr("prompt", "prompt must be a string, an array of strings, or an array of token ids (integers 0..4294967295)")
}

// forwardBody is the body sent to the engine: the client's body with nvext
// and any cache_salt removed, model renamed, and the tenant's cache_salt
// added (salt "" adds none). Every other member is copied byte for byte.
//
// nvext's greed_sampling replaces any temperature with 0, and its other
// sampling members are added where the request has none of its own (its
// last occurrence counts; a null is none, and every occurrence goes) when
// the engine takes them (engineSampling).
func (r *refRequest) refForwardBody(servedModel, salt string, engineSampling bool) ([]byte, error) {
	out := make([]byte, 0, len(r.body)+len(servedModel)+len(salt)+40)
	out = append(out, '{')
	n := 0
	var given [len(nvextSampling)]bool // the request's own, last occurrence not null
	top, _ := refObject(r.body)
	for i, k := range nvextSampling {
		given[i] = top[k] != nil && string(top[k]) != "null"
	}
	err := refTopLevelMembers(r.body, func(key string, member []byte) {
		if key == "nvext" || key == "cache_salt" || key == "model" || key == "stream" || r.nv.greedy && key == "temperature" {
			return
		}
		if i := slices.Index(nvextSampling[:], key); i >= 0 && r.nv.sampling[i] != nil && !given[i] {
			return
		}
		if n > 0 {
			out = append(out, ',')
		}
		out = append(out, member...)
		n++
	})
	if err != nil {
		return nil, err
	}
	if n > 0 {
		out = append(out, ',')
	}
	out = append(out, `"model":`...)
	m, _ := json.Marshal(servedModel)
	out = append(out, m...)
	if r.refFields.Stream != nil { // the stream flag as read, as engines spell it
		out = append(out, `,"stream":`...)
		out = append(out, r.refFields.Stream...)
	}
	if salt != "" {
		out = append(out, `,"cache_salt":`...)
		sj, _ := json.Marshal(salt)
		out = append(out, sj...)
	}
	if r.nv.greedy {
		out = append(out, `,"temperature":0`...)
	}
	for i, v := range r.nv.sampling {
		if v != nil && !given[i] && engineSampling {
			out = fmt.Appendf(out, `,%q:%s`, nvextSampling[i], v)
		}
	}
	return append(out, '}'), nil
}

// refTopLevelMembers calls fn with each member of the JSON object b: its
// unescaped key and its bytes ("key": value, whitespace trimmed). b has been
// validated as JSON already; this only finds the boundaries.
func refTopLevelMembers(b []byte, fn func(key string, member []byte)) error {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return errNotObject
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return nil
	}
	for i < len(b) {
		start := i
		end, err := skipValue(b, i) // the key, a string
		if err != nil || b[start] != '"' {
			return errNotObject
		}
		rawKey := b[start:end]
		key := string(rawKey[1 : len(rawKey)-1])
		if bytes.IndexByte(rawKey, '\\') >= 0 {
			if json.Unmarshal(rawKey, &key) != nil {
				return errNotObject
			}
		}
		i = skipSpace(b, end)
		if i >= len(b) || b[i] != ':' {
			return errNotObject
		}
		if end, err = skipValue(b, skipSpace(b, i+1)); err != nil {
			return err
		}
		fn(key, b[start:end])
		i = skipSpace(b, end)
		if i >= len(b) {
			return errNotObject
		}
		if b[i] == '}' {
			return nil
		}
		if b[i] != ',' {
			return errNotObject
		}
		i = skipSpace(b, i+1)
	}
	return errNotObject
}
