package tokenize

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
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

// Tools and tool calls decoded from JSON are kept by their text and shared
// by later renders (an agent resends them every turn): a template cannot
// change them, as Jinja lets it change only a namespace, and renders that
// share them agree with one that decodes them afresh.
func TestDecodedToolsAreSharedAndUnchangeable(t *testing.T) {
	src := "{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}|{{ tools | tojson }}|" +
		"{% for t in tools %}{{ t | tojson }}|{{ t.function.parameters | tojson(indent=1) }}|{{ t | tojson }}{% endfor %}"
	tools := `[{"type":"function","function":{"name":"f","description":"d\n\"q\"","parameters":{"type":"object"}}}]`
	msgs := []Message{{Role: "user", Content: "go"},
		{Role: "assistant", ToolCalls: `[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":[1,2]}"}}]`}}
	tmpl, err := NewJinjaTemplate("t", src, nil)
	if err != nil {
		t.Fatal(err)
	}
	first, err := RenderTools(tmpl, msgs, tools, false)
	tool := `{"type": "function", "function": {"name": "f", "description": "d\n\"q\"", "parameters": {"type": "object"}}}`
	if want := `null[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": [1, 2]}}}]|[` + tool + `]|` +
		tool + "|{\n \"type\": \"object\"\n}|" + tool; err != nil || first != want {
		t.Fatalf("got  %s (%v)\nwant %s", first, err, want)
	}
	jt := tmpl.(*jinjaTemplate)
	if len(jt.tools.m) != 1 || len(jt.toolCalls.m) != 1 {
		t.Fatalf("cached %d tools and %d tool_calls texts, want 1 and 1", len(jt.tools.m), len(jt.toolCalls.m))
	}
	var wg sync.WaitGroup
	for range 4 { // concurrent renders share the decoded values (race detector)
		wg.Go(func() {
			for range 50 {
				if got, err := RenderTools(tmpl, msgs, tools, false); err != nil || got != first {
					t.Errorf("render from the cache: %q (%v), want %q", got, err, first)
					return
				}
			}
		})
	}
	wg.Wait()
	fresh, _ := NewJinjaTemplate("t", src, nil)
	if got, _ := RenderTools(fresh, msgs, tools, false); got != first {
		t.Fatalf("cold render %q, cached %q", got, first)
	}

	for _, change := range []string{
		"{% set t = tools[0] %}{% set t.type = 'x' %}",
		"{% set c = messages[1].tool_calls[0].function %}{% set c.name = 'x' %}",
		"{% set d = {'a': 1} %}{% set d.a = 2 %}",
	} {
		bad, err := NewJinjaTemplate("bad", change, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := RenderTools(bad, msgs, tools, false); err == nil || !strings.Contains(err.Error(), "non-namespace") {
			t.Errorf("%s: %v, want Jinja's refusal to set an attribute of a non-namespace object", change, err)
		}
	}
}

func TestJSONCacheIsBounded(t *testing.T) {
	var c jsonCache
	decodes := 0
	decode := func(s string) (any, error) { decodes++; return len(s), nil }
	big := strings.Repeat("x", (jsonCacheBytes/20-256)/24-2) // an entry of a twentieth of the bound
	for i := range 100 {
		if v, _ := c.get(big+strconv.Itoa(i), decode); v != len(big)+len(strconv.Itoa(i)) {
			t.Fatalf("get %d = %v", i, v)
		}
	}
	if c.bytes > jsonCacheBytes || len(c.m) > 20 || len(c.m) < 10 {
		t.Fatalf("cache holds %d texts, %d bytes; want at most %d bytes", len(c.m), c.bytes, jsonCacheBytes)
	}
	decodes = 0
	c.get(big+"99", decode) // the newest is kept
	huge := strings.Repeat("y", jsonCacheBytes/16/24)
	c.get(huge, decode)
	c.get(huge, decode) // too big to keep
	if decodes != 2 {
		t.Fatalf("%d decodes, want 2 (a hit, then a text too big to keep decoded twice)", decodes)
	}
}

// The bound holds for the memory the decoded values take, not just their
// text: many distinct small tool calls (as many conversations send) grew
// the heap to 18 times the bound when it counted the text alone, and
// deeply nested tools (a schema of objects in objects), which take far more
// per byte of text, to 2.7 times when it did not count their containers
// (the memory audit).
func TestJSONCacheMemoryStaysNearTheBound(t *testing.T) {
	const depth = 200
	for _, tc := range []struct {
		name   string
		n      int // about three times what the bound holds
		decode func(string) (any, error)
		text   func(i int) string
	}{
		{"tool calls", 30_000, jinjaToolCalls, func(i int) string {
			return fmt.Sprintf(`[{"id":"call_%d","type":"function","function":{"name":"f","arguments":"{\"a\":1,\"b\":[1,2],\"c\":{\"d\":\"e\"}}"}}]`, i)
		}},
		{"nested tools", 3_000, jinjaTools, func(i int) string {
			return `[{"type":"function","function":{"name":"f` + strconv.Itoa(i) + `","parameters":` +
				strings.Repeat(`{"a":`, depth) + "1" + strings.Repeat("}", depth) + `}}]`
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var c jsonCache
			runtime.GC()
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			for i := range tc.n {
				if _, err := c.get(tc.text(i), tc.decode); err != nil {
					t.Fatal(err)
				}
			}
			runtime.GC()
			runtime.ReadMemStats(&m1)
			grew := int64(m1.HeapAlloc) - int64(m0.HeapAlloc)
			t.Logf("%d entries, heap grew %d MB (bound %d MB)", len(c.m), grew>>20, jsonCacheBytes>>20)
			if grew > 2*jsonCacheBytes {
				t.Fatalf("heap grew %d MB holding %d entries, more than twice the %d MB bound", grew>>20, len(c.m), jsonCacheBytes>>20)
			}
		})
	}
}
