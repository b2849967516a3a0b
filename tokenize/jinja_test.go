package tokenize

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func renderJinja(t *testing.T, src string, msgs []Message, vars map[string]string) string {
	t.Helper()
	tmpl, err := NewJinjaTemplate("test", src, vars)
	if err != nil {
		t.Fatalf("%q: %v", src, err)
	}
	out, err := Render(tmpl, msgs, true)
	if err != nil {
		t.Fatalf("%q: %v", src, err)
	}
	return out
}

func TestJinjaExpressions(t *testing.T) {
	msgs := []Message{{Role: "system", Content: "S"}, {Role: "user", Content: " Hi "}, {Role: "assistant", Content: "<think>r</think>\n\n\tA"}}
	cases := []struct{ src, want string }{
		{"{{ messages|length }} {{ messages[0].role }} {{ messages[-1]['role'] }}", "3 system assistant"},
		{"{% for m in messages %}{{ loop.index0 }}{{ m.role[0] }}{% if loop.last %}!{% endif %}{% endfor %}", "0s1u2a!"},
		{"{% for m in messages[::-1] %}{{ m.role }},{% endfor %}", "assistant,user,system,"},
		{"{{ messages[1:]|length }}|{{ 'abc'[1:] }}|{{ 'abc'[-1] }}", "2|bc|c"},
		{"{{ messages[1].content|trim }}|{{ messages[1].content.strip() }}|", "Hi|Hi|"},
		// Python semantics: lstrip('\n') strips newlines only.
		{"{{ messages[2].content.split('</think>')[-1].lstrip('\\n') }}", "\tA"},
		{"{{ messages[2].content.split('</think>')[0].split('<think>')[-1] }}", "r"},
		{"{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", "3"},
		{"{% set x = 1 %}{% for m in messages %}{% set x = 2 %}{% endfor %}{{ x }}", "1"}, // loops scope set
		{"{{ 'a' if add_generation_prompt else 'b' }}{{ 'c' if not add_generation_prompt }}", "a"},
		{"{{ undefined_thing is defined }} {{ none is none }} {{ 'x' is string }} {{ 3 is not string }}", "False True True True"},
		{"{{ 'ab' in 'cabd' }} {{ 'z' not in ['a'] }} {{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 % 3 }} {{ 'a' ~ 1 }}", "True True 7 3 2 a1"},
		{"{{ messages[1].content.startswith(' H') and messages[0].content.endswith('S') }}", "True"},
		{"{{ {'a': [1, 'x', none, true]}|tojson }}", `{"a": [1, "x", null, true]}`},
		{"{{ bos_token }}{{ [1,2]|join('-') }}{{ 'x'|upper }}{{ missing|default('d') }}", "<s>1-2Xd"},
		{"a  {%- if true -%}  b  {%- endif -%}  c", "abc"},
		{"{# comment #}x\n  {% if true %}\ny\n  {% endif %}\nz\n", "x\ny\nz"}, // trim_blocks, lstrip_blocks
		{"{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}{% for x in [] %}{% else %}empty{% endfor %}", "37empty"},
		{"{% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.role }}{% endfor %}", "1user2assistant"},
		{"{% if messages[0].role == 'user' %}u{% elif messages[0].role == 'system' %}s{% else %}x{% endif %}", "s"},
		{"{{ ['a', 'code', 'b']|reject('equalto', 'code')|join(', ') }}|{{ [0, 1, 2]|select|list|length }}", "a, b|2"},
		{"{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|first }}", " Hi "},
		{"{{ messages|rejectattr('role', 'eq', 'system')|map(attribute='role')|join(',') }}|{{ [1, 1, 2]|unique|length }}", "user,assistant|2"},
		{"{{ {'a': 1, 'b': [2]}|tojson(indent=2) }}", "{\n  \"a\": 1,\n  \"b\": [\n    2\n  ]\n}"},
		{"{{ 'tool_calls' in messages[0] }} {{ 'role' in messages[0] }} {{ messages[0]|tojson }}", `False True {"role": "system", "content": "S"}`},
		{"{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}", "13"},
		{"{{ ', '.join(['a', 'b']) }}", "a, b"},
		// Llama 3.1's habit: take the system message out, then loop over the rest.
		{"{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content']|trim %}{% set messages = messages[1:] %}{% endif %}" +
			"[{{ sys }}]{% for m in messages %}{{ m.role }};{% endfor %}", "[S]user;assistant;"},
	}
	for _, c := range cases {
		if got := renderJinja(t, c.src, msgs, map[string]string{"bos_token": "<s>"}); got != c.want {
			t.Errorf("%q\n got %q\nwant %q", c.src, got, c.want)
		}
	}
}

// tojson writes strings as Python's json.dumps(ensure_ascii=False) does,
// which transformers' tojson calls: short escapes where JSON has one,
// \u00XX for other control characters, everything else as it is.
func TestJinjaToJSONStrings(t *testing.T) {
	msgs := []Message{{Role: "user", Content: "q\"\\\b\f\n\r\t\x01\x1f\x7fé€😀\xff."}}
	got := renderJinja(t, "{{ messages[0].content|tojson }}", msgs, nil)
	if want := `"q\"\\\b\f\n\r\t\u0001\u001f` + "\x7fé€😀\uFFFD." + `"`; got != want {
		t.Fatalf("got  %q\nwant %q", got, want)
	}
}

func TestJinjaErrors(t *testing.T) {
	for _, src := range []string{
		"{% macro f() %}{% endmacro %}", "{{ x|wordcount }}", "{% if x %}", "{{ x is prime }}", "{{ 'a }}", "{% set x %}y{% endset %}",
	} {
		if _, err := NewJinjaTemplate("bad", src, nil); err == nil {
			t.Errorf("%q: parsed without error", src)
		}
	}
	tmpl, err := NewJinjaTemplate("strict", "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok", nil)
	if err != nil {
		t.Fatal(err)
	}
	enc := NewEncoder(mustGet(t, "cl100k_base"), tmpl, 0)
	_, err = enc.TryEncodeChat(nil, []Message{{Role: "system", Content: "x"}}, true)
	var raised errRaised
	if !errors.As(err, &raised) || !strings.Contains(err.Error(), "first message must be user") {
		t.Fatalf("TryEncodeChat error = %v, want the template's exception", err)
	}
	if ids := enc.EncodeChat(nil, []Message{{Role: "system", Content: "hello world"}}, true); len(ids) != 2 {
		t.Fatalf("EncodeChat fallback = %v, want the raw content's 2 tokens", ids)
	}
}

func TestJinjaPanicBecomesError(t *testing.T) {
	tmpl, err := NewJinjaTemplate("boom", "{{ 'x' * -1 }}{{ 'x' * 9223372036854775807 }}", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Render(tmpl, nil, true); err == nil {
		t.Fatal("no error from a template that panics")
	}
}

func TestLoadTemplate(t *testing.T) {
	for _, name := range []string{"chatml", "llama3", "raw"} {
		if tmpl, err := LoadTemplate(name); err != nil || tmpl.Name() != name {
			t.Errorf("LoadTemplate(%s) = %v, %v", name, tmpl, err)
		}
	}
	dir := t.TempDir()
	cfg := `{"bos_token": {"content": "<B>"}, "eos_token": "<E>", "chat_template": [
		{"name": "tool_use", "template": "tools"},
		{"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"}]}`
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	tmpl, err := LoadTemplate(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := Render(tmpl, []Message{{Role: "user", Content: "hi"}}, true); got != "<B>[user]hi<E>" {
		t.Fatalf("rendered %q", got)
	}
	// No chat_template in the config: chat_template.jinja beside it.
	os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(`{}`), 0o644)
	os.WriteFile(filepath.Join(dir, "chat_template.jinja"), []byte("{{ messages[0].content }}\n"), 0o644)
	if tmpl, err = LoadTemplate(dir); err != nil {
		t.Fatal(err)
	}
	if got, _ := Render(tmpl, []Message{{Role: "user", Content: "hi"}}, true); got != "hi" {
		t.Fatalf("rendered %q", got)
	}
	if _, err := LoadTemplate(filepath.Join(dir, "tokenizer_config.json")); err == nil || !strings.Contains(err.Error(), "no chat_template") {
		t.Fatalf("config without template: %v", err)
	}
	if _, err := LoadTemplate("vicuna"); err == nil || !strings.Contains(err.Error(), "chatml") {
		t.Fatalf("LoadTemplate(vicuna): %v", err)
	}
}

func TestJinjaEncoderConcurrentUse(t *testing.T) {
	tok, err := LoadHF(tinyHF(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := NewJinjaTemplate("chatml-jinja", "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"+
		"{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}", nil)
	if err != nil {
		t.Fatal(err)
	}
	enc := NewEncoder(tok, tmpl, 64)
	convs := make([][]Message, 6)
	wants := make([][]uint32, len(convs))
	for i := range convs {
		convs[i] = conversation(3 + i)
		text, err := Render(tmpl, convs[i], true)
		if err != nil {
			t.Fatal(err)
		}
		wants[i] = tok.Encode(nil, text)
	}
	done := make(chan error)
	for g := range 6 {
		go func() {
			var buf []uint32
			for i := range 30 {
				c := (g + i) % len(convs)
				if buf = enc.EncodeChat(buf[:0], convs[c], true); !slices.Equal(buf, wants[c]) {
					done <- fmt.Errorf("goroutine %d: conversation %d differs from encoding its rendering", g, c)
					return
				}
			}
			done <- nil
		}()
	}
	for range 6 {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
}

// FuzzJinjaMessages renders arbitrary message contents through template
// operations chat templates apply to them (Qwen 3's think-splitting,
// Llama 3's trim): rendering must not fail, and the Encoder must give the
// same ids as encoding the rendering.
func FuzzJinjaMessages(f *testing.F) {
	f.Add("hello", "<think>r</think>\n\nanswer")
	f.Add("", "</think>")
	f.Add("<|im_start|>", "\xff\n<think>\n")
	src := "{%- for m in messages %}{%- set c = m.content %}" +
		"{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}" +
		"{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{{ '<think>' + r.strip('\\n') + '</think>' }}{%- endif %}" +
		"{{ '<|im_start|>' + m.role + '\\n' + c|trim + '<|im_end|>\\n' }}{{ c[::-1][:3] }}{{ c.startswith('<') }}{%- endfor %}" +
		"{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
	tmpl, err := NewJinjaTemplate("fuzz", src, nil)
	if err != nil {
		f.Fatal(err)
	}
	tok, err := LoadHF(tinyHF(f, nil))
	if err != nil {
		f.Fatal(err)
	}
	enc := NewEncoder(tok, tmpl, 0)
	f.Fuzz(func(t *testing.T, user, assistant string) {
		msgs := []Message{{Role: "user", Content: user}, {Role: "assistant", Content: assistant}, {Role: "user", Content: assistant + user}}
		text, err := Render(tmpl, msgs, true)
		if err != nil {
			t.Fatal(err)
		}
		want := tok.Encode(nil, text)
		for range 2 {
			if got := enc.EncodeChat(nil, msgs, true); !slices.Equal(got, want) {
				t.Fatalf("EncodeChat differs from encoding the rendering %q", text)
			}
		}
	})
}

// A hostile template is refused, not run for good or into memory: a range
// whose step overflows looped for good (it now ends as Python's does), and
// a string repeated 200 million times took 400 MB (the fuzzing trial).
func TestHostileTemplateIsBounded(t *testing.T) {
	for src, want := range map[string]string{
		"{% for i in range(9223372036854775800, 9223372036854775807, 100) %}{{ i }}{% endfor %}": "9223372036854775800",
		"{% for i in range(1000000) %}{% endfor %}x":                                             "",
		"{{ 'ab' * 200000000 }}":           "",
		"{{ 'ab' * 4611686018427387904 }}": "",
	} {
		tmpl, err := NewJinjaTemplate("hostile", src, nil)
		if err != nil {
			continue // refused when parsed: as good
		}
		type result struct {
			out string
			err error
		}
		done := make(chan result, 1)
		go func() {
			out, err := RenderTools(tmpl, []Message{{Role: "user", Content: "hi"}}, "", true)
			done <- result{out, err}
		}()
		select {
		case r := <-done:
			if want == "" && r.err == nil || want != "" && r.out != want {
				t.Errorf("%s: %.40q %v, want %q", src, r.out, r.err, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s still renders after 5 s", src)
		}
	}
	// Within the bounds, as before.
	tmpl, err := NewJinjaTemplate("ok", "{% for i in range(3, 0, -1) %}{{ i }}{% endfor %}{{ 'ab' * 2 }}", nil)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := RenderTools(tmpl, nil, "", false); err != nil || out != "321abab" {
		t.Fatalf("%q %v", out, err)
	}
}

// An empty string repeated any number of times is empty, as in Python (the
// repeat bound refused it).
func TestEmptyStringRepeated(t *testing.T) {
	tmpl, err := NewJinjaTemplate("empty", "{{ ('' * 20000000) | length }}", nil)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := RenderTools(tmpl, nil, "", false); err != nil || out != "0" {
		t.Fatalf("%q %v", out, err)
	}
}
