package tokenize

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// jinjaTemplate is a model's own chat_template (from tokenizer_config.json),
// rendered with the Jinja subset of jinja_*.go as transformers renders it.
// The Encoder tokenizes its output split at the tokenizer's added tokens,
// caching each piece of text between them, so an unchanged conversation
// prefix is not tokenized again.
type jinjaTemplate struct {
	name    string
	nodes   []jnode
	toolUse []jnode        // the "tool_use" template of a named list, for requests with tools (nil: none)
	vars    map[string]any // bos_token, eos_token, ...

	tools, toolCalls jsonCache // decoded tools and messages' tool_calls
}

// NewJinjaTemplate parses a chat template. vars are extra template
// variables, such as bos_token and eos_token.
func NewJinjaTemplate(name, source string, vars map[string]string) (Template, error) {
	nodes, err := jinjaParse(source)
	if err != nil {
		return nil, err
	}
	t := &jinjaTemplate{name: name, nodes: nodes, vars: map[string]any{}}
	for k, v := range vars {
		t.vars[k] = v
	}
	return t, nil
}

func (t *jinjaTemplate) Name() string { return t.name }

func (t *jinjaTemplate) render(msgs []Message, tools string, addGenerationPrompt bool) (out string, err error) {
	defer func() { // a template bug must not take the proxy down with a request
		if p := recover(); p != nil {
			out, err = "", fmt.Errorf("chat template %s: %v", t.name, p)
		}
	}()
	list := make([]any, len(msgs))
	vals := make([]jMsg, len(msgs))
	size := 256
	for i := range msgs {
		m := &msgs[i]
		extra, err := messageExtra(m, &t.toolCalls)
		if err != nil {
			return "", fmt.Errorf("messages[%d]: %w", i, err)
		}
		vals[i] = jMsg{role: m.Role, content: m.Content, extra: extra}
		list[i] = &vals[i]
		size += len(m.Content) + len(m.ToolCalls) + 32
	}
	// tools and documents are None unless given, as transformers passes them.
	scope := map[string]any{"messages": list, "add_generation_prompt": addGenerationPrompt, "tools": nil, "documents": nil}
	nodes := t.nodes
	if tools != "" {
		v, err := t.tools.get(tools, jinjaTools)
		if err != nil {
			return "", err
		}
		scope["tools"] = v
		size += len(tools)
		if t.toolUse != nil { // transformers' choice when tools is not None
			nodes = t.toolUse
		}
	}
	for k, v := range t.vars {
		scope[k] = v
	}
	r := &jrender{scopes: []map[string]any{scope}}
	r.out.Grow(size)
	if err := r.exec(nodes); err != nil {
		return "", err
	}
	return r.out.String(), nil
}

func (t *jinjaTemplate) pieces(dst []piece, msgs []Message, tools string, addGenerationPrompt bool) ([]piece, error) {
	text, err := t.render(msgs, tools, addGenerationPrompt)
	if err != nil {
		return dst, err
	}
	return append(dst, piece{msg: Message{Content: text}, literal: true, split: true}), nil
}

func (t *jinjaTemplate) appendMessage(dst []byte, m Message) []byte { return append(dst, m.Content...) }

// LoadTemplate returns the chat template named by spec: a built-in name
// ("chatml", "llama3", "raw"), or the path of a Hugging Face
// tokenizer_config.json (or of a model directory holding one) whose
// chat_template is used, with its bos_token, eos_token, unk_token and
// pad_token. In a directory, chat_template.jinja is used when the config
// has no chat_template.
func LoadTemplate(spec string) (Template, error) {
	if t, ok := templates[spec]; ok {
		return t, nil
	}
	if !strings.ContainsAny(spec, `/\`) && !strings.HasSuffix(spec, ".json") {
		return nil, fmt.Errorf("tokenize: unknown chat template %q (known: %s, or the path of a tokenizer_config.json)",
			spec, strings.Join(TemplateNames(), ", "))
	}
	path, dir := spec, ""
	if fi, err := os.Stat(spec); err == nil && fi.IsDir() {
		dir = spec
		path = filepath.Join(spec, "tokenizer_config.json")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	var cfg map[string]json.RawMessage
	if err := json.Unmarshal(data, &cfg); err != nil {
		return nil, fmt.Errorf("tokenize: %s: %w", path, err)
	}
	source, toolUse, err := chatTemplateSource(cfg["chat_template"])
	if err != nil {
		return nil, fmt.Errorf("tokenize: %s: %w", path, err)
	}
	if source == "" && dir != "" {
		if b, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja")); err == nil {
			source = string(b)
		}
	}
	if source == "" {
		return nil, fmt.Errorf("tokenize: %s has no chat_template", path)
	}
	vars := map[string]string{}
	for _, k := range []string{"bos_token", "eos_token", "unk_token", "pad_token"} {
		if s := specialTokenText(cfg[k]); s != "" {
			vars[k] = s
		}
	}
	t, err := NewJinjaTemplate(path, source, vars)
	if err != nil {
		return nil, fmt.Errorf("tokenize: %s: %w", path, err)
	}
	if toolUse != "" {
		if t.(*jinjaTemplate).toolUse, err = jinjaParse(toolUse); err != nil {
			return nil, fmt.Errorf("tokenize: %s: tool_use template: %w", path, err)
		}
	}
	return t, nil
}

// chatTemplateSource reads chat_template: a string, or a list of named
// templates of which "default" is used, and "tool_use" (if there is one)
// for requests with tools.
func chatTemplateSource(raw json.RawMessage) (source, toolUse string, err error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, "", nil
	}
	var named []struct{ Name, Template string }
	if err := json.Unmarshal(raw, &named); err != nil {
		return "", "", errors.New("chat_template is neither a string nor a list of named templates")
	}
	for _, n := range named {
		switch n.Name {
		case "default":
			source = n.Template
		case "tool_use":
			toolUse = n.Template
		}
	}
	if source == "" {
		return "", "", errors.New(`chat_template has no template named "default"`)
	}
	return source, toolUse, nil
}

// specialTokenText reads a special token written as a string or as an
// AddedToken object {"content": ...}.
func specialTokenText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var obj struct{ Content string }
	if json.Unmarshal(raw, &obj) == nil {
		return obj.Content
	}
	return ""
}
