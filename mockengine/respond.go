package mockengine

import (
	"context"
	"net/http"
	"strconv"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/tokenize"
)

// word is one output token: its text (JSON-safe, with a leading space) and
// the id the tokenizer gives that text, so a later prompt that quotes the
// answer tokenizes back to the ids the engine cached.
type word struct {
	text string
	id   uint32
}

var wordList = []string{
	"the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with",
	"be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which",
	"but", "have", "an", "had", "they", "you", "were", "their", "one", "all", "we",
	"can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who",
	"so", "no", "cache", "block", "token", "model", "route", "prefix", "engine", "fast",
	"data", "time", "new", "first", "light", "river", "stone", "cloud",
}

// buildWords keeps the words the tokenizer encodes as a single token.
func buildWords(enc *tokenize.Encoder) []word {
	var ws []word
	var ids []uint32
	for _, w := range wordList {
		ids = enc.EncodeText(ids[:0], " "+w)
		if len(ids) == 1 {
			ws = append(ws, word{text: " " + w, id: ids[0]})
		}
	}
	return ws
}

func mix64(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// newRequest decides the answer: its length (exactly maxTokens with
// ignoreEOS, otherwise a pseudo-random length in [max(1, minTokens),
// maxTokens] seeded by the prompt and the engine's seed) and its words.
func (e *Engine) newRequest(prompt []uint32, minTokens, maxTokens int, ignoreEOS bool, salt string) *request {
	seed := mix64(uint64(e.cfg.Seed) ^ kv.LocalHash(prompt))
	n := maxTokens
	if !ignoreEOS {
		// The end of sequence comes somewhere past min_tokens.
		least := max(1, minTokens)
		n = least + int(seed%uint64(maxTokens-least+1))
	}
	r := &request{
		seq:    Seq{Prompt: prompt, MaxTokens: n, Output: make([]uint32, n), Salt: salt},
		words:  make([]uint16, n),
		notify: make(chan struct{}, 1),
	}
	for j := range r.words {
		k := uint16(mix64(seed+uint64(j)+1) % uint64(len(e.words)))
		r.words[j] = k
		r.seq.Output[j] = e.words[k].id
	}
	return r
}

// wait blocks until the engine has news of r. It reports false if ctx
// ends first.
func (r *request) wait(ctx context.Context) bool {
	select {
	case <-r.notify:
		return true
	case <-ctx.Done():
		return false
	}
}

// waitDone blocks until r has its last token. It reports false if ctx
// ends first.
func (r *request) waitDone(ctx context.Context) bool {
	for !r.done.Load() {
		if !r.wait(ctx) {
			return false
		}
	}
	return true
}

// sseStream is an event stream to the client.
type sseStream struct {
	w  http.ResponseWriter
	fl http.Flusher
}

// startSSE writes the headers of an event stream; they reach the client
// with the first flush.
func startSSE(w http.ResponseWriter) *sseStream {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	return &sseStream{w: w, fl: fl}
}

func (s *sseStream) flush() {
	if s.fl != nil {
		s.fl.Flush()
	}
}

// send writes b and flushes it. It reports false if the client went away.
func (s *sseStream) send(b []byte) bool {
	if _, err := s.w.Write(b); err != nil {
		return false
	}
	s.flush()
	return true
}

// streamTokens sends r's tokens as the engine produces them: at each
// notice, events appends the events of the new tokens, from and up to
// to, and, once done, the closing ones. It reports false if the client
// went away first.
func (e *Engine) streamTokens(ctx context.Context, sse *sseStream, r *request, events func(b []byte, from, to int, done bool) []byte) bool {
	var buf []byte
	sent := 0
	for {
		if !r.wait(ctx) {
			return false
		}
		done := r.done.Load() // before generated: done implies the final count
		g := int(r.generated.Load())
		e.genToks.Add(uint64(g - sent))
		buf = events(buf[:0], sent, g, done)
		sent = g
		if len(buf) > 0 && !sse.send(buf) {
			return false
		}
		if done {
			return true
		}
	}
}

// settle counts a request whose answer was sent in full as finished, and
// aborts one whose client went away first.
func (e *Engine) settle(r *request, sent bool) {
	if !sent {
		e.abort(r)
		e.aborts.Add(1)
		return
	}
	e.finished.Add(1)
}

// responder writes one request's answer in OpenAI's shapes.
type responder struct {
	e            *Engine
	model        []byte // as the answer names it (answerModel)
	chat         bool
	id           string
	created      int64
	promptTokens int
	maxTokens    int
	kvTransfer   []byte // a prefill's kv_transfer_params, for the whole answer
}

func (rs *responder) finishReason(r *request) string {
	if r.call != nil {
		return r.call.finishReason()
	}
	if len(r.words) >= rs.maxTokens {
		return "length"
	}
	return "stop"
}

// head appends the fields every chunk and response share, up to "choices":.
func (rs *responder) head(b []byte, object string) []byte {
	b = append(b, `{"id":"`...)
	b = append(b, rs.id...)
	b = append(b, `","object":"`...)
	b = append(b, object...)
	b = append(b, `","created":`...)
	b = strconv.AppendInt(b, rs.created, 10)
	b = append(b, `,"model":`...)
	b = append(b, rs.model...)
	return append(b, `,"choices":`...)
}

func (rs *responder) usage(b []byte, r *request, completion int) []byte {
	b = append(b, `"usage":{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(rs.promptTokens), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(completion), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(rs.promptTokens+completion), 10)
	b = append(b, `,"prompt_tokens_details":{"cached_tokens":`...)
	b = strconv.AppendInt(b, int64(r.cached.Load()), 10)
	return append(b, `}}`...)
}

func (rs *responder) object(chunk bool) string {
	switch {
	case rs.chat && chunk:
		return "chat.completion.chunk"
	case rs.chat:
		return "chat.completion"
	}
	return "text_completion"
}

// chunk appends the SSE event of output token j. With include_usage every
// token chunk carries "usage":null, as OpenAI documents.
func (rs *responder) chunk(b []byte, r *request, j int, last, includeUsage bool) []byte {
	b = append(b, "data: "...)
	b = rs.head(b, rs.object(true))
	b = append(b, `[{"index":0,`...)
	text := rs.e.words[r.words[j]].text
	if rs.chat {
		b = append(b, `"delta":{`...)
		if j == 0 {
			b = append(b, `"role":"assistant",`...)
		}
		b = append(b, `"content":"`...)
		b = append(b, text...)
		b = append(b, `"}`...)
	} else {
		b = append(b, `"text":"`...)
		b = append(b, text...)
		b = append(b, '"')
	}
	b = append(b, `,"logprobs":null,"finish_reason":`...)
	if last {
		b = append(b, '"')
		b = append(b, rs.finishReason(r)...)
		b = append(b, '"')
	} else {
		b = append(b, "null"...)
	}
	if includeUsage {
		return append(b, "}],\"usage\":null}\n\n"...)
	}
	return append(b, "}]}\n\n"...)
}

// stream sends one SSE chunk per token as the engine produces them. It
// reports false if the client went away first.
func (rs *responder) stream(ctx context.Context, w http.ResponseWriter, r *request, includeUsage bool) bool {
	sse := startSSE(w)
	sse.flush()
	return rs.e.streamTokens(ctx, sse, r, func(b []byte, from, to int, done bool) []byte {
		for j := from; j < to; j++ {
			if r.call != nil {
				b = rs.callChunks(b, r, j, done && j == to-1, includeUsage)
			} else {
				b = rs.chunk(b, r, j, done && j == to-1, includeUsage)
			}
		}
		if done {
			if includeUsage {
				b = append(b, "data: "...)
				b = rs.head(b, rs.object(true))
				b = append(b, "[],"...)
				b = rs.usage(b, r, to)
				b = append(b, "}\n\n"...)
			}
			b = append(b, "data: [DONE]\n\n"...)
		}
		return b
	})
}

// whole waits for the last token and sends one JSON response. It reports
// false if the client went away first.
func (rs *responder) whole(ctx context.Context, w http.ResponseWriter, r *request) bool {
	if !r.waitDone(ctx) {
		return false
	}
	n := len(r.seq.Output)
	rs.e.genToks.Add(uint64(n))
	b := make([]byte, 0, 256+8*n)
	b = rs.head(b, rs.object(false))
	b = append(b, `[{"index":0,`...)
	if r.call != nil {
		b = appendCallMessage(b, r.call)
	} else {
		if rs.chat {
			b = append(b, `"message":{"role":"assistant","content":"`...)
		} else {
			b = append(b, `"text":"`...)
		}
		for _, k := range r.words {
			b = append(b, rs.e.words[k].text...)
		}
		if rs.chat {
			b = append(b, `"}`...)
		} else {
			b = append(b, '"')
		}
	}
	b = append(b, `,"logprobs":null,"finish_reason":"`...)
	b = append(b, rs.finishReason(r)...)
	b = append(b, `"}],`...)
	b = rs.usage(b, r, n)
	if rs.kvTransfer != nil {
		b = append(append(b, `,"kv_transfer_params":`...), rs.kvTransfer...)
	}
	b = append(b, '}')
	w.Header().Set("Content-Type", "application/json")
	_, err := w.Write(b)
	return err == nil
}

// appendCallMessage appends the chat message of a tool call, as vLLM
// builds it for a forced call: content "" and the call.
func appendCallMessage(b []byte, c *toolCall) []byte {
	b = append(b, `"message":{"role":"assistant","content":"","tool_calls":[{"id":"`...)
	b = append(b, c.id...)
	b = append(b, `","type":"function","function":{"name":`...)
	b = append(b, jsonText(c.name)...)
	b = append(b, `,"arguments":`...)
	b = append(b, jsonText(c.arguments)...)
	return append(b, `}}]}`...)
}

// callChunks appends the chunks of a tool call's output token j as vLLM
// streams a forced call: the role first, then each token's text of the
// arguments as a tool call delta, the first one with the call's id, type
// and name; with tool_choice "required" the later ones carry "name":null
// and are left out when they add no text.
func (rs *responder) callChunks(b []byte, r *request, j int, last, includeUsage bool) []byte {
	c := r.call
	if j == 0 {
		b = rs.chatChunk(b, `{"role":"assistant","content":""}`, "", includeUsage)
	}
	text := c.piece(j, j+1)
	var delta string
	switch {
	case j == 0:
		delta = `{"tool_calls":[{"id":"` + c.id + `","type":"function","index":0,"function":{"name":` +
			jsonText(c.name) + `,"arguments":` + jsonText(text) + `}}]}`
	case c.named:
		delta = `{"tool_calls":[{"index":0,"function":{"arguments":` + jsonText(text) + `}}]}`
	case text != "":
		delta = `{"tool_calls":[{"index":0,"function":{"name":null,"arguments":` + jsonText(text) + `}}]}`
	case last:
		delta = `{}`
	default:
		return b
	}
	finish := ""
	if last {
		finish = c.finishReason()
	}
	return rs.chatChunk(b, delta, finish, includeUsage)
}

// chatChunk appends a chat chunk's SSE event: delta, a JSON object, and
// the finish reason ("" for none).
func (rs *responder) chatChunk(b []byte, delta, finish string, includeUsage bool) []byte {
	b = append(b, "data: "...)
	b = rs.head(b, rs.object(true))
	b = append(b, `[{"index":0,"delta":`...)
	b = append(b, delta...)
	b = append(b, `,"logprobs":null,"finish_reason":`...)
	if finish != "" {
		b = append(append(append(b, '"'), finish...), '"')
	} else {
		b = append(b, "null"...)
	}
	if includeUsage {
		return append(b, "}],\"usage\":null}\n\n"...)
	}
	return append(b, "}]}\n\n"...)
}
