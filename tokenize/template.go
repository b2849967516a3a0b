package tokenize

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	"github.com/zeebo/xxh3"
)

// Message is one chat message.
type Message struct {
	Role, Content string
	// ToolCalls is an assistant message's tool_calls as the request's JSON
	// (an array of calls, arguments as JSON strings); "" for none.
	ToolCalls string
	// ToolCallID is a tool message's tool_call_id, Name the message's name
	// and Reasoning an assistant message's reasoning (or
	// reasoning_content); "" when absent. Only a model's own template
	// renders them.
	ToolCallID, Name, Reasoning string
}

// Template renders chat messages into text for a tokenizer. The Encoder
// tokenizes and caches each message's rendering on its own, so a template is
// a list of pieces, not one string.
//
// Markers such as <|im_start|> are rendered as text: the tokenizer decides
// whether they are special tokens (a model's tokenizer.json) or plain text
// (tiktoken encodings, which have no such special tokens, encode them
// ordinarily).
type Template interface {
	// Name is the template's name, e.g. "chatml".
	Name() string
	// pieces appends the conversation's pieces in order. tools is the
	// request's tools as JSON (an array, maybe empty), "" for none (null).
	pieces(dst []piece, msgs []Message, tools string, addGenerationPrompt bool) ([]piece, error)
	// appendMessage renders one message piece.
	appendMessage(dst []byte, m Message) []byte
}

// piece is one independently tokenized part of a rendered conversation:
// either a message (rendered by the template's appendMessage) or literal text.
type piece struct {
	msg     Message
	literal bool // msg.Content is literal text; msg.Role is unused
	split   bool // literal text to split at the tokenizer's added tokens, caching each part
}

// markerTemplate renders each message as head + role + mid + content + tail,
// with an optional prefix once before the first message.
type markerTemplate struct {
	name             string
	prefix           string // once, before the first message
	head, mid, tail  string
	generationPrompt string
}

var templates = map[string]Template{
	"chatml": &markerTemplate{
		name:             "chatml",
		head:             "<|im_start|>",
		mid:              "\n",
		tail:             "<|im_end|>\n",
		generationPrompt: "<|im_start|>assistant\n",
	},
	"llama3": &markerTemplate{
		name:             "llama3",
		prefix:           "<|begin_of_text|>",
		head:             "<|start_header_id|>",
		mid:              "<|end_header_id|>\n\n",
		tail:             "<|eot_id|>",
		generationPrompt: "<|start_header_id|>assistant<|end_header_id|>\n\n",
	},
	"raw": rawTemplate{},
}

func (t *markerTemplate) Name() string { return t.name }

func (t *markerTemplate) pieces(dst []piece, msgs []Message, tools string, addGenerationPrompt bool) ([]piece, error) {
	if t.prefix != "" {
		dst = append(dst, piece{msg: Message{Content: t.prefix}, literal: true})
	}
	if !noTools(tools) {
		// Where a model's template puts them differs (the system message,
		// the first user message); first, as a message of their own, keeps
		// the prefix shared by requests with the same tools.
		dst = append(dst, piece{msg: Message{Role: "tools", Content: tools}})
	}
	for _, m := range msgs {
		dst = append(dst, piece{msg: m})
	}
	if addGenerationPrompt && t.generationPrompt != "" {
		dst = append(dst, piece{msg: Message{Content: t.generationPrompt}, literal: true})
	}
	return dst, nil
}

func (t *markerTemplate) appendMessage(dst []byte, m Message) []byte {
	dst = append(dst, t.head...)
	dst = append(dst, m.Role...)
	dst = append(dst, t.mid...)
	dst = append(dst, m.Content...)
	dst = append(dst, m.ToolCalls...)
	return append(dst, t.tail...)
}

// rawTemplate concatenates message contents with nothing between them, for
// completions and tests. Roles are ignored and there is no generation prompt.
type rawTemplate struct{}

func (rawTemplate) Name() string { return "raw" }

func (rawTemplate) pieces(dst []piece, msgs []Message, tools string, _ bool) ([]piece, error) {
	if !noTools(tools) {
		dst = append(dst, piece{msg: Message{Content: tools}, literal: true})
	}
	for _, m := range msgs {
		dst = append(dst, piece{msg: Message{Content: m.Content}, literal: true})
		if m.ToolCalls != "" {
			dst = append(dst, piece{msg: Message{Content: m.ToolCalls}, literal: true})
		}
	}
	return dst, nil
}

func (rawTemplate) appendMessage(dst []byte, m Message) []byte {
	return append(append(dst, m.Content...), m.ToolCalls...)
}

// TemplateNames lists the built-in templates accepted by GetTemplate, sorted.
func TemplateNames() []string {
	names := make([]string, 0, len(templates))
	for n := range templates {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// GetTemplate returns the built-in chat template called name: "chatml",
// "llama3" or "raw". LoadTemplate also reads a model's own template.
func GetTemplate(name string) (Template, error) {
	t, ok := templates[name]
	if !ok {
		return nil, fmt.Errorf("tokenize: unknown chat template %q (known: %s)", name, strings.Join(TemplateNames(), ", "))
	}
	return t, nil
}

// Render returns the text a template produces for a conversation: what the
// Encoder tokenizes, piece by piece. For tests, debugging and the CLI.
func Render(t Template, msgs []Message, addGenerationPrompt bool) (string, error) {
	return RenderTools(t, msgs, "", addGenerationPrompt)
}

// noTools reports whether tools, JSON text, is none or an empty array.
func noTools(tools string) bool {
	t := strings.TrimSpace(tools)
	return t == "" || len(t) >= 2 && t[0] == '[' && strings.TrimSpace(t[1:len(t)-1]) == ""
}

// RenderTools is Render for a request with tools (JSON, an array).
func RenderTools(t Template, msgs []Message, tools string, addGenerationPrompt bool) (string, error) {
	ps, err := t.pieces(nil, msgs, tools, addGenerationPrompt)
	if err != nil {
		return "", err
	}
	var b []byte
	for _, p := range ps {
		if p.literal {
			b = append(b, p.msg.Content...)
		} else {
			b = t.appendMessage(b, p.msg)
		}
	}
	return string(b), nil
}

// AppendMediaStandIn appends the text that stands for a content part that
// is not text (an image, audio, a file) in a prompt the proxy routes and
// counts: a digest of media, what the part points at (MediaOf). It is
// short whatever the part's size (a data: URL can be megabytes) and the
// same for the same media however the part around it is written, so
// conversations carrying the same image share their prefix, as they share
// the engine's cache. The engine computes the part's own tokens, which the
// proxy cannot know.
func AppendMediaStandIn(dst, media []byte) []byte {
	return fmt.Appendf(dst, "<media %016x>", xxh3.Hash(media))
}

// MediaOf is what a content part (its JSON) points at: the decoded string
// of the first of its members image_url, video_url, audio_url, input_audio
// and file that is a string (a Responses-style image_url) or an object
// with a string url, data, file_data or file_id (the first of those); the
// part itself if none. kvproxy reads requests with a faster scanner to the
// same rule; this one is for tests and the simulated engine.
func MediaOf(part []byte) []byte {
	var members map[string]json.RawMessage
	if json.Unmarshal(part, &members) != nil {
		return part
	}
	for _, k := range MediaMembers {
		v := members[k]
		if len(v) == 0 {
			continue
		}
		var s string
		if v[0] == '"' && json.Unmarshal(v, &s) == nil {
			return []byte(s)
		}
		var inner map[string]json.RawMessage
		if json.Unmarshal(v, &inner) != nil {
			continue
		}
		for _, f := range MediaFields {
			if w := inner[f]; len(w) > 0 && w[0] == '"' && json.Unmarshal(w, &s) == nil {
				return []byte(s)
			}
		}
	}
	return part
}

// MediaMembers and MediaFields name where MediaOf looks, in order.
var (
	MediaMembers = []string{"image_url", "video_url", "audio_url", "input_audio", "file"}
	MediaFields  = []string{"url", "data", "file_data", "file_id"}
)
