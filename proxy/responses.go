package proxy

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/zeebo/xxh3"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/router"
	"github.com/kvproxy/kvproxy/tokenize"
)

// The OpenAI Responses API (POST /v1/responses) is routed as the chat
// request the engine makes of it: vLLM turns instructions, input items and
// tools into chat messages and tools for the model's template
// (construct_input_messages), and so does parseResponses, so a response is
// tokenized, hashed and counted like its chat equivalent.
//
// A response an engine stores (store: true, vLLM with
// VLLM_ENABLE_RESPONSES_API_STORE) lives on that engine only, and a later
// request names it with previous_response_id. kvproxy therefore gives the
// client response ids that name the backend: "resp_kvp" + a tag + "_" +
// the engine's own id. The tag is 8 hex digits of the backend id's hash
// (to find it) and 16 of a MAC over the tenant, the backend id and the
// engine's id, keyed by a secret no tenant holds (respKey). A request that
// names such an id goes to that backend with the engine's id, from any
// kvproxy replica and across restarts, with no table to keep; a tag moved
// onto another engine id, or an id of another tenant's, names nothing, as
// a tenant's cache salt finds none of another's cache. With client keys
// configured an engine's own id (no tag) names nothing either: any tenant
// could send it.

const (
	respIDPrefix = "resp_kvp"
	respTagLen   = 24
)

// respKey keys the response ids' MACs: the cache salt secret; without one,
// when tenants are configured, a key of this process's own (random, so that
// no client key can be guessed offline from an id: ids then last until a
// restart, at this replica only); with no client keys at all a fixed one
// (there is no tenant to keep apart).
func respKey(auth config.Auth, random []byte) []byte {
	h := sha256.New()
	h.Write([]byte("kvproxy response ids\x00"))
	switch {
	case auth.CacheSaltSecret != "":
		h.Write([]byte(auth.CacheSaltSecret))
	case len(auth.Keys) > 0:
		h.Write(random)
	}
	return h.Sum(nil)
}

// idScopeHint says, where response ids hold at one kvproxy process only
// (client keys, no cache salt secret: respKey), that an id of another
// replica's, or from before a restart, names nothing here.
func (st *state) idScopeHint() string {
	if st.cfg.Auth.CacheSaltSecret == "" && len(st.cfg.Auth.Keys) > 0 {
		return " (without auth.cache_salt_secret, response ids hold only at the kvproxy process that made them, until it restarts)"
	}
	return ""
}

// respMACs are the MACs of response ids under one key, pooled: a stream
// makes one, a follow-up checks one.
type respMACs struct {
	pool sync.Pool // of *respMAC
}

type respMAC struct {
	h   hash.Hash
	buf []byte
}

func newRespMACs(key []byte) *respMACs {
	m := &respMACs{}
	m.pool.New = func() any { return &respMAC{h: hmac.New(sha256.New, key)} }
	return m
}

// respSigner tags the ids of the responses one backend makes for one tenant.
type respSigner struct {
	macs            *respMACs
	backend, tenant string
}

// tag is the tag of the engine's id orig.
func (s respSigner) tag(orig []byte) string {
	m := s.macs.pool.Get().(*respMAC)
	m.buf = append(append(append(append(append(m.buf[:0], s.tenant...), 0), s.backend...), 0), orig...)
	m.h.Reset()
	m.h.Write(m.buf)
	var sum [sha256.Size]byte
	mac := m.h.Sum(sum[:0])
	s.macs.pool.Put(m)
	var tag [respTagLen]byte
	appendHex8(tag[:0], s.backend)
	hex.Encode(tag[8:], mac[:8])
	return string(tag[:])
}

func hex8(s string) string {
	var b [8]byte
	return string(appendHex8(b[:0], s))
}

// appendHex8 appends 8 hex digits of s's hash.
func appendHex8(dst []byte, s string) []byte {
	var b [9]byte
	return append(dst, strconv.AppendUint(b[:0], xxh3.HashString(s)>>32|1<<32, 16)[1:]...)
}

// appendTaggedID appends the client's id for the engine's id orig, made by
// the backend with tag.
func appendTaggedID(dst []byte, tag string, orig []byte) []byte {
	dst = append(dst, respIDPrefix...)
	dst = append(dst, tag...)
	dst = append(dst, '_')
	return append(dst, orig...)
}

// splitTaggedID splits a client's response id into its tag and the
// engine's id; ok is false for an id kvproxy did not make, or one whose
// engine id could not be an engine's (letters, digits, _ and - only: it
// goes into the path of the by-id endpoints).
func splitTaggedID(id string) (tag, orig string, ok bool) {
	n := len(respIDPrefix) + respTagLen
	if len(id) <= n+1 || id[:len(respIDPrefix)] != respIDPrefix || id[n] != '_' {
		return "", "", false
	}
	for i := len(respIDPrefix); i < n; i++ {
		if c := id[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return "", "", false
		}
	}
	for _, c := range []byte(id[n+1:]) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && c != '_' && c != '-' {
			return "", "", false
		}
	}
	return id[len(respIDPrefix):n], id[n+1:], true
}

// ownerOf is the backend, within pool p (nil: any model's), that made the
// response orig with tag for tenant; nil when there is none. named reports
// whether a backend of the tag's name is configured (then the id is not
// the tenant's, or the keys changed).
func (st *state) ownerOf(tag, orig, tenant string, p *modelPool) (owner *backend, named bool) {
	for id, b := range st.backends {
		if (p == nil || b.pool == p) && hex8(id) == tag[:8] {
			named = true
			want := respSigner{macs: st.respMACs, backend: id, tenant: tenant}.tag([]byte(orig))
			if hmac.Equal([]byte(want), []byte(tag)) {
				return b, true
			}
		}
	}
	return nil, named
}

// respIDs are the response ids of one Responses exchange: what the engine
// calls them and what the client does.
type respIDs struct {
	signer     respSigner // the serving backend's, for the tenant
	owner      string     // the backend that holds the previous response ("" when unknown)
	prevOrig   string     // previous_response_id, as the engine knows it ("" for none)
	prevTagged string     // as the client sent it
	// The answer's own id, quoted, once read from it.
	orig, tagged []byte
	// prevOrig and prevTagged quoted, once needed.
	prevQuoted, prevTaggedQuoted []byte
}

// learn reads the answer's id from a response object (a non-streamed
// answer, or the "response" member of a streamed event) the first time
// one comes.
func (ids *respIDs) learn(obj []byte) {
	if ids.orig != nil {
		return
	}
	for m := (members{b: obj}); m.next(); {
		if keyIs(m.key, "id") && len(m.value) > 2 && m.value[0] == '"' && bytes.IndexByte(m.value, '\\') < 0 {
			ids.orig = append([]byte(nil), m.value...)
			orig := m.value[1 : len(m.value)-1]
			ids.tagged = append(appendTaggedID([]byte{'"'}, ids.signer.tag(orig), orig), '"')
			return
		}
	}
}

// rewrite replaces the engine's ids in text, an answer or event, with the
// client's: the answer's own, and the previous response's it echoes. It
// returns text itself when neither is in it.
func (ids *respIDs) rewrite(text []byte) []byte {
	if ids.orig != nil && bytes.Contains(text, ids.orig) {
		text = bytes.ReplaceAll(text, ids.orig, ids.tagged)
	}
	if ids.prevOrig != "" && ids.prevOrig != ids.prevTagged {
		if ids.prevQuoted == nil {
			ids.prevQuoted, ids.prevTaggedQuoted = strconv.AppendQuote(nil, ids.prevOrig), strconv.AppendQuote(nil, ids.prevTagged)
		}
		if bytes.Contains(text, ids.prevQuoted) {
			text = bytes.ReplaceAll(text, ids.prevQuoted, ids.prevTaggedQuoted)
		}
	}
	return text
}

// rewriteError gives the client's id for the previous response in an
// engine's error, which quotes it in its message ("Response with id '...'
// not found.").
func (ids *respIDs) rewriteError(body []byte) []byte {
	if ids.prevOrig == "" || ids.prevOrig == ids.prevTagged {
		return body
	}
	return bytes.ReplaceAll(body, []byte(ids.prevOrig), []byte(ids.prevTagged))
}

// The top-level members of a Responses request parseResponses reads, and
// of an input item.
const (
	itemType = iota
	itemRole
	itemContent
	itemCallID
	itemName
	itemArguments
	itemOutput
	itemSummary
	itemNamespace
	itemID
	itemMembersLen
)

var itemMembers = [itemMembersLen]string{"type", "role", "content", "call_id", "name", "arguments", "output", "summary", "namespace", "id"}

// parseResponses fills r, new or reset, from a Responses API request: its
// instructions, input and tools become the messages and tools the engine's
// chat template renders, as vLLM builds them.
func (r *apiRequest) parseResponses(body []byte) *paramError {
	r.addGenPrompt = true
	r.converted, r.responses = true, true
	if pe := r.setBody(body); pe != nil {
		return pe
	}
	f := &r.fields
	var input, instructions, prev []byte
	for m := (members{b: r.body}); m.next(); {
		switch slot := f.slot(m.key); {
		case slot != nil:
			*slot = m.value
		case keyIs(m.key, "input"):
			input = m.value
		case keyIs(m.key, "instructions"):
			instructions = m.value
		case keyIs(m.key, "previous_response_id"):
			prev = m.value
		}
	}
	if pe := r.readCommon(); pe != nil {
		return pe
	}
	if prev != nil && !isNull(prev) {
		if prev[0] != '"' || len(prev) == 2 {
			return perr("previous_response_id", "previous_response_id must be a non-empty string")
		}
		r.prevResponse = r.decodeString(prev)
	}
	if instructions != nil && !isNull(instructions) {
		if instructions[0] != '"' {
			return perr("instructions", "instructions must be a string")
		}
		if text := r.decodeString(instructions); text != "" {
			r.messages = append(r.messages, tokenize.Message{Role: "system", Content: text})
		}
	}
	if pe := r.responsesTools(f.Tools); pe != nil {
		return pe
	}
	return r.responsesInput(input)
}

// responsesInput appends the input's messages: a string is the user's
// message; items become messages as vLLM's construct_chat_messages_with_tool_call
// makes them, an assistant's function calls, reasoning and text merged
// into one assistant message while each finds its member unset.
func (r *apiRequest) responsesInput(raw []byte) *paramError {
	if raw == nil || isNull(raw) {
		return perr("input", "you must provide an input parameter")
	}
	if raw[0] == '"' {
		r.messages = append(r.messages, tokenize.Message{Role: "user", Content: r.decodeString(raw)})
		return nil
	}
	if raw[0] != '[' {
		return perr("input", "input must be a string or an array of input items")
	}
	// The members set on the last message, if it is the assistant's.
	var last struct{ assistant, content, reasoning, calls bool }
	i := 0
	for e := (elements{b: raw}); e.next(); i++ {
		if e.value[0] != '{' {
			return perr(fmt.Sprintf("input[%d]", i), "every input item must be an object")
		}
		var v [itemMembersLen][]byte
		membersNamed(e.value, itemMembers[:], v[:])
		typ := "message"
		if v[itemType] == nil && v[itemRole] == nil && v[itemContent] == nil && v[itemID] != nil {
			// An item reference, whose type may be left out (the Go SDK
			// leaves it out), not a message without its role.
			typ = "item_reference"
		}
		if t := v[itemType]; t != nil && !isNull(t) {
			if t[0] != '"' {
				return perr(fmt.Sprintf("input[%d].type", i), "type must be a string")
			}
			typ = shortString(t)
		}
		str := func(k int) ([]byte, *paramError) {
			if s := v[k]; s != nil && s[0] == '"' {
				return s, nil
			}
			return nil, perr(fmt.Sprintf("input[%d].%s", i, itemMembers[k]), "%s must be a string", itemMembers[k])
		}
		prev := &tokenize.Message{}
		merge := last.assistant
		if merge {
			prev = &r.messages[len(r.messages)-1]
		}
		switch typ {
		case "function_call":
			var parts [3][]byte
			for j, k := range [...]int{itemCallID, itemName, itemArguments} {
				s, pe := str(k)
				if pe != nil {
					return pe
				}
				parts[j] = s
			}
			// A chat tool call, members in the order vLLM builds it.
			start := len(r.text)
			if merge && last.calls {
				r.text = append(r.text, prev.ToolCalls[:len(prev.ToolCalls)-1]...)
				r.text = append(r.text, ',')
			} else {
				r.text = append(r.text, '[')
			}
			r.text = append(r.text, `{"id":`...)
			r.text = append(r.text, parts[0]...)
			r.text = append(r.text, `,"function":{"name":`...)
			if ns := v[itemNamespace]; ns != nil && ns[0] == '"' && len(ns) > 2 {
				// vLLM's flat_namespace_tool_name: namespace__name
				r.text = append(r.text, ns[:len(ns)-1]...)
				r.text = append(r.text, "__"...)
				r.text = append(r.text, parts[1][1:]...)
			} else {
				r.text = append(r.text, parts[1]...)
			}
			r.text = append(r.text, `,"arguments":`...)
			r.text = append(r.text, parts[2]...)
			r.text = append(r.text, `},"type":"function"}]`...)
			if !merge {
				r.messages = append(r.messages, tokenize.Message{Role: "assistant"})
				prev, last = &r.messages[len(r.messages)-1], struct{ assistant, content, reasoning, calls bool }{assistant: true}
			}
			prev.ToolCalls, last.calls = r.textFrom(start), true
		case "reasoning":
			// vLLM: the first content part's text when there is
			// content, else the first summary part's.
			text, ok := firstText(v[itemContent])
			if !ok {
				text, _ = firstText(v[itemSummary])
			}
			var reasoning string
			if text != nil {
				reasoning = r.decodeString(text)
			}
			if !merge || last.reasoning {
				r.messages = append(r.messages, tokenize.Message{Role: "assistant"})
				prev, last = &r.messages[len(r.messages)-1], struct{ assistant, content, reasoning, calls bool }{assistant: true}
			}
			prev.Reasoning, last.reasoning = reasoning, true
		case "message":
			role := v[itemRole]
			if role == nil || role[0] != '"' || len(role) == 2 {
				return perr(fmt.Sprintf("input[%d].role", i), "a message item needs a role: user, system, developer or assistant")
			}
			if name := r.decodeString(role); name != "assistant" {
				content, pe := r.flattenContent(v[itemContent], "input", i)
				if pe != nil {
					return pe
				}
				r.messages = append(r.messages, tokenize.Message{Role: name, Content: content})
				last.assistant = false
				continue
			}
			// An assistant's: its text, or its first part's.
			var content string
			switch c := v[itemContent]; {
			case c == nil || isNull(c):
			case c[0] == '"':
				content = r.decodeString(c)
			case c[0] == '[':
				if t, _ := firstText(c); t != nil {
					content = r.decodeString(t)
				}
			default:
				return perr(fmt.Sprintf("input[%d].content", i), "content must be a string or an array of content parts")
			}
			if !merge || last.content {
				r.messages = append(r.messages, tokenize.Message{Role: "assistant"})
				prev, last = &r.messages[len(r.messages)-1], struct{ assistant, content, reasoning, calls bool }{assistant: true}
			}
			prev.Content, last.content = content, true
		case "function_call_output":
			id, pe := str(itemCallID)
			if pe != nil {
				return pe
			}
			output, pe := r.flattenContent(v[itemOutput], "input", i)
			if pe != nil {
				return pe
			}
			r.messages = append(r.messages, tokenize.Message{Role: "tool", Content: output, ToolCallID: r.decodeString(id)})
			last.assistant = false
		default:
			return perr(fmt.Sprintf("input[%d].type", i), "input items of type %q are not supported: use message, function_call, function_call_output or reasoning items", typ)
		}
	}
	if i == 0 {
		return perr("input", "input must not be empty")
	}
	return nil
}

// firstText is the text of the first element of parts, an array: a
// string, or an object's text (nil when it has none); ok is false when
// parts has no element.
func firstText(parts []byte) (text []byte, ok bool) {
	if parts == nil || parts[0] != '[' {
		return nil, false
	}
	e := elements{b: parts}
	if !e.next() {
		return nil, false
	}
	switch e.value[0] {
	case '"':
		return e.value, true
	case '{':
		var t [1][]byte
		if s := membersNamed(e.value, []string{"text"}, t[:])[0]; s != nil && s[0] == '"' {
			return s, true
		}
	}
	return nil, true
}

var toolMembers = []string{"type", "name", "description", "parameters", "strict"}

func isToolMember(key []byte) bool {
	for _, k := range toolMembers {
		if keyIs(key, k) {
			return true
		}
	}
	return false
}

// responsesTools sets r.tools to the chat tools vLLM gives the template:
// each function tool as {"type": "function", "function": {name,
// description, parameters, strict, the client's own members}} (null when
// absent; values compact, as the template re-serializes them); built-in
// tools are not rendered. No tools is no tools (built-in ones only, an
// empty list), whatever tool_choice says.
func (r *apiRequest) responsesTools(raw []byte) *paramError {
	if raw == nil || isNull(raw) {
		return nil
	}
	if raw[0] != '[' {
		return perr("tools", "tools must be an array of tool objects")
	}
	start := len(r.text)
	r.text = append(r.text, '[')
	n, functions := 0, 0
	for e := (elements{b: raw}); e.next(); n++ {
		if e.value[0] != '{' {
			return perr(fmt.Sprintf("tools[%d]", n), "tools must be an array of tool objects")
		}
		var v [5][]byte
		membersNamed(e.value, toolMembers, v[:])
		if t := v[0]; t == nil || t[0] != '"' || shortString(t) != "function" {
			continue // a built-in tool
		}
		if v[1] == nil || v[1][0] != '"' {
			return perr(fmt.Sprintf("tools[%d].name", n), "a function tool needs a name (a string)")
		}
		if functions++; functions > 1 {
			r.text = append(r.text, ',')
		}
		r.text = append(r.text, `{"type":"function","function":{"name":`...)
		r.text = append(r.text, v[1]...)
		r.text = append(r.text, `,"description":`...)
		r.text = appendOrNull(r.text, v[2])
		r.text = append(r.text, `,"parameters":`...)
		if v[3] == nil {
			r.text = append(r.text, "null"...)
		} else {
			r.text = appendCompact(r.text, v[3])
		}
		r.text = append(r.text, `,"strict":`...)
		r.text = appendOrNull(r.text, v[4])
		// Members of a client's own, kept (pydantic's extra="allow").
		for m := (members{b: e.value}); m.next(); {
			if !isToolMember(m.key) {
				r.text = append(r.text, ',', '"')
				r.text = append(r.text, m.key...)
				r.text = append(r.text, '"', ':')
				r.text = appendCompact(r.text, m.value)
			}
		}
		r.text = append(r.text, "}}"...)
	}
	if n == 0 {
		r.text = r.text[:start]
		return nil // vLLM: no tools; built-in ones only are an empty list
	}
	r.text = append(r.text, ']')
	r.tools = r.textFrom(start)
	return nil
}

// appendCompact appends raw, valid JSON, without insignificant spaces.
func appendCompact(dst, raw []byte) []byte {
	buf := bytes.NewBuffer(dst)
	if json.Compact(buf, raw) != nil {
		return append(dst, raw...)
	}
	return buf.Bytes()
}

func appendOrNull(dst, v []byte) []byte {
	if v == nil {
		return append(dst, "null"...)
	}
	return append(dst, v...)
}

var (
	eventPrefix = []byte("event:")
	deltaSuffix = []byte(".delta")
	deltaKey    = []byte(`"delta":`)
	responseKey = []byte(`"response":`)
)

// onResponsesEvent inspects one event of a streamed response (raw, with
// content its text without the blank line that ends it) and returns it as
// the client gets it: with the response ids the client knows. An event
// whose delta is not empty carries output (text, reasoning, a tool call's
// arguments), the first of them ending the prefill: vLLM sends
// response.created and response.in_progress before it has computed
// anything. The stream ends with response.completed, response.incomplete
// or response.failed; it has no [DONE].
func (r *relay) onResponsesEvent(raw, content []byte) []byte {
	name, data := eventFields(content)
	if data == nil {
		return raw
	}
	if name == nil {
		name = typeOf(data)
	}
	if bytes.HasSuffix(name, deltaSuffix) {
		if v := valueAfter(data, deltaKey); len(v) > 1 && v[0] == '"' && v[1] != '"' {
			r.onToken()
		}
		return raw
	}
	ids := r.x.resp
	if ids.orig == nil && bytes.Contains(data, responseKey) {
		for m := (members{b: data}); m.next(); {
			if keyIs(m.key, "response") && len(m.value) > 0 && m.value[0] == '{' {
				ids.learn(m.value)
			}
		}
	}
	r.x.usage.read(data)
	switch string(name) {
	case "response.completed", "response.incomplete":
		r.sawDone = true
	case "response.failed":
		r.sawDone = true
		r.x.errMsg = "engine: response failed"
	case "error":
		// Terminal, as in OpenAI's streams: the engine ended the
		// response itself, and is not to be taken out for it.
		r.sawDone = true
		r.x.errMsg = "engine error event"
	}
	return ids.rewrite(raw)
}

// eventFields are an event's name (its event: line) and data (its first
// data: line); nil for those it has not.
func eventFields(ev []byte) (name, data []byte) {
	for len(ev) > 0 {
		var line []byte
		line, ev = nextLine(ev)
		switch {
		case bytes.HasPrefix(line, eventPrefix):
			name = bytes.TrimLeft(line[len(eventPrefix):], " ")
		case bytes.HasPrefix(line, dataPrefix) && data == nil:
			data = bytes.TrimLeft(line[len(dataPrefix):], " ")
		}
	}
	return name, data
}

// typeOf is the value of an event's top-level "type" member, a short
// string; nil if it has none.
func typeOf(data []byte) []byte {
	for m := (members{b: data}); m.next(); {
		if keyIs(m.key, "type") && len(m.value) > 1 && m.value[0] == '"' && bytes.IndexByte(m.value, '\\') < 0 {
			return m.value[1 : len(m.value)-1]
		}
	}
	return nil
}

// responsesErrorJSON is the Responses API's error event, numbered seq
// (the engine numbers its events from 0: seq is how many it sent). Its
// "error" member, an OpenAI error object beside the event's own fields,
// is what makes the OpenAI SDKs raise on it (they raise on an event whose
// data has one): without it, a client that passes over event types it
// does not know (LangChain's) took a stream its engine cut short for a
// finished one (the AI SDK trial), where talking to the engine directly
// it would have seen the connection fail.
func responsesErrorJSON(msg, typ, code string, seq int) []byte {
	b := append([]byte(`{"type":"error","code":`), strconv.Quote(code)...)
	b = append(b, `,"message":`...)
	b = appendJSONQuoted(b, msg)
	b = append(b, `,"param":null,"sequence_number":`...)
	b = strconv.AppendInt(b, int64(seq), 10)
	b = append(b, `,"error":`...)
	e := errorJSON(msg, typ, "", code)
	b = append(b, e[len(`{"error":`):len(e)-1]...) // the object inside
	return append(b, '}')
}

// chatJSON is r's messages as a chat request's messages (the engine's
// /tokenize takes those, not a response's input).
func (r *apiRequest) chatJSON() []byte {
	out := []byte{'['}
	for i, m := range r.messages {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, `{"role":`...)
		out = appendJSONQuoted(out, m.Role)
		if m.Content != "" || m.ToolCalls == "" && m.Reasoning == "" {
			out = append(out, `,"content":`...)
			out = appendJSONQuoted(out, m.Content)
		}
		if m.ToolCalls != "" {
			out = append(out, `,"tool_calls":`...)
			out = append(out, m.ToolCalls...)
		}
		if m.ToolCallID != "" {
			out = append(out, `,"tool_call_id":`...)
			out = appendJSONQuoted(out, m.ToolCallID)
		}
		if m.Reasoning != "" {
			out = append(out, `,"reasoning":`...)
			out = appendJSONQuoted(out, m.Reasoning)
		}
		out = append(out, '}')
	}
	return append(out, ']')
}

// lostPrevious reports whether an engine's 404 is its answer that it does
// not hold the previous response (the client's to hear, not a
// configuration fault). ids may be nil.
func (ids *respIDs) lostPrevious(body []byte) bool {
	if ids == nil || ids.prevOrig == "" {
		return false
	}
	if bytes.Contains(body, []byte(ids.prevOrig)) {
		return true
	}
	quoted := appendJSONQuoted(nil, ids.prevOrig) // as the engine's JSON writes it
	return bytes.Contains(body, quoted[1:len(quoted)-1])
}

// previousNotFound is an engine's 404 for a previous response it does not
// hold (store: false, evicted from its store, or lost in a restart), in
// OpenAI's error (a normalized one) with the code and param kvproxy's own
// refusals have: a client that rebuilds the conversation when it reads
// previous_response_not_found missed the engine's (code null, param
// response_id: the twenty-ninth session's SDK trial).
func previousNotFound(errJSON []byte) []byte {
	msg, ok := errorMessage(errJSON)
	if !ok {
		return errJSON
	}
	return errorJSON(msg, "invalid_request_error", "previous_response_id", "previous_response_not_found")
}

// previousResponse makes the ids of a Responses request and sends one that
// continues a response kvproxy relayed (previous_response_id) to the
// backend that made it, which alone holds it; the engine gets its own id
// for it. It reports nil when it answered the request: that backend is no
// longer one of the model's.
func (s *Server) previousResponse(ctx *fasthttp.RequestCtx, st *state, p *modelPool, req *apiRequest, rr *router.Request, rid, tenant string, start time.Time) *respIDs {
	// The ids outlive the request's scratch, whose text may hold them
	// (an id written with escapes is decoded there): copies.
	prev := strings.Clone(req.prevResponse)
	ids := &respIDs{prevOrig: prev, prevTagged: prev}
	notFound := func(why, reason string) *respIDs {
		msg := fmt.Sprintf("Previous response with id '%s' not found%s", req.prevResponse, why)
		writeError(ctx, fasthttp.StatusNotFound, msg, "invalid_request_error", "previous_response_id", "previous_response_not_found")
		s.logRejected(ctx, rid, tenant, req.model, fasthttp.StatusNotFound, start, reason)
		return nil
	}
	tag, orig, ok := splitTaggedID(prev)
	if !ok {
		if req.prevResponse != "" && len(st.cfg.Auth.Keys) > 0 {
			// Any tenant could name an engine's own id.
			return notFound(".", "previous response id not kvproxy's")
		}
		// None, or an engine's own id: the engine it reaches says
		// whether it holds it.
		return ids
	}
	b, named := st.ownerOf(tag, orig, tenant, p)
	switch {
	case b == nil && named:
		return notFound(st.idScopeHint()+".", "previous response id not the tenant's")
	case b == nil || b.isDraining():
		// A removed backend's id and a forged one read the same: the
		// message said the backend was gone to both (the trial).
		return notFound(fmt.Sprintf(": no backend serving the model %q made it (or the one that did serves it no longer)", req.model), "previous response's backend gone")
	}
	ids.prevOrig, req.prevEngine, ids.owner = orig, orig, b.cfg.ID
	// The engine puts the stored conversation, which kvproxy never saw,
	// before this input: the tokens here are not the prompt's prefix, and
	// must not be recorded as cached anywhere.
	rr.Pin, rr.Pinned, rr.Hashes = b.worker, true, nil
	return ids
}

var responsesPathPrefix = []byte("/v1/responses/")

// handleResponseByID serves what vLLM serves for a stored response:
// GET /v1/responses/{id} (and its input_items), DELETE, and POST
// .../cancel, from the backend that made it. A streamed GET (stream=true)
// is answered once the engine has sent it whole.
func (s *Server) handleResponseByID(ctx *fasthttp.RequestCtx, st *state) {
	in, ok := s.admit(ctx, st)
	if !ok {
		return
	}
	defer in.slot.handlerDone()
	rest := string(ctx.Path()[len(responsesPathPrefix):])
	id, sub := rest, ""
	if i := bytes.IndexByte([]byte(rest), '/'); i >= 0 {
		id, sub = rest[:i], rest[i:]
	}
	method := string(ctx.Method())
	allow := ""
	switch sub {
	case "":
		allow = "GET, HEAD, DELETE"
	case "/cancel":
		allow = "POST"
	case "/input_items":
		allow = "GET, HEAD"
	default:
		writeError(ctx, fasthttp.StatusNotFound, "unknown path "+strconv.Quote(string(ctx.Path())), "invalid_request_error", "", "not_found")
		s.logRejected(ctx, in.rid, in.t.name, "", fasthttp.StatusNotFound, in.start, "unknown path")
		return
	}
	if method == fasthttp.MethodHead {
		method = fasthttp.MethodGet
	}
	if !allowed(allow, method) {
		methodNotAllowed(ctx, allow)
		s.logRejected(ctx, in.rid, in.t.name, "", fasthttp.StatusMethodNotAllowed, in.start, "method not allowed")
		return
	}
	tag, orig, ok := splitTaggedID(id)
	var b *backend
	named := false
	if ok {
		b, named = st.ownerOf(tag, orig, in.t.name, nil)
	}
	if b != nil && !in.t.mayUse(b.pool) {
		b = nil // a model the tenant may not use: no response of it exists for it
	}
	if b == nil {
		why := "kvproxy made no response of this id" + st.idScopeHint()
		if ok && !named {
			why = "kvproxy made no response of this id, or the backend that made it is no longer configured"
		}
		writeError(ctx, fasthttp.StatusNotFound, fmt.Sprintf("Response with id '%s' not found: %s", id, why), "invalid_request_error", "", "response_not_found")
		s.logRejected(ctx, in.rid, in.t.name, "", fasthttp.StatusNotFound, in.start, "unknown response id")
		return
	}
	fr := fasthttp.AcquireRequest()
	defer fasthttp.ReleaseRequest(fr)
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseResponse(resp)
	fr.Header.SetMethod(method)
	uri := "/v1/responses/" + orig + sub
	if q := ctx.URI().QueryString(); len(q) > 0 {
		uri += "?" + string(q)
	}
	fr.SetRequestURI(uri)
	fr.Header.SetHost(b.host)
	fr.Header.SetCanonical(hdrRequestID, stringBytes(in.engineID))
	if b.authHeader != "" {
		fr.Header.Set("Authorization", b.authHeader)
	}
	ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(b.cfg.ID))
	status := 0
	var errMsg string
	if !b.healthy() {
		// As a follow-up that needs it gets: the response is stored there
		// only, and the backend may be back in a moment.
		status, errMsg = fasthttp.StatusServiceUnavailable, "backend unavailable"
		s.unavailable(ctx, whyOwner, "backend "+b.cfg.ID+", which holds the response "+id+", is not available; retry")
	} else if err := s.askOwner(ctx, b, fr, resp); err != nil {
		status, errMsg = s.byIDFailed(ctx, b, err)
	} else {
		status = resp.StatusCode()
		body, enc, derr := s.plainAnswer(ctx, resp) // a stored response may be large
		switch {
		case errors.Is(derr, backends.ErrOverBudget):
			status, errMsg = fasthttp.StatusServiceUnavailable, "no room for the answer of backend "+b.cfg.ID+" in limits.body_memory_mb"
			s.overBudget(ctx, "the engine's answer, larger than 1 MiB once decompressed")
		case errors.Is(derr, backends.ErrBeyondBudget) || errors.Is(derr, fasthttp.ErrBodyTooLarge):
			status, errMsg = fasthttp.StatusBadGateway, s.tooLargeDecoded(b)
			writeError(ctx, status, errMsg, "upstream_error", "", "backend_failed")
		case refusesConfig(status):
			// kvproxy's key or the backend's url is at fault, not the
			// client's: a 502 that says so, never the engine's message
			// (it may echo the key kvproxy sent).
			b.logRedirect(status, resp)
			status, errMsg = fasthttp.StatusBadGateway, configRefusal(b.cfg.ID, status, body)
			writeError(ctx, status, errMsg, "upstream_error", "", "backend_failed")
			b.answeredError(errMsg)
		default:
			if status != fasthttp.StatusOK {
				errMsg = "engine answered " + strconv.Itoa(status) + engineErrorKind(body) // in the engine's words
				body = normalizeEngineError(status, body)
			}
			s.relayByID(ctx, st, in.t.name, b, id, orig, status, body, enc, resp.Header.ContentType())
		}
	}
	ev := s.log.Info()
	if status >= 500 {
		ev = s.log.Warn()
	}
	ev = ev.Str("request_id", in.rid)
	if in.engineID != in.rid {
		ev = ev.Str("engine_request_id", in.engineID) // as the access log's (exchange.logLine)
	}
	ev = ev.IPAddr("remote", s.st.Load().clientIP(ctx)).Str("method", method).Str("path", "/v1/responses/{id}"+sub).
		Str("tenant", in.t.name).Str("backend", b.cfg.ID).Int("status", status).Dur("duration", time.Since(in.start))
	if errMsg != "" {
		ev = ev.Str("error", errMsg)
	}
	ev.Msg("request")
	s.metrics.countRequest(b.cfg.ID, status)
}

// relayByID passes an engine's answer about a response (its status, body
// decoded unless enc names its coding, Content-Type ct) to the client of
// tenant, with the response ids as the client knows them.
func (s *Server) relayByID(ctx *fasthttp.RequestCtx, st *state, tenant string, b *backend, id, orig string, status int, body, enc, ct []byte) {
	switch {
	case enc != nil:
		ctx.Response.Header.SetContentEncodingBytes(enc)
	case status != fasthttp.StatusOK:
		// The engine's error quotes the id in its message.
		body = (&respIDs{prevOrig: orig, prevTagged: id}).rewriteError(body)
	default:
		ids := respIDs{signer: respSigner{macs: st.respMACs, backend: b.cfg.ID, tenant: tenant}}
		ids.orig = strconv.AppendQuote(nil, orig)
		ids.tagged = strconv.AppendQuote(nil, id)
		// The response it continued is the same engine's, and the
		// same tenant's: only its ids reach it.
		if prev := previousIn(body); prev != "" {
			ids.prevOrig, ids.prevTagged = prev, string(appendTaggedID(nil, ids.signer.tag([]byte(prev)), []byte(prev)))
		}
		body = ids.rewrite(body)
	}
	ctx.SetStatusCode(status)
	if len(ct) == 0 || status != fasthttp.StatusOK {
		ct = []byte("application/json")
	}
	ctx.Response.Header.SetContentTypeBytes(ct)
	ctx.SetBody(body)
}

// askOwner sends a request for a stored response to the backend that holds
// it, as a completion's exchange goes: counted on the backend (what
// /metrics, /admin/backends and a removed backend's retirement read) and
// among the live exchanges (Shutdown waits for it, Cut ends it), and
// aborted the moment its client hangs up, not at stream_idle_timeout (found
// by a review of slot accounting: an abandoned GET held its tenant's
// max_concurrency place for minutes, and struck the engine as silent).
// It takes no max_concurrency slot: reading a stored response is no
// generation, and must not wait behind generations nor be refused by them.
func (s *Server) askOwner(ctx *fasthttp.RequestCtx, b *backend, fr *fasthttp.Request, resp *fasthttp.Response) error {
	x := &exchange{s: s}
	x.ab = &x.abort
	b.inflight.Add(1)
	defer b.inflight.Add(-1)
	if b.retiring.Load() {
		// A reload removed or replaced it since it was looked up: its
		// retirement may have read its count before this one (and its
		// engine stopped), as route guards against for completions.
		return errRetiring
	}
	s.live.add(x)
	defer s.live.done(x)
	x.watch = s.watcher.Watch(ctx.Conn(), abortOnHangUp{x.ab})
	defer x.stopWatch()
	held, err := b.up.DoWhole(fr, resp, x.ab, heldBy(ctx))
	s.hold(ctx, held)
	return err
}

// errRetiring: the backend asked for a stored response was retired by a
// reload in the moment since it was looked up.
var errRetiring = errors.New("the backend is retiring (a reload removed or replaced it)")

// abortOnHangUp aborts an engine exchange that no router slot goes with
// when its client hangs up (a routed one's is attempt).
type abortOnHangUp struct{ ab *backends.Abort }

func (a abortOnHangUp) hungUp() { a.ab.Abort() }

// byIDFailed answers a request for a stored response whose exchange with
// the backend failed, and strikes the backend as a completion's failure
// would; a client that hung up, or the drain deadline's cut, is no fault
// of the engine's. It returns the status and the error for the log.
func (s *Server) byIDFailed(ctx *fasthttp.RequestCtx, b *backend, err error) (int, string) {
	var ce *backends.ConnectError
	switch {
	case errors.Is(err, errRetiring):
		s.unavailable(ctx, whyOwner, "backend "+b.cfg.ID+", which holds the response, is being replaced or removed by a reload; retry")
		return fasthttp.StatusServiceUnavailable, err.Error()
	case errors.Is(err, backends.ErrAborted) && s.live.isCut():
		s.shuttingDown(ctx, errCutMsg)
		return fasthttp.StatusServiceUnavailable, errCutMsg
	case errors.Is(err, backends.ErrAborted):
		s.answerNothing(ctx)
		return 499, "" // client closed the request: nothing to answer
	case backends.OutOfFiles(err): // no fault of the engine's (failDial)
		s.unavailable(ctx, whyNoFiles, "kvproxy has run out of file descriptors (its open files limit); retry")
		return fasthttp.StatusServiceUnavailable, "no engine connection: " + err.Error()
	case errors.Is(err, backends.ErrOverBudget):
		s.overBudget(ctx, "the stored response, larger than 1 MiB")
		return fasthttp.StatusServiceUnavailable, "no room for the stored response in limits.body_memory_mb"
	case errors.Is(err, backends.ErrBeyondBudget):
		msg := fmt.Sprintf("the stored response is larger than kvproxy holds at once (limits.body_memory_mb: %d MiB)", s.bodyMem.Limit()>>20)
		writeError(ctx, fasthttp.StatusBadGateway, msg, "upstream_error", "", "backend_failed")
		return fasthttp.StatusBadGateway, msg
	case errors.As(err, &ce):
		b.failConn("connect: " + ce.Err.Error())
		ctx.Response.Header.Set("Retry-After", "1")
		msg := "backend " + b.cfg.ID + " refused the connection"
		writeError(ctx, fasthttp.StatusBadGateway, msg, "upstream_error", "", "backend_failed")
		return fasthttp.StatusBadGateway, msg + ": " + ce.Err.Error()
	case backends.IsTimeout(err):
		msg := b.silent()
		b.wholeTimedOut(msg)
		noRetry(ctx)
		writeError(ctx, fasthttp.StatusGatewayTimeout, msg, "timeout_error", "", "backend_timeout")
		return fasthttp.StatusGatewayTimeout, msg
	default:
		b.cutOff(err.Error())
		msg := "backend " + b.cfg.ID + " " + upstreamFault(err)
		writeError(ctx, fasthttp.StatusBadGateway, msg, "upstream_error", "", "backend_failed")
		return fasthttp.StatusBadGateway, msg + ": " + err.Error()
	}
}

// allowed reports whether method is one of allow's ("GET, HEAD").
func allowed(allow, method string) bool {
	for _, m := range strings.Split(allow, ", ") {
		if m == method {
			return true
		}
	}
	return false
}

// previousIn is the previous_response_id of a response object, "" if it
// has none.
func previousIn(body []byte) string {
	for m := (members{b: body}); m.next(); {
		if keyIs(m.key, "previous_response_id") && len(m.value) > 2 && m.value[0] == '"' && bytes.IndexByte(m.value, '\\') < 0 {
			return string(m.value[1 : len(m.value)-1])
		}
	}
	return ""
}
