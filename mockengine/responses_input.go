package mockengine

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvproxy/kvproxy/tokenize"
)

// A Responses request is rendered as the chat messages and tools vLLM
// builds from it (vllm/entrypoints/openai/responses/utils.py,
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
// system message, then the previous response's messages and its output
// text, then the input.
func responsesMessages(req *responsesRequest, prev *storedResponse) ([]tokenize.Message, error) {
	var msgs []tokenize.Message
	if req.Instructions != nil && *req.Instructions != "" {
		msgs = append(msgs, tokenize.Message{Role: "system", Content: *req.Instructions})
	}
	if prev != nil {
		msgs = append(msgs, prev.messages...)
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
		for i, item := range items {
			m, err := inputItemMessage(item, i)
			if err != nil {
				return nil, err
			}
			msgs = append(msgs, m)
		}
		return msgs, nil
	}
	return nil, invalid("input", "input must be a string or an array of input items")
}

// inputItem is the union of the input items the engine reads. Values that
// go into tool_calls text are kept as sent.
type inputItem struct {
	Type      string          `json:"type"`
	Role      *string         `json:"role"`
	Content   json.RawMessage `json:"content"`
	CallID    json.RawMessage `json:"call_id"`
	Name      json.RawMessage `json:"name"`
	Arguments json.RawMessage `json:"arguments"`
	Output    json.RawMessage `json:"output"`
	Summary   []struct {
		Text string `json:"text"`
	} `json:"summary"`
	EncryptedContent *string `json:"encrypted_content"`
}

// inputMessageRoles are the roles an input message may have.
var inputMessageRoles = map[string]bool{"user": true, "assistant": true, "system": true, "developer": true}

// inputItemMessage converts input item i into its chat message.
func inputItemMessage(raw json.RawMessage, i int) (tokenize.Message, error) {
	bad := func(format string, args ...any) (tokenize.Message, error) {
		return tokenize.Message{}, invalid("input", "input[%d]: %s", i, fmt.Sprintf(format, args...))
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
		// ChatCompletionMessageToolCallParam's member order.
		calls := `[{"id":` + string(it.CallID) + `,"function":{"name":` + string(it.Name) +
			`,"arguments":` + string(it.Arguments) + `},"type":"function"}]`
		return tokenize.Message{Role: "assistant", ToolCalls: calls}, nil
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
		return tokenize.Message{Role: "tool", Content: out, ToolCallID: callID}, nil
	case "reasoning":
		if it.EncryptedContent != nil {
			return bad("Encrypted content is not supported.")
		}
		var content []struct {
			Text string `json:"text"`
		}
		if c := bytes.TrimSpace(it.Content); len(c) > 0 && string(c) != "null" {
			if err := json.Unmarshal(c, &content); err != nil {
				return bad("a reasoning item's content must be an array of text parts")
			}
		}
		var reasoning string
		if len(it.Summary) == 1 {
			reasoning = it.Summary[0].Text
		} else if len(content) == 1 {
			reasoning = content[0].Text
		}
		return tokenize.Message{Role: "assistant", Reasoning: reasoning}, nil
	case "message", "":
		if it.Role == nil || !inputMessageRoles[*it.Role] {
			return bad("a message needs a role: user, assistant, system or developer")
		}
		if c := bytes.TrimSpace(it.Content); len(c) == 0 || string(c) == "null" {
			return bad("a message needs content")
		}
		text, err := messageText(it.Content, i)
		if err != nil {
			var b *badRequest
			if errors.As(err, &b) {
				return bad("%s", b.msg)
			}
			return tokenize.Message{}, err
		}
		return tokenize.Message{Role: *it.Role, Content: text}, nil
	}
	return bad("input items of type %q are not supported", it.Type)
}

func isJSONString(raw json.RawMessage) bool {
	return len(raw) > 0 && raw[0] == '"'
}

// responsesTools re-serializes the request's function tools as pydantic's
// FunctionTool dumps them (name, parameters, strict, type, description,
// absent ones null, then any other members as sent) and returns them as
// echoed in the response and, wrapped as vLLM wraps them
// ({"type":"function","function":T}), as the template's tools: "" (None)
// when tool_choice is "none".
func responsesTools(tools []json.RawMessage, toolChoice json.RawMessage) (echo []byte, template string, err error) {
	echo = append(echo, '[')
	wrapped := []byte{'['}
	for i, raw := range tools {
		t, err := functionTool(raw, i)
		if err != nil {
			return nil, "", err
		}
		if i > 0 {
			echo = append(echo, ',')
			wrapped = append(wrapped, ',')
		}
		echo = append(echo, t...)
		wrapped = append(append(append(wrapped, `{"type":"function","function":`...), t...), '}')
	}
	echo = append(echo, ']')
	wrapped = append(wrapped, ']')
	if string(bytes.TrimSpace(toolChoice)) == `"none"` {
		return echo, "", nil
	}
	return echo, string(wrapped), nil
}

// functionTool is tool i in FunctionTool's member order, compact.
func functionTool(raw json.RawMessage, i int) ([]byte, error) {
	members, err := objectMembers(raw)
	if err != nil {
		return nil, invalid("tools", "tools[%d] must be an object", i)
	}
	get := func(k string) json.RawMessage {
		for _, m := range members {
			if m.key == k {
				return m.value
			}
		}
		return nil
	}
	if typ := get("type"); string(typ) != `"function"` {
		return nil, invalid("tools", "tools[%d]: the simulated engine supports function tools only, got type %s", i, typ)
	}
	if !isJSONString(get("name")) {
		return nil, invalid("tools", "tools[%d].name must be a string", i)
	}
	for _, c := range []struct {
		k     string
		first byte // of the value's JSON; 'b' for a boolean
	}{{"parameters", '{'}, {"strict", 'b'}, {"description", '"'}} {
		k, first := c.k, c.first
		v := get(k)
		if v == nil || string(v) == "null" {
			continue
		}
		if ok := v[0] == first || first == 'b' && (string(v) == "true" || string(v) == "false"); !ok {
			return nil, invalid("tools", "tools[%d].%s has the wrong type", i, k)
		}
	}
	b := []byte{'{'}
	field := func(k string, v json.RawMessage) {
		if len(b) > 1 {
			b = append(b, ',')
		}
		kb, _ := json.Marshal(k)
		b = append(append(b, kb...), ':')
		if v == nil {
			v = json.RawMessage("null")
		}
		b = append(b, v...)
	}
	declared := []string{"name", "parameters", "strict", "type", "description"}
	for _, k := range declared {
		field(k, get(k))
	}
	for _, m := range members {
		if !contains(declared, m.key) {
			field(m.key, m.value)
		}
	}
	return append(b, '}'), nil
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
