package mockengine

import (
	"bytes"
	"encoding/json"
	"slices"
	"strconv"
	"unicode/utf8"

	"github.com/kvproxy/kvproxy/kv"
)

// A request whose tool_choice forces a call ("required", or a named
// function) is answered, as vLLM answers it under its structured-output
// constraint, with one call: of the named tool, else of the first. Its
// arguments are made up from the tool's JSON schema, deterministically,
// and are the answer's output tokens: they take decode steps, fill KV
// blocks and count as completion tokens as text does.

// toolDef is a function tool of a request: its name and its parameters'
// JSON schema (nil when it has none).
type toolDef struct {
	name   string
	schema json.RawMessage
}

// toolChoice is what a request's tool_choice forces: a call of the named
// tool, of any tool (required), or nothing.
type toolChoice struct {
	forced bool
	name   string // "" when any tool will do
}

// forcedCall is the call a request's tool_choice forces.
type forcedCall struct {
	tool  toolDef
	named bool // tool_choice named the tool
}

// forcedTool is the call a choice forces, nil when it forces nothing; a
// choice no tool can satisfy is vLLM's 400.
func forcedTool(choice toolChoice, tools []toolDef) (*forcedCall, error) {
	if !choice.forced {
		return nil, nil
	}
	if len(tools) == 0 {
		return nil, invalid("tool_choice", "When using `tool_choice`, `tools` must be set.")
	}
	if choice.name == "" {
		return &forcedCall{tool: tools[0]}, nil
	}
	for _, t := range tools {
		if t.name == choice.name {
			return &forcedCall{tool: t, named: true}, nil
		}
	}
	return nil, invalid("tool_choice", "Tool '%s' has not been passed in `tools`.", choice.name)
}

// callMaxTokens is the output limit of a forced call whose request names
// none: vLLM's default, what the context leaves after the prompt, rather
// than the engine's short default for text, so arguments come whole.
func (e *Engine) callMaxTokens(promptTokens int) int {
	return max(DefaultMaxTokens, e.cfg.CacheBlocks*e.cfg.BlockSize-promptTokens)
}

// toolCall is a request's answer when it calls a tool.
type toolCall struct {
	id        string // chatcmpl-tool-<hex>, as vLLM's make_tool_call_id
	name      string
	arguments string // the generated text: compact JSON, unless cut at max_tokens
	ends      []int  // ends[j]: where output token j's text ends in arguments
	named     bool   // the tool_choice named the tool
	cut       bool   // the call reached max_tokens
}

// piece is the arguments' text of output tokens [from, to).
func (c *toolCall) piece(from, to int) string {
	start := 0
	if from > 0 {
		start = c.ends[from-1]
	}
	return c.arguments[start:c.ends[to-1]]
}

// finishReason is vLLM's for a forced call: "tool_calls" for a required
// one, "stop" for a named one (as OpenAI has it), "length" when cut.
func (c *toolCall) finishReason() string {
	switch {
	case c.cut:
		return "length"
	case c.named:
		return "stop"
	}
	return "tool_calls"
}

// newAnswer is newRequest, or, when the request forces a call, a request
// whose output tokens are the arguments' tokens, up to maxTokens
// (ignore_eos has no say: the constrained output ends with the arguments).
func (e *Engine) newAnswer(prompt []uint32, minTokens, maxTokens int, ignoreEOS bool, salt string, force *forcedCall) *request {
	if force == nil {
		return e.newRequest(prompt, minTokens, maxTokens, ignoreEOS, salt)
	}
	seed := mix64(uint64(e.cfg.Seed) ^ kv.LocalHash(prompt))
	args := string(e.appendArguments(nil, force.tool.schema, seed, 0))
	ids, ends := e.tokenPieces(args)
	n := min(len(ids), maxTokens)
	c := &toolCall{id: "chatcmpl-tool-" + randomHex(), name: force.tool.name, ends: ends[:n], named: force.named, cut: n >= maxTokens}
	c.arguments = args[:c.ends[n-1]]
	return &request{
		seq:    Seq{Prompt: prompt, MaxTokens: n, Output: ids[:n], Salt: salt},
		call:   c,
		notify: make(chan struct{}, 1),
	}
}

// tokenPieces tokenizes text and says where each token's text ends: token
// j ends at the shortest prefix of text, cut between characters, that
// tokenizes to the first j+1 tokens. A token no prefix ends at gets no
// text; the next one carries it.
func (e *Engine) tokenPieces(text string) (ids []uint32, ends []int) {
	ids = e.enc.EncodeText(nil, text)
	ends = make([]int, len(ids))
	for j := range ends {
		ends[j] = -1
	}
	var prefix []uint32
	for p := 1; p <= len(text); p++ {
		if p < len(text) && !utf8.RuneStart(text[p]) {
			continue
		}
		prefix = e.enc.EncodeText(prefix[:0], text[:p])
		if m := len(prefix); m <= len(ids) && ends[m-1] < 0 && slices.Equal(prefix, ids[:m]) {
			ends[m-1] = p
		}
	}
	for j := range ends {
		if ends[j] < 0 || j > 0 && ends[j] < ends[j-1] {
			if j == 0 {
				ends[j] = 0
			} else {
				ends[j] = ends[j-1]
			}
		}
	}
	ends[len(ends)-1] = len(text)
	return ids, ends
}

// maxSchemaDepth bounds the nesting of generated arguments.
const maxSchemaDepth = 4

// appendArguments appends a value for JSON schema: the first of its enum,
// else one of its type (the first that is not null when it lists several):
// an object with a value for each of its properties, in their order, an
// array of one item, a word, a number, true or false. Values are drawn
// from seed, so a prompt always gets the same arguments.
func (e *Engine) appendArguments(b []byte, schema json.RawMessage, seed uint64, depth int) []byte {
	var s struct {
		Type       json.RawMessage   `json:"type"`
		Enum       []json.RawMessage `json:"enum"`
		Properties json.RawMessage   `json:"properties"`
		Items      json.RawMessage   `json:"items"`
	}
	json.Unmarshal(schema, &s)
	if len(s.Enum) > 0 {
		var c bytes.Buffer
		if json.Compact(&c, s.Enum[0]) == nil {
			return append(b, c.Bytes()...)
		}
	}
	typ := schemaType(s.Type)
	if typ == "" && len(s.Properties) > 0 || depth == 0 {
		typ = "object" // the arguments are an object, whatever the schema says
	}
	switch typ {
	case "object":
		b = append(b, '{')
		if depth < maxSchemaDepth {
			props, _ := objectMembers(s.Properties)
			for i, p := range props {
				if i > 0 {
					b = append(b, ',')
				}
				k, _ := json.Marshal(p.key)
				b = append(append(b, k...), ':')
				b = e.appendArguments(b, p.value, mix64(seed+uint64(i)+1), depth+1)
			}
		}
		return append(b, '}')
	case "array":
		if depth >= maxSchemaDepth || len(s.Items) == 0 || s.Items[0] != '{' {
			return append(b, "[]"...)
		}
		return append(e.appendArguments(append(b, '['), s.Items, mix64(seed+1), depth+1), ']')
	case "string":
		w := e.words[seed%uint64(len(e.words))].text[1:] // without its leading space
		return strconv.AppendQuote(b, w)
	case "integer", "number":
		return strconv.AppendUint(b, seed%100, 10)
	case "boolean":
		return strconv.AppendBool(b, seed%2 == 0)
	}
	return append(b, "null"...)
}

// schemaType is a schema's type: its value, or the first of its list that
// is not "null".
func schemaType(raw json.RawMessage) string {
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return one
	}
	var list []string
	json.Unmarshal(raw, &list)
	for _, t := range list {
		if t != "null" {
			return t
		}
	}
	return ""
}
