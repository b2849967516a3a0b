package tokenize

import (
	"encoding/json"
	"slices"
	"testing"
)

// toolChatCase is a chat request with tools and tool calls as a client
// sends it (OpenAI's format: arguments as JSON strings), and as vLLM hands
// it to the chat template (vllm/entrypoints/chat_utils.py,
// serving_chat.py): arguments decoded, empty tool_calls dropped, null
// content as "", each tool dumped as ChatCompletionToolsParam (type first,
// then function with name, description and parameters, null when absent).
type toolChatCase struct {
	name          string
	openai, vllm  string // {"messages": [...], "tools": [...]}
	toolsRendered bool   // the template puts tools in the prompt
}

var toolChatCases = []toolChatCase{{
	name: "weather",
	openai: `{"messages": [
		{"role": "system", "content": "You are a travel agent."},
		{"role": "user", "content": "Weather in Paris for 3 days?"},
		{"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
			"function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":3,\"units\":null}"}}]},
		{"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
		{"role": "user", "content": "And in Zürich?"}],
	 "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
		"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
		"required": ["city"]}}},
		{"function": {"parameters": {"type": "object", "properties": {}}, "name": "now"}, "type": "function"}]}`,
	vllm: `{"messages": [
		{"role": "system", "content": "You are a travel agent."},
		{"role": "user", "content": "Weather in Paris for 3 days?"},
		{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
			"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": null}}}]},
		{"role": "tool", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}", "tool_call_id": "call_1"},
		{"role": "user", "content": "And in Zürich?"}],
	 "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
		"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
		"required": ["city"]}}},
		{"type": "function", "function": {"name": "now", "description": null, "parameters": {"type": "object", "properties": {}}}}]}`,
	toolsRendered: true,
}, {
	name: "parallel calls, consecutive tool answers, strict, empty arguments",
	openai: `{"messages": [
		{"role": "user", "content": "Compare A and B, then tell the time."},
		{"role": "assistant", "content": "Looking both up.", "tool_calls": [
			{"id": "a", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"A\", \"limit\": 1.5, \"deep\": {\"x\": [1, true, \"é\\n\"]}}"}},
			{"id": "b", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\":\"B\"}"}},
			{"id": "c", "type": "function", "function": {"name": "now", "arguments": ""}}]},
		{"role": "tool", "tool_call_id": "a", "content": "A is 1"},
		{"role": "tool", "tool_call_id": "b", "content": "B is 2"},
		{"role": "tool", "tool_call_id": "c", "content": "noon"},
		{"role": "assistant", "content": "A is smaller.", "tool_calls": []},
		{"role": "user", "content": "Thanks"}],
	 "tools": [{"type": "function", "function": {"name": "lookup", "description": "Search", "strict": true,
		"parameters": {"type": "object", "properties": {"q": {"type": "string"}, "limit": {"type": "number"}}}}},
		{"type": "function", "function": {"name": "now"}}]}`,
	vllm: `{"messages": [
		{"role": "user", "content": "Compare A and B, then tell the time."},
		{"role": "assistant", "content": "Looking both up.", "tool_calls": [
			{"id": "a", "type": "function", "function": {"name": "lookup", "arguments": {"q": "A", "limit": 1.5, "deep": {"x": [1, true, "é\n"]}}}},
			{"id": "b", "type": "function", "function": {"name": "lookup", "arguments": {"q": "B"}}},
			{"id": "c", "type": "function", "function": {"name": "now", "arguments": {}}}]},
		{"role": "tool", "content": "A is 1", "tool_call_id": "a"},
		{"role": "tool", "content": "B is 2", "tool_call_id": "b"},
		{"role": "tool", "content": "noon", "tool_call_id": "c"},
		{"role": "assistant", "content": "A is smaller."},
		{"role": "user", "content": "Thanks"}],
	 "tools": [{"type": "function", "function": {"name": "lookup", "description": "Search",
		"parameters": {"type": "object", "properties": {"q": {"type": "string"}, "limit": {"type": "number"}}}, "strict": true}},
		{"type": "function", "function": {"name": "now", "description": null, "parameters": null}}]}`,
	toolsRendered: true,
}, {
	name: "an agent loop with reasoning sent back, empty tools",
	openai: `{"messages": [
		{"role": "user", "content": "Book it."},
		{"role": "assistant", "content": "", "reasoning_content": "The user wants a booking.\nCall book.",
			"tool_calls": [{"id": "b", "type": "function", "function": {"name": "book", "arguments": "{\"when\": \"now\"}"}}]},
		{"role": "tool", "tool_call_id": "b", "content": "booked"}],
	 "tools": []}`,
	vllm: `{"messages": [
		{"role": "user", "content": "Book it."},
		{"role": "assistant", "content": "", "tool_calls": [{"id": "b", "type": "function", "function": {"name": "book", "arguments": {"when": "now"}}}],
			"reasoning": "The user wants a booking.\nCall book.", "reasoning_content": "The user wants a booking.\nCall book."},
		{"role": "tool", "content": "booked", "tool_call_id": "b"}],
	 "tools": []}`,
}, {
	name: "tool calls in the history, no tools",
	openai: `{"messages": [
		{"role": "user", "content": "hi"},
		{"role": "assistant", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
		{"role": "tool", "tool_call_id": "x", "content": "done"}]}`,
	vllm: `{"messages": [
		{"role": "user", "content": "hi"},
		{"role": "assistant", "content": "", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": {}}}]},
		{"role": "tool", "content": "done", "tool_call_id": "x"}]}`,
}}

// messagesOf reads a request's messages as the proxy and kvmock hand them
// to the Encoder.
func messagesOf(t *testing.T, body string) (msgs []Message, tools string) {
	t.Helper()
	var req struct {
		Messages []struct {
			Role       string          `json:"role"`
			Content    *string         `json:"content"`
			ToolCalls  json.RawMessage `json:"tool_calls"`
			ToolCallID string          `json:"tool_call_id"`
			Reasoning  string          `json:"reasoning_content"`
		} `json:"messages"`
		Tools json.RawMessage `json:"tools"`
	}
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	for _, m := range req.Messages {
		msg := Message{Role: m.Role, ToolCalls: string(m.ToolCalls), ToolCallID: m.ToolCallID, Reasoning: m.Reasoning}
		if m.Content != nil {
			msg.Content = *m.Content
		}
		msgs = append(msgs, msg)
	}
	return msgs, string(req.Tools)
}

// TestReferenceToolChats renders requests with tools and tool calls with
// Qwen 3's own template (which puts tools and calls into the prompt) and
// Llama 3's (which has no tools), from the client's request, and compares
// with transformers.js rendering what vLLM passes to the template.
func TestReferenceToolChats(t *testing.T) {
	var req struct {
		ToolChats []json.RawMessage `json:"toolChats"`
		Texts     []string          `json:"texts"`
		Chats     [][]Message       `json:"chats"`
	}
	req.Texts, req.Chats = []string{}, [][]Message{}
	for _, c := range toolChatCases {
		req.ToolChats = append(req.ToolChats, json.RawMessage(c.vllm))
	}
	ref := runReferenceRequest(t, req)
	for _, name := range []string{"qwen3", "llama3"} {
		t.Run(name, func(t *testing.T) {
			tok, err := Load(refModelDir(name))
			if err != nil {
				t.Fatal(err)
			}
			tmpl, err := LoadTemplate(refModelDir(name))
			if err != nil {
				t.Fatal(err)
			}
			enc := NewEncoder(tok, tmpl, 0)
			r := ref[name]
			if len(r.ToolChats) != len(toolChatCases) {
				t.Fatalf("reference has %d tool chats, want %d", len(r.ToolChats), len(toolChatCases))
			}
			for i, c := range toolChatCases {
				msgs, tools := messagesOf(t, c.openai)
				text, err := RenderTools(tmpl, msgs, tools, true)
				if err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
				want := r.ToolChats[i]
				if text != want.Text {
					t.Fatalf("%s renders\n%s\nreference\n%s", c.name, text, want.Text)
				}
				for pass := range 2 { // cold, then from the cache
					ids, err := enc.TryEncodeChatTools(nil, msgs, tools, true)
					if err != nil || !slices.Equal(ids, want.IDs) {
						t.Fatalf("%s pass %d: %v, %v\nwant %v", c.name, pass, ids, err, want.IDs)
					}
				}
				// Without the tools the prompt is another one when the
				// template renders them.
				bare, _ := RenderTools(tmpl, msgs, "", true)
				if differs := bare != text; differs != (c.toolsRendered && name == "qwen3") {
					t.Errorf("%s: rendering without tools differs = %v", c.name, differs)
				}
			}
		})
	}
}
