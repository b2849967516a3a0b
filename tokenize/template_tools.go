package tokenize

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
)

// A model's own template sees tools and tool calls as vLLM hands them to
// it (vllm/entrypoints/chat_utils.py and serving_chat.py):
//   - tools: each validated as ChatCompletionToolsParam and dumped again,
//     so "type" (default "function") comes first, then "function" with
//     name, description and parameters (null when absent) before whatever
//     else it was sent with; members the models do not declare follow;
//   - an assistant message's tool_calls: dropped when empty; each call's
//     function.arguments, a JSON string in OpenAI's format, decoded into
//     an object ({} when absent, empty, not valid JSON or not an object);
//   - an assistant message's reasoning (as reasoning and reasoning_content),
//     a tool message's tool_call_id, and any message's name;
//   - tools null or left out: None; tools [] is an empty list, not None.

// jinjaTools is the template's tools variable for tools, JSON text.
func jinjaTools(tools string) (any, error) {
	v, err := jFromJSON(tools)
	if err != nil {
		return nil, fmt.Errorf("tools: %w", err)
	}
	list, ok := v.([]any)
	if !ok {
		return nil, errors.New("tools must be an array")
	}
	out := make([]any, len(list))
	for i, t := range list {
		tool, ok := t.(*jDictV)
		if !ok {
			return nil, fmt.Errorf("tools[%d] must be an object", i)
		}
		fn, ok := tool.get("function").(*jDictV)
		if !ok {
			return nil, fmt.Errorf("tools[%d].function must be an object", i)
		}
		if _, ok := fn.get("name").(string); !ok {
			return nil, fmt.Errorf("tools[%d].function.name must be a string", i)
		}
		f := newDict()
		for _, k := range []string{"name", "description", "parameters"} {
			if v, ok := fn.m[k]; ok {
				f.set(k, v)
			} else {
				f.set(k, nil)
			}
		}
		for _, k := range fn.keys {
			f.set(k, fn.m[k])
		}
		d := newDict()
		if typ, ok := tool.m["type"]; ok {
			d.set("type", typ)
		} else {
			d.set("type", "function")
		}
		d.set("function", f)
		for _, k := range tool.keys {
			if k != "function" {
				d.set(k, tool.m[k])
			}
		}
		out[i] = d
	}
	return out, nil
}

// messageExtra is what a template sees of m beyond its role and content;
// nil when nothing.
func messageExtra(m *Message, calls *jsonCache) (*jDictV, error) {
	if m.ToolCalls == "" && m.ToolCallID == "" && m.Name == "" && m.Reasoning == "" {
		return nil, nil
	}
	d := newDict()
	if m.Role == "assistant" && m.ToolCalls != "" {
		v, err := calls.get(m.ToolCalls, jinjaToolCalls)
		if err != nil {
			return nil, err
		}
		if v != nil {
			d.set("tool_calls", v)
		}
	}
	if m.Role == "assistant" && m.Reasoning != "" {
		d.set("reasoning", m.Reasoning)
		d.set("reasoning_content", m.Reasoning)
	}
	if m.Role == "tool" && m.ToolCallID != "" {
		d.set("tool_call_id", m.ToolCallID)
	}
	if m.Name != "" {
		d.set("name", m.Name)
	}
	if len(d.keys) == 0 {
		return nil, nil
	}
	return d, nil
}

// jinjaToolCalls is an assistant message's tool_calls as vLLM passes them:
// nil when empty.
func jinjaToolCalls(raw string) (any, error) {
	v, err := jFromJSON(raw)
	if err != nil {
		return nil, fmt.Errorf("tool_calls: %w", err)
	}
	list, ok := v.([]any)
	if !ok {
		return v, nil // vLLM leaves what is not a list alone
	}
	if len(list) == 0 {
		return nil, nil
	}
	for i, c := range list {
		call, ok := c.(*jDictV)
		if !ok {
			return nil, fmt.Errorf("tool_calls[%d] must be an object", i)
		}
		fn, ok := call.get("function").(*jDictV)
		if typ, has := call.m["type"]; !ok || has && typ != "function" {
			return nil, fmt.Errorf("tool_calls[%d] must be a function call (an object with a function object)", i)
		}
		// Arguments that are not an object (cut off by max_tokens, say)
		// become {}: the conversation goes on rather than failing every
		// later turn.
		args := fn.get("arguments")
		if s, ok := args.(string); ok && s != "" {
			args, _ = jFromJSON(s)
		}
		if _, ok := args.(*jDictV); !ok {
			args = newDict()
		}
		fn.set("arguments", args)
	}
	return list, nil
}

// jsonCache keeps template values decoded from JSON text (a request's
// tools, a message's tool_calls) by that text. An agent sends the same
// tools and the same earlier calls on every turn, and decoding them again
// was most of the time a turn took to render. The values are shared by
// concurrent renders and never changed: a template can change only a
// namespace(), and lists have no changing method.
type jsonCache struct {
	mu    sync.RWMutex
	m     map[string]any
	bytes int // the entries' jsonCost
}

// jsonCacheBytes bounds a cache's memory, estimated by jsonCost.
const jsonCacheBytes = 32 << 20

// jsonCost estimates the memory an entry holds: its text and its decoded
// values, which take about 18 times the text (measured with small tool
// calls; found by the ninth session's second review, when the bound
// counted the text alone), some 250 bytes more for each object or array
// (a schema nested 200 deep took 2.7 times the bound without it: the
// memory audit), and the map's own. A '{' or '[' in a string counts too:
// the estimate errs high.
func jsonCost(text string) int {
	return 256 + 24*len(text) + 256*(strings.Count(text, "{")+strings.Count(text, "["))
}

func (c *jsonCache) get(text string, decode func(string) (any, error)) (any, error) {
	c.mu.RLock()
	v, ok := c.m[text]
	c.mu.RUnlock()
	if ok {
		return v, nil
	}
	v, err := decode(text)
	cost := jsonCost(text)
	if err != nil || cost > jsonCacheBytes/16 {
		return v, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[text]; ok {
		return v, nil
	}
	for k := range c.m { // evict arbitrary entries until it fits
		if c.bytes+cost <= jsonCacheBytes {
			break
		}
		delete(c.m, k)
		c.bytes -= jsonCost(k)
	}
	if c.m == nil {
		c.m = map[string]any{}
	}
	jFreeze(v)
	c.m[strings.Clone(text)] = v // never pin a request buffer
	c.bytes += cost
	return v, nil
}

// jFromJSON decodes JSON text into template values as Python's json.loads
// does: objects keep their members' order (a repeated member keeps its
// first place and its last value), whole numbers stay integers.
func jFromJSON(text string) (any, error) {
	dec := json.NewDecoder(strings.NewReader(text))
	dec.UseNumber()
	v, err := jDecode(dec)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("invalid JSON: data after the value")
	}
	return v, nil
}

func jDecode(dec *json.Decoder) (any, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("invalid JSON: %w", err)
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '[':
			list := []any{}
			for dec.More() {
				v, err := jDecode(dec)
				if err != nil {
					return nil, err
				}
				list = append(list, v)
			}
			_, err := dec.Token() // ]
			return list, err
		case '{':
			d := newDict()
			for dec.More() {
				k, err := dec.Token()
				if err != nil {
					return nil, fmt.Errorf("invalid JSON: %w", err)
				}
				v, err := jDecode(dec)
				if err != nil {
					return nil, err
				}
				d.set(k.(string), v)
			}
			_, err := dec.Token() // }
			return d, err
		}
		return nil, errors.New("invalid JSON")
	case json.Number:
		s := string(t)
		if !strings.ContainsAny(s, ".eE") {
			if n, err := strconv.ParseInt(s, 10, 64); err == nil {
				return n, nil
			}
			return jBigInt(s), nil
		}
		f, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return nil, fmt.Errorf("invalid JSON number %s", s)
		}
		return f, nil
	default: // string, bool, nil
		return t, nil
	}
}
