package proxy

import (
	"bytes"
	stdjson "encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"unicode/utf8"
	"unsafe"

	"github.com/goccy/go-json"

	"github.com/kvproxy/kvproxy/tokenize"
)

// nvext is the proxy's own request extension (Dynamo's name). It is consumed
// here and never forwarded.
type nvext struct {
	TokenData         []uint32        `json:"token_data"`
	BackendInstanceID json.RawMessage `json:"backend_instance_id"`
	Annotations       []string        `json:"annotations"`
	// Dynamo's sampling members: greed_sampling forces greedy decoding
	// (temperature 0); ignore_eos, top_k, repetition_penalty and min_p,
	// which Dynamo took in nvext, go to engines as the request's own
	// (members of the body, in nvextSampling's order; nil: not given).
	greedy   bool
	sampling [len(nvextSampling)][]byte
}

// nvextSampling are the sampling parameters Dynamo takes in nvext that
// vLLM and SGLang take at the top level.
var nvextSampling = [...]string{"ignore_eos", "top_k", "repetition_penalty", "min_p"}

// parse reads nvext from raw, a JSON object, with member names matched as
// apiRequest.parse matches them.
func (n *nvext) parse(raw []byte) bool {
	if raw[0] != '{' {
		return false
	}
	var tokens, instance, annotations, greedy []byte
	for m := (members{b: raw}); m.next(); {
		switch {
		case keyIs(m.key, "token_data"):
			tokens = m.value
		case keyIs(m.key, "backend_instance_id"):
			instance = m.value
		case keyIs(m.key, "annotations"):
			annotations = m.value
		case keyIs(m.key, "greed_sampling"):
			greedy = m.value
		default:
			for i, k := range nvextSampling {
				if keyIs(m.key, k) {
					n.sampling[i] = m.value
				}
			}
		}
	}
	if greedy != nil && !isNull(greedy) {
		var ok bool
		if n.greedy, ok = jsonBool(greedy); !ok {
			return false
		}
	}
	for i, v := range n.sampling {
		if v != nil && isNull(v) {
			n.sampling[i] = nil
		}
	}
	if tokens != nil && json.Unmarshal(tokens, &n.TokenData) != nil {
		return false
	}
	if annotations != nil && json.Unmarshal(annotations, &n.Annotations) != nil {
		return false
	}
	n.BackendInstanceID = instance
	return true
}

func (n *nvext) has(annotation string) bool {
	for _, a := range n.Annotations {
		if a == annotation {
			return true
		}
	}
	return false
}

// apiRequest is what the proxy needs of a completion request; the rest of
// the body is forwarded byte for byte (see forwardBody).
//
// Its strings (model, message roles and contents, promptText) point into
// the request body or into text, without copies: they are valid while the
// body is, which is until the handler returns. Copy what must outlive it.
type apiRequest struct {
	body     []byte
	fields   wireFields
	model    string
	stream   bool
	nv       nvext
	messages []tokenize.Message
	tools    string // chat: the tools, JSON (an array), "" for none
	// completions: the prompt as text, or as token ids
	promptText   string
	promptTokens []uint32
	hasTokens    bool
	// the rest of a batch (prompt as an array of prompts): routed by the
	// first, counted whole
	batchTexts   []string
	batchTokens  [][]uint32
	addGenPrompt bool
	cacheSalt    string // the client's own, within its tenant's (composeSalt)
	// maxTokens is the output the request asks for at most (vLLM's
	// max_completion_tokens or max_tokens), 0 when it names none: with
	// the prompt, what must fit an engine's context (avoidForLength).
	maxTokens int
	// priority is the request's priority member (priorityGiven: it has
	// one; priorityOdd: not as a plain integer, which kvproxy does not
	// read). For a tenant with a priority, the handler sets dropPriority
	// (the engine does not get the client's) and priorityTo, which an
	// engine that schedules by priority gets instead (sendPriority, set
	// per engine).
	priority                   int
	priorityGiven, priorityOdd bool
	dropPriority, sendPriority bool
	priorityTo                 int
	// engineSampling: the engine takes vLLM's sampling parameters (not
	// kind openai), which nvext's go to (set per engine).
	engineSampling bool
	// addUsage: the engine is asked for the stream's usage chunk, which
	// the client did not ask for (set per engine: usageFor).
	addUsage bool
	// oneChoice: the request asks for one sequence (n absent, null or 1;
	// 2.0 and "2" are two to vLLM)
	oneChoice bool
	// prefillStage makes forwardBody the body of a disaggregated prefill
	// (one token, not streamed, kv_transfer_params asking for the KV to be
	// kept for a decode engine); kvParams, when set, are the
	// kv_transfer_params the decode engine is sent.
	prefillStage bool
	kvParams     []byte
	// converted: the messages and tools are kvproxy's rendering of
	// another API's request as the chat request the engine makes of it
	// (parseResponses, parseAnthropic). A Responses request's
	// previous_response_id is prevResponse as the client sent it; the
	// engine gets prevEngine instead when it is set.
	converted    bool
	responses    bool // a Responses API request
	prevResponse string
	prevEngine   string

	wire     []wireMessage // messages as scanned, before validation
	blocks   []block       // a Messages API message's content blocks, as scanned
	anth     []anthMsg     // a Messages API request's messages, placed
	parts    []part        // a Messages API message's own text and images
	images   [][]byte      // the images of a message's tool results
	anthHeld []anthMsg     // scratch of moveOutOfToolRuns
	// a Messages API request's messages, placed (moveOutOfToolRuns,
	// foldSystem)
	anthMoved, anthFolded []anthMsg
	text                  []byte // decoded strings that are not the body's own bytes
	media                 []byte // scratch: the media of a content part (mediaOf)
}

// paramError is a client mistake in one field.
type paramError struct {
	param, msg string
}

func (e *paramError) Error() string { return e.msg }

func perr(param, format string, a ...any) *paramError {
	return &paramError{param: param, msg: fmt.Sprintf(format, a...)}
}

// parseRequest parses a completion request into a new apiRequest.
func parseRequest(body []byte, chat bool) (*apiRequest, *paramError) {
	r := &apiRequest{}
	if pe := r.parse(body, chat); pe != nil {
		return nil, pe
	}
	return r, nil
}

// reset empties r for the next request, keeping its buffers.
func (r *apiRequest) reset() {
	clear(r.messages)
	clear(r.wire)
	clear(r.blocks)
	clear(r.anth)
	clear(r.anthMoved)
	clear(r.anthFolded)
	clear(r.parts)
	clear(r.images)
	*r = apiRequest{messages: r.messages[:0], wire: r.wire[:0], text: r.text[:0], media: r.media[:0], blocks: r.blocks[:0],
		anth: r.anth[:0], parts: r.parts[:0], images: r.images[:0], anthHeld: r.anthHeld[:0], anthMoved: r.anthMoved[:0], anthFolded: r.anthFolded[:0]}
}

// parse fills r, which is new or reset, from body. The body is validated as
// JSON first; after that the fields the proxy needs are read by scanning,
// with the meaning the engines' parsers (Python's json, pydantic) give them:
// member names match exactly after decoding escapes, the last of a repeated
// member wins (null included), and strings decode as encoding/json decodes
// them. A member spelt otherwise ("Stream") is not read here and reaches the
// engine as it came, which ignores it too.
func (r *apiRequest) parse(body []byte, chat bool) *paramError {
	r.addGenPrompt = true
	if pe := r.setBody(body); pe != nil {
		return pe
	}
	f := &r.fields
	for m := (members{b: r.body}); m.next(); {
		if slot := f.slot(m.key); slot != nil {
			*slot = m.value
		}
	}
	if pe := r.readCommon(); pe != nil {
		return pe
	}
	if raw := f.AddGenerationPrompt; raw != nil && chat && !isNull(raw) {
		var ok bool
		if r.addGenPrompt, ok = jsonBool(raw); !ok {
			return perr("add_generation_prompt", "add_generation_prompt must be a boolean")
		}
	}
	if chat {
		if pe := r.parseTools(); pe != nil {
			return pe
		}
		return r.parseMessages()
	}
	return r.parsePrompt()
}

// readCommon reads the fields every generation request has: model,
// stream, nvext and cache_salt.
func (r *apiRequest) readCommon() *paramError {
	f := &r.fields
	if pe := r.readModel(); pe != nil {
		return pe
	}
	if raw := f.Stream; raw != nil && !isNull(raw) {
		var ok bool
		if r.stream, ok = jsonBool(raw); !ok {
			return perr("stream", "stream must be a boolean")
		}
	}
	if raw := f.Nvext; raw != nil && !isNull(raw) {
		if !r.nv.parse(raw) {
			return perr("nvext", "nvext must be an object with token_data (token ids), backend_instance_id, annotations (strings) and greed_sampling (a boolean)")
		}
	}
	r.oneChoice = f.N == nil || isNull(f.N) || string(f.N) == "1"
	if raw := f.Priority; raw != nil {
		r.priorityGiven = true
		r.priority, r.priorityOdd = jsonInt(raw)
		r.priorityOdd = !r.priorityOdd
	}
	for _, raw := range [...][]byte{f.MaxCompletionTokens, f.MaxTokens, f.MaxOutputTokens} {
		if n := tokenCount(raw); n > 0 {
			r.maxTokens = n
			break
		}
	}
	if raw := f.CacheSalt; raw != nil && !isNull(raw) {
		if raw[0] != '"' {
			return perr("cache_salt", "cache_salt must be a string")
		}
		if r.cacheSalt = r.decodeString(raw); r.cacheSalt == "" {
			return perr("cache_salt", "cache_salt must be a non-empty string if provided")
		}
	}
	return nil
}

func isNull(v []byte) bool { return string(v) == "null" }

// jsonInt is v, a JSON value, as an integer, if it is one that fits in 18
// digits.
func jsonInt(v []byte) (int, bool) {
	neg := len(v) > 0 && v[0] == '-'
	if neg {
		v = v[1:]
	}
	if len(v) == 0 || len(v) > 18 {
		return 0, false
	}
	n := 0
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	if neg {
		n = -n
	}
	return n, true
}

// tokenCount is v, a JSON value, as a positive whole number of tokens; 0
// for anything else, which the engine refuses or defaults as it does.
func tokenCount(v []byte) int {
	n := 0
	for _, c := range v {
		if c < '0' || c > '9' || n > 1<<40 {
			return 0
		}
		n = n*10 + int(c-'0')
	}
	return n
}

func jsonBool(v []byte) (value, ok bool) {
	switch string(v) {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// readModel reads fields.Model. null and "" are no model, as vLLM takes
// them (fields.Model is nil then): the caller decides, and vLLM serves
// its one model.
func (r *apiRequest) readModel() *paramError {
	f := &r.fields
	if f.Model == nil || isNull(f.Model) || string(f.Model) == `""` {
		f.Model = nil
		return nil
	}
	if f.Model[0] == '"' {
		r.model = r.decodeString(f.Model)
	}
	if r.model == "" {
		return perr("model", "model must be a string")
	}
	return nil
}

// parseTools keeps the tools, which the engine's chat template renders into
// the prompt (an empty array is given to it too, as vLLM gives it).
func (r *apiRequest) parseTools() *paramError {
	raw := r.fields.Tools
	if raw == nil || isNull(raw) {
		return nil
	}
	if raw[0] != '[' {
		return perr("tools", "tools must be an array of tool objects")
	}
	n := 0
	for e := (elements{b: raw}); e.next(); n++ {
		if e.value[0] != '{' {
			return perr(fmt.Sprintf("tools[%d]", n), "tools must be an array of tool objects")
		}
	}
	r.tools = unsafe.String(&raw[0], len(raw))
	return nil
}

// wireMessage is one element of messages as scanned: raw JSON values, nil
// when absent.
type wireMessage struct {
	role, content, toolCalls, toolCallID, name, reasoning, reasoningContent []byte
}

// checkTypes checks the members the engine's template may render, in a
// fixed order (the last of a repeated member counts, as in Python).
func (w *wireMessage) checkTypes(i int) *paramError {
	if v := w.toolCalls; v != nil && v[0] != '[' && !isNull(v) {
		return perr(fmt.Sprintf("messages[%d].tool_calls", i), "tool_calls must be an array of tool calls")
	}
	if v := w.toolCallID; v != nil && v[0] != '"' && !isNull(v) {
		return perr(fmt.Sprintf("messages[%d].tool_call_id", i), "tool_call_id must be a string")
	}
	if v := w.name; v != nil && v[0] != '"' && !isNull(v) {
		return perr(fmt.Sprintf("messages[%d].name", i), "name must be a string")
	}
	return nil
}

func (r *apiRequest) parseMessages() *paramError {
	raw := r.fields.Messages
	if raw == nil {
		return perr("messages", "you must provide a messages parameter")
	}
	if isNull(raw) {
		return perr("messages", "messages must contain at least one message")
	}
	// Every element is decoded before any is validated, so a malformed
	// element anywhere wins over a missing role earlier on.
	const notMessages = "messages must be an array of message objects with a string role"
	if raw[0] != '[' {
		return perr("messages", notMessages)
	}
	for e := (elements{b: raw}); e.next(); {
		var w wireMessage
		switch e.value[0] {
		case 'n': // null: a message with no role
		case '{':
			for m := (members{b: e.value}); m.next(); {
				v := m.value
				switch {
				case keyIs(m.key, "role"):
					if v[0] == '"' {
						w.role = v
					} else if isNull(v) {
						w.role = nil
					} else {
						return perr("messages", notMessages)
					}
				case keyIs(m.key, "content"):
					w.content = v
				case keyIs(m.key, "tool_calls"):
					w.toolCalls = v
				case keyIs(m.key, "tool_call_id"):
					w.toolCallID = v
				case keyIs(m.key, "name"):
					w.name = v
				case keyIs(m.key, "reasoning"):
					w.reasoning = v
				case keyIs(m.key, "reasoning_content"):
					w.reasoningContent = v
				}
			}
			if pe := w.checkTypes(len(r.wire)); pe != nil {
				return pe
			}
		default:
			return perr("messages", notMessages)
		}
		r.wire = append(r.wire, w)
	}
	if len(r.wire) == 0 {
		return perr("messages", "messages must contain at least one message")
	}
	for i := range r.wire {
		w := &r.wire[i]
		var role string
		if w.role != nil {
			role = r.decodeString(w.role)
		}
		if role == "" { // any other role is the template's to render or refuse (Llama 3.1's ipython)
			return perr(fmt.Sprintf("messages[%d].role", i), "every message needs a role: a non-empty string such as system, user, assistant or tool")
		}
		content, pe := r.flattenContent(w.content, "messages", i)
		if pe != nil {
			return pe
		}
		msg := tokenize.Message{Role: role, Content: content}
		if calls := w.toolCalls; calls != nil && !isNull(calls) && !emptyArray(calls) {
			msg.ToolCalls = unsafe.String(&calls[0], len(calls))
		}
		if w.toolCallID != nil && !isNull(w.toolCallID) {
			msg.ToolCallID = r.decodeString(w.toolCallID)
		}
		if w.name != nil && !isNull(w.name) {
			msg.Name = r.decodeString(w.name)
		}
		// vLLM: reasoning or else reasoning_content, for the template
		// (Qwen 3 renders it in turns after the last user message).
		if w.reasoning != nil {
			msg.Reasoning = r.stringOrEmpty(w.reasoning)
		}
		if msg.Reasoning == "" && w.reasoningContent != nil {
			msg.Reasoning = r.stringOrEmpty(w.reasoningContent)
		}
		r.messages = append(r.messages, msg)
	}
	return nil
}

// flattenContent is the routed text of a message: its content string, or
// its content parts joined by newlines as vLLM joins them.
// list names the array the message is in, for errors.
func (r *apiRequest) flattenContent(raw []byte, list string, i int) (string, *paramError) {
	if len(raw) == 0 || isNull(raw) {
		return "", nil
	}
	if raw[0] == '"' {
		return r.decodeString(raw), nil
	}
	if raw[0] != '[' {
		return "", perr(fmt.Sprintf("%s[%d].content", list, i), "content must be a string or an array of content parts")
	}
	start := len(r.text)
	j, parts := 0, 0
	for e := (elements{b: raw}); e.next(); j++ {
		var text []byte
		if e.value[0] == '"' {
			text = e.value // a plain string is a text part
		} else {
			t, key, ok := contentPart(e.value)
			isText := key != ""
			if !ok && isText {
				return "", perr(fmt.Sprintf("%s[%d].content[%d]", list, i, j), "a content part's %s must be a string", key)
			}
			if !ok {
				return "", perr(fmt.Sprintf("%s[%d].content[%d]", list, i, j), "content part must be an object with a type, or a string")
			}
			if isText && t == nil {
				continue // vLLM skips a text part without text
			}
			text = t
		}
		if parts++; parts > 1 {
			r.text = append(r.text, '\n')
		}
		if text != nil {
			r.text = appendJSONString(r.text, text)
		} else {
			// Images and audio change what the engine caches: a digest
			// of each stands for it in the routed prompt.
			r.text = tokenize.AppendMediaStandIn(r.text, r.mediaOf(e.value))
		}
	}
	return r.textFrom(start), nil
}

// textBytes is the size of the prompt's text: the completions prompt as
// sent, or the messages as routed (an image as its digest) with their tool
// calls and the tools.
func (r *apiRequest) textBytes() int {
	n := len(r.fields.Prompt) + len(r.tools)
	for i := range r.messages {
		n += len(r.messages[i].Content) + len(r.messages[i].ToolCalls)
	}
	return n
}

// mediaOf is tokenize.MediaOf read with the scanner: what a content part
// points at (its image's URL or data), decoded into r.media.
func (r *apiRequest) mediaOf(part []byte) []byte {
	var vals [5][]byte // tokenize.MediaMembers
	for _, v := range membersNamed(part, tokenize.MediaMembers, vals[:]) {
		switch {
		case v == nil:
			continue
		case v[0] == '"':
			return r.jsonStringBytes(v)
		case v[0] != '{':
			continue
		}
		var fields [4][]byte // tokenize.MediaFields
		for _, f := range membersNamed(v, tokenize.MediaFields, fields[:]) {
			if f != nil && f[0] == '"' {
				return r.jsonStringBytes(f)
			}
		}
	}
	return part
}

// membersNamed sets vals[i] to the value of obj's member names[i] (the
// last, if repeated; nil if none) and returns vals. obj is a JSON object.
func membersNamed(obj []byte, names []string, vals [][]byte) [][]byte {
	for m := (members{b: obj}); m.next(); {
		for i, k := range names {
			if keyIs(m.key, k) {
				vals[i] = m.value
			}
		}
	}
	return vals
}

// jsonStringBytes is the JSON string tok decoded: its own bytes when they
// need no decoding (a data: URL's base64), else decoded into r.media.
func (r *apiRequest) jsonStringBytes(tok []byte) []byte {
	if in := tok[1 : len(tok)-1]; bytes.IndexByte(in, '\\') < 0 && utf8.Valid(in) {
		return in
	}
	r.media = appendJSONString(r.media[:0], tok)
	return r.media
}

// stringOrEmpty is the JSON value v decoded if it is a string, else "".
func (r *apiRequest) stringOrEmpty(v []byte) string {
	if v[0] != '"' {
		return ""
	}
	return r.decodeString(v)
}

// emptyArray reports whether v, valid JSON, is an empty array.
func emptyArray(v []byte) bool {
	return v[0] == '[' && len(bytes.TrimSpace(v[1:len(v)-1])) == 0
}

// textParts are the part types vLLM reads as text, and the member that
// holds the text.
var textParts = map[string]string{"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}

var partMembers = [...]string{"type", "text", "refusal", "thinking"}

// contentPart reads a content part, an object with a non-empty string
// type. For a text part (textParts) key names the member holding its text,
// and text is that text, nil when null or absent (vLLM skips the part); it
// must be a string (not ok when it is not). ok is false for anything else.
func contentPart(v []byte) (text []byte, key string, ok bool) {
	if v[0] != '{' {
		return nil, "", false
	}
	var vals [len(partMembers)][]byte
	membersNamed(v, partMembers[:], vals[:])
	typ := vals[0]
	if typ == nil || typ[0] != '"' || len(typ) == 2 {
		return nil, "", false
	}
	key, isText := textParts[shortString(typ)]
	if !isText {
		return nil, "", true
	}
	for i, k := range partMembers {
		if i > 0 && k == key {
			text = vals[i]
		}
	}
	switch {
	case text == nil || isNull(text):
		return nil, key, true
	case text[0] != '"':
		return nil, key, false
	}
	return text, key, true
}

// shortString is the JSON string tok decoded if it is short (a type
// name), else "".
func shortString(tok []byte) string {
	if len(tok) > 6*16+2 { // longer than any type name with every letter escaped
		return ""
	}
	if bytes.IndexByte(tok, '\\') < 0 {
		s := tok[1 : len(tok)-1]
		for _, k := range knownNames {
			if string(s) == k {
				return k // no copy
			}
		}
		return string(s)
	}
	var buf [64]byte
	return string(appendJSONString(buf[:0], tok))
}

// knownNames are the type and role names requests carry most.
var knownNames = [...]string{
	"text", "image_url", "input_text", "output_text", "input_image", "image", "thinking", "refusal",
	"tool_use", "tool_result", "message", "function_call", "function_call_output", "reasoning", "function",
	"user", "assistant", "system", "developer", "tool", "none", "auto",
}

func (r *apiRequest) parsePrompt() *paramError {
	raw := r.fields.Prompt
	if raw == nil || isNull(raw) {
		return perr("prompt", "you must provide a prompt parameter")
	}
	switch raw[0] {
	case '"':
		r.promptText = r.decodeString(raw)
		return nil
	case '[':
		// An array of token ids, an array of strings, or an array of token
		// arrays (a batch: routed by its first prompt).
		var ids []uint32
		if err := json.Unmarshal(raw, &ids); err == nil {
			if len(ids) == 0 {
				return perr("prompt", "prompt must not be empty")
			}
			r.promptTokens, r.hasTokens = ids, true
			return nil
		}
		var strs []string
		if err := json.Unmarshal(raw, &strs); err == nil {
			if len(strs) == 0 {
				return perr("prompt", "prompt must not be empty")
			}
			r.promptText, r.batchTexts = strs[0], strs[1:]
			return nil
		}
		var batch [][]uint32
		if err := json.Unmarshal(raw, &batch); err == nil {
			if len(batch) == 0 || len(batch[0]) == 0 {
				return perr("prompt", "prompt must not be empty")
			}
			r.promptTokens, r.hasTokens, r.batchTokens = batch[0], true, batch[1:]
			return nil
		}
	}
	return perr("prompt", "prompt must be a string, an array of strings, or an array of token ids (integers 0..4294967295)")
}

// decodeString is the value of the JSON string tok: tok's own bytes when
// they need no decoding, else its decoded text, kept in r.text.
func (r *apiRequest) decodeString(tok []byte) string {
	s := tok[1 : len(tok)-1]
	if plainString(s) {
		return unsafe.String(unsafe.SliceData(s), len(s))
	}
	start := len(r.text)
	r.text = appendJSONString(r.text, tok)
	return r.textFrom(start)
}

// textFrom is r.text[start:] as a string. Later appends never change those
// bytes (a growing r.text moves to a new array), so the string stays valid
// until the next request resets r.
func (r *apiRequest) textFrom(start int) string {
	s := r.text[start:]
	if len(s) == 0 {
		return ""
	}
	return unsafe.String(&s[0], len(s))
}

// pinned parses nvext.backend_instance_id: a backend id string or a numeric
// instance id (as a number or a decimal string).
func (n *nvext) pinned() (name string, instance uint64, isNum, ok bool) {
	raw := n.BackendInstanceID
	if len(raw) == 0 || string(raw) == "null" {
		return "", 0, false, false
	}
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) != nil || s == "" {
			return "", 0, false, false
		}
		if v, err := strconv.ParseUint(s, 10, 64); err == nil {
			return s, v, true, true
		}
		return s, 0, false, true
	}
	var v uint64
	if json.Unmarshal(raw, &v) != nil {
		return "", 0, false, false
	}
	return "", v, true, true
}

// wireFields are the raw values of the top-level fields the proxy reads
// (nil when absent), slices of the request body.
type wireFields struct {
	Model               json.RawMessage `json:"model"`
	Stream              json.RawMessage `json:"stream"`
	StreamOptions       json.RawMessage `json:"stream_options"`
	Nvext               json.RawMessage `json:"nvext"`
	AddGenerationPrompt json.RawMessage `json:"add_generation_prompt"`
	Messages            json.RawMessage `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	CacheSalt           json.RawMessage `json:"cache_salt"`
	Tools               json.RawMessage `json:"tools"`
	// the output asked for: chat and completions' max_tokens, chat's
	// max_completion_tokens, the Responses API's max_output_tokens
	MaxTokens           json.RawMessage `json:"max_tokens"`
	MaxCompletionTokens json.RawMessage `json:"max_completion_tokens"`
	MaxOutputTokens     json.RawMessage `json:"max_output_tokens"`
	N                   json.RawMessage `json:"n"`
	Priority            json.RawMessage `json:"priority"` // vLLM's: lower is handled earlier
}

// slot is the field a member named key fills; nil for the others.
func (f *wireFields) slot(key []byte) *json.RawMessage {
	switch {
	case keyIs(key, "model"):
		return &f.Model
	case keyIs(key, "stream"):
		return &f.Stream
	case keyIs(key, "stream_options"):
		return &f.StreamOptions
	case keyIs(key, "nvext"):
		return &f.Nvext
	case keyIs(key, "add_generation_prompt"):
		return &f.AddGenerationPrompt
	case keyIs(key, "messages"):
		return &f.Messages
	case keyIs(key, "prompt"):
		return &f.Prompt
	case keyIs(key, "cache_salt"):
		return &f.CacheSalt
	case keyIs(key, "tools"):
		return &f.Tools
	case keyIs(key, "max_tokens"):
		return &f.MaxTokens
	case keyIs(key, "max_completion_tokens"):
		return &f.MaxCompletionTokens
	case keyIs(key, "max_output_tokens"):
		return &f.MaxOutputTokens
	case keyIs(key, "priority"):
		return &f.Priority
	case keyIs(key, "n"):
		return &f.N
	}
	return nil
}

// choices is how many choices the request asks for: n (1 when absent or
// null) for each of its prompts (the first, and a batch's others in
// batchTexts or batchTokens); 0 when n is not a plain positive number.
func (r *apiRequest) choices() int {
	n := 1
	if f := r.fields.N; f != nil && !isNull(f) {
		if n, _ = strconv.Atoi(string(f)); n <= 0 {
			return 0
		}
	}
	return n * (1 + len(r.batchTexts) + len(r.batchTokens))
}

// setBody checks that body is one valid JSON object and keeps it. A
// leading UTF-8 byte order mark is dropped, as RFC 8259 §8.1 allows and
// vLLM's parser does (files saved by Windows tools carry one).
func (r *apiRequest) setBody(body []byte) *paramError {
	trimmed := bytes.TrimSpace(bytes.TrimPrefix(body, utf8BOM))
	if len(trimmed) == 0 {
		return perr("", "the request body is empty; expected a JSON object")
	}
	if trimmed[0] != '{' {
		return perr("", "the request body is not a valid JSON object")
	}
	if !json.Valid(trimmed) {
		return perr("", "the request body is not a valid JSON object: %s", jsonSyntaxError(trimmed))
	}
	r.body = trimmed
	return nil
}

var utf8BOM = []byte("\xef\xbb\xbf")

// jsonSyntaxError says where and how b, which json.Valid refused, breaks
// (encoding/json's words: goccy's quote the text around it, the client's
// own, which a log line of the answer would then carry).
func jsonSyntaxError(b []byte) string {
	var se *stdjson.SyntaxError
	if err := stdjson.Unmarshal(b, new(stdjson.RawMessage)); errors.As(err, &se) {
		return se.Error() + " (at byte " + strconv.FormatInt(se.Offset, 10) + ")"
	}
	return "it does not parse"
}

// forwardBody appends to dst the body sent to the engine: the client's body
// with nvext and any cache_salt removed (and a response's request_id, which
// would choose the id kvproxy signs for the client: another tenant's),
// model renamed, stream spelled as engines read it, and salt (composeSalt's)
// added as cache_salt ("" adds none).
// Every other member is copied byte for byte.
//
// Members are matched as parse matches them (exactly, escapes decoded), so
// every stream member the proxy read is dropped and the value it used is
// sent as "stream": the engine answers in the form the proxy relays.
func (r *apiRequest) forwardBody(dst []byte, servedModel, salt string) ([]byte, error) {
	out := append(dst, '{')
	n := 0
	m := members{b: r.body}
	// given: the request has a sampling member of its own, which nvext's
	// does not override; its last occurrence counts, as engines read it
	// (a null is none: each of its occurrences goes, and nvext's with it).
	var given [len(nvextSampling)]bool
	if slices.ContainsFunc(r.nv.sampling[:], func(v []byte) bool { return v != nil }) {
		for pre := (members{b: r.body}); pre.next(); {
			for i, k := range nvextSampling {
				if keyIs(pre.key, k) {
					given[i] = !isNull(pre.value)
				}
			}
		}
	}
	for m.next() {
		if r.nv.greedy && keyIs(m.key, "temperature") {
			continue
		}
		skip := false
		for i, k := range nvextSampling {
			skip = skip || r.nv.sampling[i] != nil && !given[i] && keyIs(m.key, k)
		}
		if skip || keyIs(m.key, "nvext") || keyIs(m.key, "cache_salt") || keyIs(m.key, "model") || keyIs(m.key, "stream") ||
			r.prevEngine != "" && keyIs(m.key, "previous_response_id") ||
			r.responses && keyIs(m.key, "request_id") || // vLLM makes it the response's id: the engine picks its own
			r.dropPriority && keyIs(m.key, "priority") ||
			// A client's own would have a NixlConnector engine fetch KV
			// from any host it names; kvproxy's are the prefill's (kvParams).
			keyIs(m.key, "kv_transfer_params") ||
			r.prefillStage && (keyIs(m.key, "max_tokens") || keyIs(m.key, "max_completion_tokens") || keyIs(m.key, "min_tokens") || keyIs(m.key, "stream_options")) {
			continue
		}
		if n > 0 {
			out = append(out, ',')
		}
		out = append(out, m.member...)
		n++
	}
	if m.err != nil {
		return nil, m.err
	}
	if n > 0 {
		out = append(out, ',')
	}
	out = append(out, `"model":`...)
	out = appendJSONQuoted(out, servedModel)
	switch {
	case r.prefillStage:
		out = append(out, `,"stream":false,"max_tokens":1,"kv_transfer_params":`...)
		out = append(out, prefillParams...)
	case r.fields.Stream != nil:
		out = append(out, `,"stream":`...)
		out = append(out, r.fields.Stream...)
		if r.addUsage {
			out = append(out, `,"stream_options":{"include_usage":true}`...)
		}
	}
	if r.kvParams != nil && !r.prefillStage {
		out = append(out, `,"kv_transfer_params":`...)
		out = append(out, r.kvParams...)
	}
	if salt != "" {
		out = append(out, `,"cache_salt":`...)
		out = appendJSONQuoted(out, salt)
	}
	if r.prevEngine != "" {
		out = append(out, `,"previous_response_id":`...)
		out = appendJSONQuoted(out, r.prevEngine)
	}
	if r.sendPriority {
		out = append(out, `,"priority":`...)
		out = strconv.AppendInt(out, int64(r.priorityTo), 10)
	}
	if r.nv.greedy {
		out = append(out, `,"temperature":0`...)
	}
	for i, v := range r.nv.sampling {
		if v != nil && !given[i] && r.engineSampling {
			out = append(out, `,"`...)
			out = append(out, nvextSampling[i]...)
			out = append(out, `":`...)
			out = append(out, v...)
		}
	}
	return append(out, '}'), nil
}

// appendJSONQuoted appends s as a JSON string, exactly as json.Marshal
// writes it (HTML characters, U+2028 and U+2029 escaped, invalid UTF-8 as
// U+FFFD).
func appendJSONQuoted(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			case '\b':
				dst = append(dst, '\\', 'b')
			case '\f':
				dst = append(dst, '\\', 'f')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			dst = append(append(dst, s[start:i]...), `\ufffd`...)
			i += n
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(append(dst, s[start:i]...), '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += n
			start = i
			continue
		}
		i += n
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
