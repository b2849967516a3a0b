package tokenize

import (
	"slices"
	"strings"
	"testing"
)

func mustGet(t testing.TB, name string) Tokenizer {
	t.Helper()
	tok, err := Get(name)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func TestKnownTokenIDs(t *testing.T) {
	cases := []struct {
		enc, text string
		want      []uint32
	}{
		{"cl100k_base", "hello world", []uint32{15339, 1917}},
		{"cl100k_base", "Hello, world!", []uint32{9906, 11, 1917, 0}},
		{"cl100k_base", "", nil},
		// encode_ordinary: a special-token look-alike is plain text.
		{"cl100k_base", "<|endoftext|>", []uint32{27, 91, 8862, 728, 428, 91, 29}},
		{"o200k_base", "hello world", []uint32{24912, 2375}},
		{"o200k_base", "Hello, world!", []uint32{13225, 11, 2375, 0}},
	}
	for _, c := range cases {
		tok := mustGet(t, c.enc)
		if tok.Name() != c.enc {
			t.Errorf("Name() = %q, want %q", tok.Name(), c.enc)
		}
		got := tok.Encode(nil, c.text)
		if !slices.Equal(got, c.want) {
			t.Errorf("%s %q = %v, want %v", c.enc, c.text, got, c.want)
		}
	}
}

func TestEncodeAppends(t *testing.T) {
	tok := mustGet(t, "cl100k_base")
	got := tok.Encode([]uint32{7}, "hello world")
	if !slices.Equal(got, []uint32{7, 15339, 1917}) {
		t.Fatalf("got %v", got)
	}
}

func TestGetReturnsSameInstance(t *testing.T) {
	a, b := mustGet(t, "o200k_base"), mustGet(t, "o200k_base")
	if a != b {
		t.Fatal("Get loaded the encoding twice")
	}
}

func TestUnknownNames(t *testing.T) {
	_, err := Get("gpt2-nope")
	if err == nil || !strings.Contains(err.Error(), "cl100k_base") || !strings.Contains(err.Error(), "o200k_base") {
		t.Fatalf("Get error should list known tokenizers, got %v", err)
	}
	_, err = GetTemplate("mistral-nope")
	if err == nil || !strings.Contains(err.Error(), "chatml") || !strings.Contains(err.Error(), "llama3") {
		t.Fatalf("GetTemplate error should list known templates, got %v", err)
	}
}
