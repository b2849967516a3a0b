package tokenize

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// tinyHF builds a byte-level BPE tokenizer.json: the 256 byte tokens (ids
// 0-255 in byte order), then merged tokens in merge order.
func tinyHF(t testing.TB, mutate func(m map[string]any)) string {
	t.Helper()
	vocab := map[string]int{}
	for b := range 256 {
		vocab[string(byteLevelRune[b])] = b
	}
	bl := func(s string) string {
		var r []rune
		for i := 0; i < len(s); i++ {
			r = append(r, byteLevelRune[s[i]])
		}
		return string(r)
	}
	var merges []string
	for _, m := range [][2]string{{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}, {"o", "r"}, {" w", "or"}, {"\xc3", "\xa9"}, {"é", "t"}} {
		l, r := bl(m[0]), bl(m[1])
		if _, ok := vocab[l]; !ok {
			t.Fatalf("merge left %q not in vocab", m[0])
		}
		vocab[l+r] = len(vocab)
		merges = append(merges, l+" "+r)
	}
	doc := map[string]any{
		"version":    "1.0",
		"normalizer": map[string]any{"type": "NFC"},
		"pre_tokenizer": map[string]any{"type": "Sequence", "pretokenizers": []any{
			map[string]any{"type": "Split", "pattern": map[string]any{"Regex": qwenPattern}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": false},
		}},
		"added_tokens": []any{
			map[string]any{"id": 1000, "content": "<|im_start|>", "special": true},
			map[string]any{"id": 1001, "content": "<|im_end|>", "special": true},
			map[string]any{"id": 1002, "content": "<x>", "lstrip": true, "rstrip": true},
		},
		"model": map[string]any{"type": "BPE", "vocab": vocab, "merges": merges, "ignore_merges": false},
	}
	if mutate != nil {
		mutate(doc)
	}
	data, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestHFByteLevelBPE(t *testing.T) {
	tok, err := LoadHF(tinyHF(t, nil)) // a directory holding tokenizer.json
	if err != nil {
		t.Fatal(err)
	}
	id := func(s string) uint32 {
		return tok.(*hfTokenizer).vocab[s]
	}
	cases := []struct {
		text string
		want []uint32
	}{
		{"hello world", []uint32{id("hello"), id(" wor"), 'l', 'd'}},
		{"hell", []uint32{id("hell")}},
		{"<|im_start|>user\nhello<|im_end|>", []uint32{1000, 'u', 's', 'e', 'r', '\n', id("hello"), 1001}},
		{"<|im_start", []uint32{'<', '|', 'i', 'm', '_', 's', 't', 'a', 'r', 't'}},
		{"a  <x>  b", []uint32{'a', 1002, 'b'}},              // lstrip and rstrip take the spaces
		{"e\u0301t", []uint32{id("ét")}},                     // NFC first: e + combining acute = é
		{"12", []uint32{'1', '2'}},                           // Qwen splits single digits
		{"hé\xff", []uint32{'h', id("é"), 0xef, 0xbf, 0xbd}}, // invalid byte → U+FFFD
	}
	for _, c := range cases {
		if got := tok.Encode(nil, c.text); !slices.Equal(got, c.want) {
			t.Errorf("%q: got %v, want %v", c.text, got, c.want)
		}
	}
}

func TestHFPromptSpecialTokens(t *testing.T) {
	tok, err := LoadHF(tinyHF(t, func(m map[string]any) {
		m["post_processor"] = map[string]any{"type": "Sequence", "processors": []any{
			map[string]any{"type": "ByteLevel"},
			map[string]any{"type": "TemplateProcessing",
				"single": []any{
					map[string]any{"SpecialToken": map[string]any{"id": "<|im_start|>", "type_id": 0}},
					map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}},
					map[string]any{"SpecialToken": map[string]any{"id": "<|im_end|>", "type_id": 0}},
				},
				"special_tokens": map[string]any{
					"<|im_start|>": map[string]any{"id": "<|im_start|>", "ids": []int{1000}},
					"<|im_end|>":   map[string]any{"id": "<|im_end|>", "ids": []int{1001}},
				}},
		}}
	}))
	if err != nil {
		t.Fatal(err)
	}
	enc := NewEncoder(tok, mustTemplate(t, "raw"), 0)
	hell := tok.Encode(nil, "hell")
	if got := enc.EncodePrompt(nil, "hell"); !slices.Equal(got, []uint32{1000, hell[0], 1001}) {
		t.Fatalf("EncodePrompt = %v", got)
	}
	if got := enc.EncodePrompt(nil, ""); !slices.Equal(got, []uint32{1000, 1001}) {
		t.Fatalf("EncodePrompt(empty) = %v", got)
	}
	if got := enc.EncodeText(nil, "hell"); !slices.Equal(got, hell) {
		t.Fatalf("EncodeText = %v, want the text alone %v", got, hell)
	}
	if pre, suf := PromptSpecialTokens(mustGet(t, "cl100k_base")); pre != nil || suf != nil {
		t.Fatalf("tiktoken adds %v %v", pre, suf)
	}
}

func TestHFNormalizerSequence(t *testing.T) {
	tok, err := LoadHF(tinyHF(t, func(m map[string]any) {
		m["normalizer"] = map[string]any{"type": "Sequence", "normalizers": []any{
			map[string]any{"type": "NFKC"}, map[string]any{"type": "NFC"}}}
	}))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := tok.Encode(nil, "\ufb01 e\u0301t"), tok.Encode(nil, "fi ét"); !slices.Equal(got, want) {
		t.Fatalf("NFKC: got %v, want %v", got, want)
	}
}

func TestHFUnsupportedKindsAreErrors(t *testing.T) {
	cases := []struct {
		name, want string
		mutate     func(m map[string]any)
	}{
		{"wordpiece", `model type "WordPiece"`, func(m map[string]any) { m["model"].(map[string]any)["type"] = "WordPiece" }},
		{"metaspace", `pre-tokenizer "Metaspace"`, func(m map[string]any) {
			m["pre_tokenizer"] = map[string]any{"type": "Metaspace", "replacement": "▁"}
		}},
		{"pattern", "unsupported Split pattern", func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["pattern"] = map[string]any{"Regex": `\w+`}
		}},
		{"normalizer", `normalizer "Lowercase"`, func(m map[string]any) { m["normalizer"] = map[string]any{"type": "Lowercase"} }},
		{"dropout", "dropout", func(m map[string]any) { m["model"].(map[string]any)["dropout"] = 0.1 }},
		{"prefix space", "add_prefix_space", func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[1].(map[string]any)["add_prefix_space"] = true
		}},
		{"single word", "single_word", func(m map[string]any) {
			m["added_tokens"] = []any{map[string]any{"id": 7, "content": "<y>", "single_word": true}}
		}},
		{"not byte level", "not byte-level", func(m map[string]any) {
			m["model"].(map[string]any)["vocab"].(map[string]int)["▁the"] = 5000
		}},
	}
	for _, c := range cases {
		_, err := LoadHF(filepath.Join(tinyHF(t, c.mutate), "tokenizer.json"))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one mentioning %q", c.name, err, c.want)
		}
	}
	if _, err := LoadHF(filepath.Join(t.TempDir(), "missing.json")); err == nil {
		t.Error("missing file: no error")
	}
}

func TestLoad(t *testing.T) {
	tok, err := Load("o200k_base")
	if err != nil || tok.Name() != "o200k_base" {
		t.Fatalf("Load(o200k_base) = %v, %v", tok, err)
	}
	dir := tinyHF(t, nil)
	a, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Load(filepath.Join(dir, "."))
	if err != nil || a != b {
		t.Fatalf("second Load of the same path: %v, %v (same instance: %v)", b, err, a == b)
	}
	if _, err := Load("llama9"); err == nil || !strings.Contains(err.Error(), "cl100k_base") {
		t.Fatalf("Load(llama9) error %v should list known names", err)
	}
	if _, err := Load(filepath.Join(t.TempDir(), "nope", "tokenizer.json")); err == nil {
		t.Fatal("Load of a missing file: no error")
	}
}

func TestHFByteLevelWithRegexUsesGPT2Split(t *testing.T) {
	tok, err := LoadHF(tinyHF(t, func(m map[string]any) {
		m["pre_tokenizer"] = map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}
	}))
	if err != nil {
		t.Fatal(err)
	}
	if reflect.ValueOf(tok.(*hfTokenizer).split).Pointer() != reflect.ValueOf(splitGPT2).Pointer() {
		t.Fatal("ByteLevel with use_regex does not split like GPT-2")
	}
	if got := tok.Encode(nil, "hello world"); len(got) != 4 {
		t.Fatalf("hello world = %v", got)
	}
}
