package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/goccy/go-json"

	"github.com/kvproxy/kvproxy/tokenize"
)

// tokenizeCmd prints the token ids kvproxy computes for stdin, as the engine
// would: plain text like tiktoken's encode_ordinary or a tokenizer.json with
// add_special_tokens=False; with -chat, a JSON array of messages rendered
// with the template and the generation prompt.
//
//	kvproxy tokenize -tokenizer cl100k_base|o200k_base|PATH/tokenizer.json \
//	    [-template chatml|llama3|PATH/tokenizer_config.json] [-chat] < input
func tokenizeCmd(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("tokenize", flag.ContinueOnError)
	fs.SetOutput(stderr)
	tokSpec := fs.String("tokenizer", "cl100k_base", "cl100k_base, o200k_base, or the path of a tokenizer.json (or its model directory)")
	tmplSpec := fs.String("template", "chatml", "chatml, llama3, raw, or the path of a tokenizer_config.json (its chat_template)")
	chat := fs.Bool("chat", false, "stdin is a JSON array of chat messages, rendered with add_generation_prompt")
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	fail := func(code int, err error) int {
		fmt.Fprintln(stderr, "kvproxy tokenize:", err)
		return code
	}
	if fs.NArg() > 0 {
		// "kvproxy tokenize hello" read stdin and ignored its word.
		return fail(2, fmt.Errorf("unexpected argument %q: the text comes on stdin", fs.Arg(0)))
	}
	in, err := io.ReadAll(stdin)
	if err != nil {
		return fail(1, err)
	}
	tok, err := tokenize.Load(*tokSpec)
	if err != nil {
		return fail(2, err)
	}
	var ids []uint32
	if *chat {
		tmpl, err := tokenize.LoadTemplate(*tmplSpec)
		if err != nil {
			return fail(2, err)
		}
		var msgs []tokenize.Message
		if err := json.Unmarshal(in, &msgs); err != nil {
			return fail(2, fmt.Errorf("stdin is not a JSON array of {role, content} messages: %w", err))
		}
		if ids, err = tokenize.NewEncoder(tok, tmpl, 0).TryEncodeChat(nil, msgs, true); err != nil {
			return fail(1, err)
		}
	} else {
		ids = tok.Encode(nil, string(in))
	}
	if ids == nil {
		ids = []uint32{}
	}
	out, _ := json.Marshal(ids)
	fmt.Fprintln(stdout, string(out))
	return 0
}
