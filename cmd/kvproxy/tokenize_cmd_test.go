package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestTokenizeCmd(t *testing.T) {
	run := func(stdin string, args ...string) (string, int) {
		var out, errb bytes.Buffer
		code := tokenizeCmd(args, strings.NewReader(stdin), &out, &errb)
		return strings.TrimSpace(out.String() + errb.String()), code
	}
	if out, code := run("hello world", "-tokenizer", "cl100k_base"); code != 0 || out != "[15339,1917]" {
		t.Fatalf("cl100k: %q %d", out, code)
	}
	// Special-token look-alikes stay text (encode_ordinary).
	if out, _ := run("<|endoftext|>", "-tokenizer", "cl100k_base"); strings.Contains(out, "100257") {
		t.Fatalf("special token recognised in plain text: %s", out)
	}
	out, code := run(`[{"role":"user","content":"hi"}]`, "-tokenizer", "o200k_base", "-template", "chatml", "-chat")
	if code != 0 || !strings.HasPrefix(out, "[") || len(strings.Split(out, ",")) < 4 {
		t.Fatalf("chat: %q %d", out, code)
	}
	if out, code := run("x", "-tokenizer", "no-such-tokenizer"); code != 2 || !strings.Contains(out, "no-such-tokenizer") {
		t.Fatalf("unknown tokenizer: %q %d", out, code)
	}
	if _, code := run("not json", "-chat"); code != 2 {
		t.Fatalf("bad chat input: %d", code)
	}
	// The text goes on stdin: a word given as an argument was ignored.
	if out, code := run("", "hello"); code != 2 || !strings.Contains(out, `unexpected argument "hello"`) {
		t.Fatalf("a positional argument: %q %d", out, code)
	}
}
