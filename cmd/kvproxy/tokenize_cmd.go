package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/goccy/go-json"

	"github.com/kvproxy/kvproxy/tokenize"
)

// tokenizeCmd prints the token ids kvproxy computes for stdin:
//
//	kvproxy tokenize -tokenizer cl100k_base [-template chatml] [-chat] < input
func tokenizeCmd(args []string) int {
	fs := flag.NewFlagSet("tokenize", flag.ContinueOnError)
	tokName := fs.String("tokenizer", "cl100k_base", "tokenizer: cl100k_base or o200k_base")
	tmplName := fs.String("template", "chatml", "chat template: chatml, llama3 or raw")
	chat := fs.Bool("chat", false, "stdin is a JSON array of chat messages, rendered with the generation prompt")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	in, err := io.ReadAll(bufio.NewReader(os.Stdin))
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy tokenize:", err)
		return 1
	}
	tok, err := tokenize.Get(*tokName)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy tokenize:", err)
		return 2
	}
	var ids []uint32
	if *chat {
		tmpl, err := tokenize.GetTemplate(*tmplName)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kvproxy tokenize:", err)
			return 2
		}
		var msgs []tokenize.Message
		if err := json.Unmarshal(in, &msgs); err != nil {
			fmt.Fprintln(os.Stderr, "kvproxy tokenize: stdin is not a JSON array of {role, content} messages:", err)
			return 2
		}
		ids = tokenize.NewEncoder(tok, tmpl, 0).EncodeChat(nil, msgs, true)
	} else {
		ids = tok.Encode(nil, string(in))
	}
	if ids == nil {
		ids = []uint32{}
	}
	out, _ := json.Marshal(ids)
	fmt.Println(string(out))
	return 0
}
