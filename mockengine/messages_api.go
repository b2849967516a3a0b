package mockengine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
)

// The Anthropic Messages API as vLLM serves it
// (vllm/entrypoints/anthropic/{api_router,serving}.py): the request runs
// as the chat request it converts to, on the same scheduler, prefix cache
// and timing, and the chat answer is converted back.

// messagesCall is a validated Messages request, ready to run.
type messagesCall struct {
	req       messagesRequest
	prompt    []uint32
	maxTokens int
	force     *forcedCall // the call tool_choice forces, if any
}

// parseMessages validates a Messages request (a count_tokens one when
// count: no max_tokens) and renders its prompt.
func (e *Engine) parseMessages(w http.ResponseWriter, r *http.Request, count bool) (*messagesCall, error) {
	c := &messagesCall{}
	req := &c.req
	if err := e.decodeRequest(w, r, req, &req.Model); err != nil {
		return nil, err
	}
	if !count {
		if req.MaxTokens == nil {
			return nil, invalid("max_tokens", "max_tokens is required")
		}
		if c.maxTokens = *req.MaxTokens; c.maxTokens <= 0 {
			return nil, invalid("max_tokens", "max_tokens must be positive")
		}
	}
	chat, err := convertMessages(req)
	if err != nil {
		return nil, err
	}
	if c.force, err = forcedTool(messagesToolChoice(req.ToolChoice), messagesFunctionTools(req.Tools)); err != nil {
		return nil, err
	}
	if c.prompt, err = e.enc.TryEncodeChatTools(nil, chat.messages, chat.tools, true); err != nil {
		return nil, invalid("messages", "chat template: %v", err)
	}
	if len(c.prompt) == 0 {
		return nil, invalid("messages", "the prompt is empty")
	}
	if capacity := e.cfg.CacheBlocks * e.cfg.BlockSize; !count && c.maxTokens > capacity-len(c.prompt) {
		return nil, tooLong("max_tokens", len(c.prompt), c.maxTokens, capacity)
	}
	return c, nil
}

// failAnthropic answers with vLLM's Anthropic error object,
// {"type":"error","error":{"type","message"}}, the chat path's error type
// and status carried over as vLLM's translate_error_response does.
func (e *Engine) failAnthropic(w http.ResponseWriter, err error) {
	e.rejected.Add(1)
	status, typ := http.StatusInternalServerError, "internal_error"
	var b *badRequest
	if errors.As(err, &b) {
		status, typ = b.status, b.typ
	}
	var body struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	body.Type, body.Error.Type, body.Error.Message = "error", typ, err.Error()
	out, _ := json.Marshal(&body)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(out)
}

func (e *Engine) serveMessages(w http.ResponseWriter, hr *http.Request) {
	e.enter()
	defer e.leave()
	c, err := e.parseMessages(w, hr, false)
	if err != nil {
		e.failAnthropic(w, err)
		return
	}
	r := e.newAnswer(c.prompt, 0, c.maxTokens, c.req.IgnoreEOS, c.req.CacheSalt, c.force)
	r.seq.LoRA = e.adapterOf(c.req.Model)
	if err := e.submit(r); err != nil {
		e.failAnthropic(w, err)
		return
	}
	// vLLM's answer keeps the id of the chat completion it converts.
	mw := &messagesWriter{e: e, c: c, r: r, id: fmt.Sprintf("chatcmpl-%s-%d", e.idPrefix, r.seq.ID)}
	if c.req.Stream != nil && *c.req.Stream {
		e.settle(r, mw.stream(hr.Context(), w))
	} else {
		e.settle(r, mw.whole(hr.Context(), w))
	}
}

// serveCountTokens answers POST /v1/messages/count_tokens as vLLM does:
// the prompt tokens of the same conversion, nothing generated.
func (e *Engine) serveCountTokens(w http.ResponseWriter, hr *http.Request) {
	c, err := e.parseMessages(w, hr, true)
	if err != nil {
		e.failAnthropic(w, err)
		return
	}
	n := strconv.Itoa(len(c.prompt))
	w.Header().Set("Content-Type", "application/json")
	w.Write([]byte(`{"input_tokens":` + n + `,"context_management":{"original_input_tokens":` + n + `}}`))
}

// messagesWriter answers one Messages request.
type messagesWriter struct {
	e  *Engine
	c  *messagesCall
	r  *request
	id string
}

// stopReason is vLLM's mapping of the chat finish reason.
func (mw *messagesWriter) stopReason() string {
	if c := mw.r.call; c != nil {
		return map[string]string{"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}[c.finishReason()]
	}
	if len(mw.r.words) >= mw.c.maxTokens {
		return "max_tokens" // finish_reason "length"
	}
	return "end_turn" // "stop"
}

// usage appends the usage object in Anthropic's meaning, as vLLM reports
// it: input_tokens the prompt tokens not read from the prefix cache,
// cache_read_input_tokens those read from it.
func (mw *messagesWriter) usage(b []byte, output int) []byte {
	cached := int64(mw.r.cached.Load())
	b = append(b, `{"input_tokens":`...)
	b = strconv.AppendInt(b, int64(len(mw.r.seq.Prompt))-cached, 10)
	b = append(b, `,"output_tokens":`...)
	b = strconv.AppendInt(b, int64(output), 10)
	b = append(b, `,"cache_read_input_tokens":`...)
	b = strconv.AppendInt(b, cached, 10)
	return append(b, '}')
}

func (mw *messagesWriter) text() []byte {
	var b []byte
	for _, k := range mw.r.words {
		b = append(b, mw.e.words[k].text...)
	}
	return b
}

// whole waits for the last token and sends the message, as vLLM dumps it
// (exclude_none). It reports false if the client went away first.
func (mw *messagesWriter) whole(ctx context.Context, w http.ResponseWriter) bool {
	r := mw.r
	if !r.waitDone(ctx) {
		return false
	}
	n := len(r.seq.Output)
	mw.e.genToks.Add(uint64(n))
	b := make([]byte, 0, 256+8*n)
	b = append(b, `{"id":"`...)
	b = append(b, mw.id...)
	b = append(b, `","type":"message","role":"assistant","content":[`...)
	if c := r.call; c != nil {
		input := c.arguments
		if !json.Valid([]byte(input)) { // cut at max_tokens
			input = "{}"
		}
		b = appendToolUse(b, c, input)
	} else {
		b = append(b, `{"type":"text","text":"`...)
		b = append(b, mw.text()...) // the words are JSON-safe
		b = append(b, `"}`...)
	}
	b = append(b, `],"model":`...)
	b = append(b, mw.e.answerModel(mw.r.seq.LoRA)...)
	b = append(b, `,"stop_reason":"`...)
	b = append(b, mw.stopReason()...)
	b = append(b, `","usage":`...)
	b = mw.usage(b, n)
	b = append(b, '}')
	w.Header().Set("Content-Type", "application/json")
	_, err := w.Write(b)
	return err == nil
}

// event appends one SSE event as vLLM's wrap_data_with_event writes it.
func event(b []byte, typ string, data ...string) []byte {
	b = append(b, "event: "...)
	b = append(b, typ...)
	b = append(b, "\ndata: "...)
	for _, d := range data {
		b = append(b, d...)
	}
	return append(b, "\n\n"...)
}

// stream sends vLLM's message_stream_converter events: message_start,
// content_block_start and the first content_block_delta with the first
// token (vLLM starts on its first chat chunk), one content_block_delta per
// token as the engine produces them, then content_block_stop,
// message_delta, message_stop and data: [DONE]. A tool call's block is a
// tool_use one with an empty input, its deltas input_json_delta ones
// (none for a token that adds no text). Events are dumped with
// exclude_unset, so message_start's message has no type or role. It
// reports false if the client went away first.
func (mw *messagesWriter) stream(ctx context.Context, w http.ResponseWriter) bool {
	sse := startSSE(w)
	sse.flush()
	r := mw.r
	return mw.e.streamTokens(ctx, sse, r, func(b []byte, from, to int, done bool) []byte {
		if from == 0 && to > 0 {
			b = event(b, "message_start", `{"type":"message_start","message":{"id":"`, mw.id,
				`","content":[],"model":`, string(mw.e.answerModel(mw.r.seq.LoRA)), `,"stop_reason":null,"stop_sequence":null,"usage":`,
				string(mw.usage(nil, 0)), `}}`)
			if r.call != nil {
				b = event(b, "content_block_start", `{"type":"content_block_start","content_block":`,
					string(appendToolUse(nil, r.call, "{}")), `,"index":0}`)
			} else {
				b = event(b, "content_block_start", `{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}`)
			}
		}
		for j := from; j < to; j++ {
			if r.call == nil {
				b = event(b, "content_block_delta", `{"type":"content_block_delta","delta":{"type":"text_delta","text":"`,
					mw.e.words[r.words[j]].text, `"},"index":0}`)
			} else if text := r.call.piece(j, j+1); text != "" {
				b = event(b, "content_block_delta", `{"type":"content_block_delta","delta":{"type":"input_json_delta","partial_json":`,
					jsonText(text), `},"index":0}`)
			}
		}
		if done {
			b = event(b, "content_block_stop", `{"type":"content_block_stop","index":0}`)
			b = event(b, "message_delta", `{"type":"message_delta","delta":{"stop_reason":"`, mw.stopReason(),
				`"},"usage":`, string(mw.usage(nil, to)), `}`)
			b = event(b, "message_stop", `{"type":"message_stop"}`)
			b = append(b, "data: [DONE]\n\n"...)
		}
		return b
	})
}

// appendToolUse appends a tool call as the tool_use block vLLM converts it
// to: the chat call's id and name, and input.
func appendToolUse(b []byte, c *toolCall, input string) []byte {
	b = append(b, `{"type":"tool_use","id":"`...)
	b = append(b, c.id...)
	b = append(b, `","name":`...)
	b = append(b, jsonText(c.name)...)
	b = append(b, `,"input":`...)
	b = append(b, input...)
	return append(b, '}')
}
