package tokenize

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestTemplatesRender(t *testing.T) {
	msgs := []Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Hi"}, {Role: "assistant", Content: "Hello!"}, {Role: "user", Content: "Bye"}}
	cases := []struct {
		name   string
		genP   bool
		expect string
	}{
		{"chatml", false, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" +
			"<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"},
		{"chatml", true, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" +
			"<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"},
		{"llama3", true, "<|begin_of_text|>" +
			"<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" +
			"<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>" +
			"<|start_header_id|>assistant<|end_header_id|>\n\n"},
		{"llama3", false, "<|begin_of_text|>" +
			"<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" +
			"<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"},
		{"raw", true, "Be brief.HiHello!Bye"},
	}
	for _, c := range cases {
		tmpl, err := GetTemplate(c.name)
		if err != nil {
			t.Fatal(err)
		}
		if tmpl.Name() != c.name {
			t.Errorf("Name() = %q", tmpl.Name())
		}
		if got, err := Render(tmpl, msgs, c.genP); err != nil || got != c.expect {
			t.Errorf("%s gen=%v:\n got %q\nwant %q", c.name, c.genP, got, c.expect)
		}
	}
}

// Built-in templates put the tools first, as a message of their own, and
// an assistant's tool calls after its content; the cache tells apart two
// messages that differ only in their calls.
func TestTemplatesRenderTools(t *testing.T) {
	msgs := []Message{{Role: "user", Content: "Hi"},
		{Role: "assistant", Content: "On it.", ToolCalls: `[{"id":"1","function":{"name":"f","arguments":"{}"}}]`},
		{Role: "tool", Content: "done", ToolCallID: "1"}}
	tools := `[{"type":"function","function":{"name":"f"}}]`
	chatml := mustTemplate(t, "chatml")
	got, err := RenderTools(chatml, msgs, tools, false)
	want := "<|im_start|>tools\n" + tools + "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" +
		"<|im_start|>assistant\nOn it." + msgs[1].ToolCalls + "<|im_end|>\n<|im_start|>tool\ndone<|im_end|>\n"
	if err != nil || got != want {
		t.Fatalf("chatml:\n got %q\nwant %q", got, want)
	}
	if got, _ := RenderTools(mustTemplate(t, "raw"), msgs, tools, false); got != tools+"HiOn it."+msgs[1].ToolCalls+"done" {
		t.Fatalf("raw: %q", got)
	}

	tok, err := Get("cl100k_base")
	if err != nil {
		t.Fatal(err)
	}
	enc := NewEncoder(tok, chatml, 0)
	other := slices.Clone(msgs)
	other[1].ToolCalls = `[{"id":"2","function":{"name":"g","arguments":"{}"}}]`
	for _, m := range [][]Message{msgs, other, msgs} { // the second would hit the first's entry if calls were not in the key
		if got, want := enc.EncodeChatTools(nil, m, tools, true), coldEncodeTools(tok, chatml, m, tools, true); !slices.Equal(got, want) {
			t.Fatalf("cached %v\nwant %v", got, want)
		}
	}
	if slices.Equal(enc.EncodeChatTools(nil, msgs, tools, true), enc.EncodeChat(nil, msgs, true)) {
		t.Fatal("the tools are not in the prompt")
	}
}

// A model template is given tool calls and tools as vLLM gives them:
// malformed ones are refused (vLLM answers 400; EncodeChatTools still
// routes on the raw contents), arguments that are not a JSON object become
// {} (vLLM lets the conversation go on), tools left out are None and an
// empty list is a list.
func TestJinjaToolCalls(t *testing.T) {
	tmpl, err := NewJinjaTemplate("t", "{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}"+
		"|{{ tools | tojson }}|{{ tools is none }}|{{ tools is defined }}", nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ calls, tools, err string }{
		{`[{"id":"1"}]`, "", "must be a function call"},
		{`[{"type":"custom","function":{"name":"f"}}]`, "", "must be a function call"},
		{`[7]`, "", "must be an object"},
		{`[]`, `[{"function":{"description":"no name"}}]`, "name must be a string"},
		{`[]`, `[{"type":"function"}]`, "function must be an object"},
		{`[]`, `{"not":"a list"}`, "tools must be an array"},
	} {
		msgs := []Message{{Role: "assistant", ToolCalls: c.calls}}
		if _, err := RenderTools(tmpl, msgs, c.tools, false); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("calls %s tools %s: %v, want an error about %q", c.calls, c.tools, err, c.err)
		}
	}
	msgs := []Message{{Role: "assistant", ToolCalls: `[]`}, {Role: "assistant", ToolCalls: `[{"function":{"name":"a","arguments":null}},` +
		`{"function":{"name":"b"}},{"function":{"name":"c","arguments":{"k":[1,1.0,2.5e-7,true]}}},{"function":{"name":"d","arguments":"{\"x\": 10}"}},` +
		`{"function":{"name":"e","arguments":"{\"cut off"}},{"function":{"name":"h","arguments":{"big":100000000000000000000,"neg":-9223372036854775809}}},{"function":{"name":"f","arguments":"[1]"}},{"function":{"name":"g","arguments":5}}]`}}
	for _, c := range []struct{ tools, want string }{
		{"", `|null|True|True`},
		{"[]", `|[]|False|True`},
	} {
		got, err := RenderTools(tmpl, msgs, c.tools, false)
		want := `null[{"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}, ` +
			`{"function": {"name": "c", "arguments": {"k": [1, 1.0, 2.5e-07, true]}}}, {"function": {"name": "d", "arguments": {"x": 10}}}, ` +
			`{"function": {"name": "e", "arguments": {}}}, {"function": {"name": "h", "arguments": {"big": 100000000000000000000, "neg": -9223372036854775809}}}, {"function": {"name": "f", "arguments": {}}}, {"function": {"name": "g", "arguments": {}}}]` + c.want
		if err != nil || got != want {
			t.Fatalf("tools %q:\n got  %s (%v)\nwant %s", c.tools, got, err, want)
		}
	}
}

// A model's named templates: "tool_use" renders the requests that have
// tools (even an empty list), "default" the others, as transformers picks.
func TestToolUseTemplate(t *testing.T) {
	dir := t.TempDir()
	cfg := `{"chat_template": [{"name": "default", "template": "D{{ messages[0].content }}"},
		{"name": "tool_use", "template": "T{{ tools | length }}{{ messages[0].content }}"}]}`
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	tmpl, err := LoadTemplate(dir)
	if err != nil {
		t.Fatal(err)
	}
	msgs := []Message{{Role: "user", Content: "hi"}}
	for tools, want := range map[string]string{"": "Dhi", "[]": "T0hi", `[{"function":{"name":"f"}}]`: "T1hi"} {
		if got, err := RenderTools(tmpl, msgs, tools, false); err != nil || got != want {
			t.Errorf("tools %q: %q (%v), want %q", tools, got, err, want)
		}
	}
}
