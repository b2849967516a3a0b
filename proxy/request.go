package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"

	"github.com/goccy/go-json"

	"github.com/kvproxy/kvproxy/tokenize"
)

// nvext is the proxy's own request extension (Dynamo's name). It is consumed
// here and never forwarded.
type nvext struct {
	TokenData         []uint32        `json:"token_data"`
	BackendInstanceID json.RawMessage `json:"backend_instance_id"`
	Annotations       []string        `json:"annotations"`
}

func (n *nvext) has(annotation string) bool {
	for _, a := range n.Annotations {
		if a == annotation {
			return true
		}
	}
	return false
}

// apiRequest is what the proxy needs of a completion request; the rest of
// the body is carried untouched in fields.
type apiRequest struct {
	fields   map[string]json.RawMessage
	model    string
	stream   bool
	nv       nvext
	messages []tokenize.Message
	// completions: the prompt as text, or as token ids
	promptText   string
	promptTokens []uint32
	hasTokens    bool
	addGenPrompt bool
}

// paramError is a client mistake in one field.
type paramError struct {
	param, msg string
}

func (e *paramError) Error() string { return e.msg }

func perr(param, format string, a ...any) *paramError {
	return &paramError{param: param, msg: fmt.Sprintf(format, a...)}
}

var validRoles = map[string]bool{"system": true, "developer": true, "user": true, "assistant": true, "tool": true, "function": true}

func parseRequest(body []byte, chat bool) (*apiRequest, *paramError) {
	r := &apiRequest{addGenPrompt: true}
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, perr("", "the request body is empty; expected a JSON object")
	}
	if err := json.Unmarshal(body, &r.fields); err != nil || r.fields == nil {
		return nil, perr("", "the request body is not a valid JSON object%s", jsonErrMsg(err))
	}
	raw, ok := r.fields["model"]
	if !ok {
		return nil, perr("model", "you must provide a model parameter")
	}
	if err := json.Unmarshal(raw, &r.model); err != nil || r.model == "" {
		return nil, perr("model", "model must be a non-empty string")
	}
	if raw, ok := r.fields["stream"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &r.stream); err != nil {
			return nil, perr("stream", "stream must be a boolean")
		}
	}
	if raw, ok := r.fields["nvext"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &r.nv); err != nil {
			return nil, perr("nvext", "nvext must be an object with token_data (token ids), backend_instance_id and annotations (strings)")
		}
	}
	if raw, ok := r.fields["add_generation_prompt"]; ok && chat {
		if err := json.Unmarshal(raw, &r.addGenPrompt); err != nil {
			return nil, perr("add_generation_prompt", "add_generation_prompt must be a boolean")
		}
	}
	if chat {
		if pe := r.parseMessages(); pe != nil {
			return nil, pe
		}
	} else if pe := r.parsePrompt(); pe != nil {
		return nil, pe
	}
	return r, nil
}

// jsonErrMsg describes a JSON syntax error without Go type names.
func jsonErrMsg(err error) string {
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Sprintf(" (syntax error at byte %d)", se.Offset)
	}
	return ""
}

type wireMessage struct {
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	ToolCalls json.RawMessage `json:"tool_calls"`
	Name      string          `json:"name"`
}

type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

func (r *apiRequest) parseMessages() *paramError {
	raw, ok := r.fields["messages"]
	if !ok {
		return perr("messages", "you must provide a messages parameter")
	}
	var msgs []wireMessage
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return perr("messages", "messages must be an array of message objects with a string role")
	}
	if len(msgs) == 0 {
		return perr("messages", "messages must contain at least one message")
	}
	r.messages = make([]tokenize.Message, len(msgs))
	for i, m := range msgs {
		if !validRoles[m.Role] {
			return perr(fmt.Sprintf("messages[%d].role", i), "invalid role %q (want system, developer, user, assistant or tool)", m.Role)
		}
		content, pe := flattenContent(m.Content, i)
		if pe != nil {
			return pe
		}
		if len(m.ToolCalls) > 0 && string(m.ToolCalls) != "null" {
			// Tool calls are part of what the engine caches: keep them in the
			// routed text so two histories with different calls differ.
			content += string(m.ToolCalls)
		}
		r.messages[i] = tokenize.Message{Role: m.Role, Content: content}
	}
	return nil
}

func flattenContent(raw json.RawMessage, i int) (string, *paramError) {
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
		for j, p := range parts {
			var cp contentPart
			if err := json.Unmarshal(p, &cp); err != nil || cp.Type == "" {
				return "", perr(fmt.Sprintf("messages[%d].content[%d]", i, j), "content part must be an object with a type")
			}
			if cp.Type == "text" {
				b = append(b, cp.Text...)
			} else {
				// Images and audio change what the engine caches; their raw
				// JSON stands in for them in the routed prompt.
				b = append(b, p...)
			}
		}
		return string(b), nil
	}
	return "", perr(fmt.Sprintf("messages[%d].content", i), "content must be a string or an array of content parts")
}

func (r *apiRequest) parsePrompt() *paramError {
	raw, ok := r.fields["prompt"]
	if !ok || string(raw) == "null" {
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
			r.promptText = strs[0]
			return nil
		}
		var batch [][]uint32
		if err := json.Unmarshal(raw, &batch); err == nil {
			if len(batch) == 0 || len(batch[0]) == 0 {
				return perr("prompt", "prompt must not be empty")
			}
			r.promptTokens, r.hasTokens = batch[0], true
			return nil
		}
	}
	return perr("prompt", "prompt must be a string, an array of strings, or an array of token ids (integers 0..4294967295)")
}

// pinned parses nvext.backend_instance_id: a backend id string or a numeric
// instance id (as a number or a decimal string).
func (n *nvext) pinned() (name string, instance uint64, isNum, ok bool) {
	raw := n.BackendInstanceID
	if len(raw) == 0 || string(raw) == "null" {
		return "", 0, false, false
	}
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) != nil || s == "" {
			return "", 0, false, false
		}
		if v, err := strconv.ParseUint(s, 10, 64); err == nil {
			return s, v, true, true
		}
		return s, 0, false, true
	}
	var v uint64
	if json.Unmarshal(raw, &v) != nil {
		return "", 0, false, false
	}
	return "", v, true, true
}

// forwardBody is the body sent to the engine: nvext removed, model renamed,
// and cache_salt set to the tenant's (salt "" removes it). A client's own
// cache_salt is never forwarded.
func (r *apiRequest) forwardBody(servedModel, salt string) ([]byte, error) {
	delete(r.fields, "nvext")
	m, _ := json.Marshal(servedModel)
	r.fields["model"] = m
	if salt != "" {
		s, _ := json.Marshal(salt)
		r.fields["cache_salt"] = s
	} else {
		delete(r.fields, "cache_salt")
	}
	return json.Marshal(r.fields)
}
