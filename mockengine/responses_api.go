package mockengine

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvproxy/kvproxy/tokenize"
)

// The OpenAI Responses API as vLLM serves it
// (vllm/entrypoints/openai/responses/{api_router,serving}.py), on the
// same scheduler, prefix cache and timing as chat completions.

// responsesCall is a validated Responses request, ready to run.
type responsesCall struct {
	req       responsesRequest
	messages  []tokenize.Message
	tools     json.RawMessage // as echoed in the response object
	prompt    []uint32
	maxTokens int
	store     bool
	force     *forcedCall // the call tool_choice forces, if any
}

// parseResponses validates a Responses request and renders its prompt.
func (e *Engine) parseResponses(w http.ResponseWriter, r *http.Request) (*responsesCall, error) {
	c := &responsesCall{maxTokens: DefaultMaxTokens, store: true}
	req := &c.req
	if err := e.decodeRequest(w, r, req, &req.Model); err != nil {
		return nil, err
	}
	if req.Background {
		return nil, invalid("background", "the simulated engine does not run background responses")
	}
	if req.MaxOutputTokens != nil {
		if c.maxTokens = *req.MaxOutputTokens; c.maxTokens < 1 {
			return nil, invalid("max_output_tokens", "max_output_tokens must be at least 1, got %d", c.maxTokens)
		}
	}
	if req.Store != nil {
		c.store = *req.Store
	}
	var prev *storedResponse
	if req.PreviousResponseID != nil {
		if prev = e.responses.get(*req.PreviousResponseID); prev == nil {
			return nil, responseNotFound(*req.PreviousResponseID)
		}
	}
	var err error
	if c.messages, err = responsesMessages(req, prev); err != nil {
		return nil, err
	}
	tools, template, err := responsesTools(req.Tools, req.ToolChoice)
	if err != nil {
		return nil, err
	}
	c.tools = tools
	if c.force, err = forcedTool(responsesToolChoice(req.ToolChoice), responsesFunctionTools(req.Tools)); err != nil {
		return nil, err
	}
	if c.prompt, err = e.enc.TryEncodeChatTools(nil, c.messages, template, true); err != nil {
		return nil, invalid("input", "chat template: %v", err)
	}
	if len(c.prompt) == 0 {
		return nil, invalid("input", "the prompt is empty")
	}
	if c.force != nil && req.MaxOutputTokens == nil {
		c.maxTokens = e.callMaxTokens(len(c.prompt))
	}
	if capacity := e.cfg.CacheBlocks * e.cfg.BlockSize; c.maxTokens > capacity-len(c.prompt) {
		param := "max_output_tokens"
		if len(c.prompt) >= capacity {
			param = "input"
		}
		return nil, tooLong(param, len(c.prompt), c.maxTokens, capacity)
	}
	return c, nil
}

// responseNotFound is vLLM's _make_not_found_error.
func responseNotFound(id string) *badRequest {
	return &badRequest{status: http.StatusNotFound, typ: "invalid_request_error", param: "response_id",
		msg: fmt.Sprintf("Response with id '%s' not found.", id)}
}

func (e *Engine) serveResponses(w http.ResponseWriter, hr *http.Request) {
	e.enter()
	defer e.leave()
	c, err := e.parseResponses(w, hr)
	if err != nil {
		e.fail(w, err)
		return
	}
	r := e.newAnswer(c.prompt, 0, c.maxTokens, c.req.IgnoreEOS, c.req.CacheSalt, c.force)
	r.seq.LoRA = e.adapterOf(c.req.Model)
	if err := e.submit(r); err != nil {
		e.fail(w, err)
		return
	}
	rw := &responsesWriter{e: e, c: c, r: r, id: "resp_" + randomHex(), itemID: "msg_" + randomHex(), created: time.Now().Unix()}
	if r.call != nil {
		rw.itemID = "fc_" + randomHex()
	}
	if c.req.Stream {
		e.settle(r, rw.stream(hr.Context(), w))
	} else {
		e.settle(r, rw.whole(hr.Context(), w))
	}
}

// randomHex is 32 random hex digits, as vLLM's random_uuid.
func randomHex() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// responseObject is vLLM's ResponsesResponse, members in its order.
type responseObject struct {
	ID                 string             `json:"id"`
	CreatedAt          int64              `json:"created_at"`
	IncompleteDetails  *incompleteDetails `json:"incomplete_details"`
	Instructions       *string            `json:"instructions"`
	Metadata           json.RawMessage    `json:"metadata"`
	Model              json.RawMessage    `json:"model"`
	Object             string             `json:"object"`
	Output             []any              `json:"output"`
	ParallelToolCalls  bool               `json:"parallel_tool_calls"`
	Temperature        float64            `json:"temperature"`
	ToolChoice         json.RawMessage    `json:"tool_choice"`
	Tools              json.RawMessage    `json:"tools"`
	TopP               float64            `json:"top_p"`
	Background         bool               `json:"background"`
	MaxOutputTokens    int                `json:"max_output_tokens"`
	MaxToolCalls       *int               `json:"max_tool_calls"`
	PreviousResponseID *string            `json:"previous_response_id"`
	Prompt             json.RawMessage    `json:"prompt"`
	Reasoning          json.RawMessage    `json:"reasoning"`
	ServiceTier        string             `json:"service_tier"`
	Status             string             `json:"status"`
	Text               json.RawMessage    `json:"text"`
	TopLogprobs        *int               `json:"top_logprobs"`
	Truncation         string             `json:"truncation"`
	Usage              *responseUsage     `json:"usage"`
	User               *string            `json:"user"`
}

type incompleteDetails struct {
	Reason string `json:"reason"`
}

// functionCallItem is an output item of type "function_call", members in
// the order of OpenAI's ResponseFunctionToolCall.
type functionCallItem struct {
	Arguments string `json:"arguments"`
	CallID    string `json:"call_id"`
	Name      string `json:"name"`
	Type      string `json:"type"`
	ID        string `json:"id"`
	Status    string `json:"status"`
}

// outputMessage is an output item of type "message".
type outputMessage struct {
	ID      string       `json:"id"`
	Content []outputText `json:"content"`
	Role    string       `json:"role"`
	Status  string       `json:"status"`
	Type    string       `json:"type"`
}

type outputText struct {
	Annotations []struct{}      `json:"annotations"`
	Text        string          `json:"text"`
	Type        string          `json:"type"`
	Logprobs    json.RawMessage `json:"logprobs"`
}

type responseUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

// responsesWriter answers one Responses request.
type responsesWriter struct {
	e       *Engine
	c       *responsesCall
	r       *request
	id      string
	itemID  string
	created int64
	seq     int // the next event's sequence_number
}

// object is the response object with the given status, output and usage.
func (rw *responsesWriter) object(status string, output []any, usage *responseUsage) *responseObject {
	req := &rw.c.req
	o := &responseObject{
		ID: rw.id, CreatedAt: rw.created, Instructions: req.Instructions, Model: rw.e.answerModel(rw.r.seq.LoRA),
		Object: "response", Output: output, ParallelToolCalls: true, Temperature: 1,
		ToolChoice: json.RawMessage(`"auto"`), Tools: rw.c.tools, TopP: 1, MaxOutputTokens: rw.c.maxTokens,
		PreviousResponseID: req.PreviousResponseID, ServiceTier: "auto", Status: status,
		Truncation: "disabled", Usage: usage,
	}
	if output == nil {
		o.Output = []any{}
	}
	if status == "incomplete" {
		o.IncompleteDetails = &incompleteDetails{Reason: "max_output_tokens"}
	}
	if len(req.ToolChoice) > 0 && string(req.ToolChoice) != "null" {
		o.ToolChoice = req.ToolChoice
	}
	if req.Temperature != nil {
		o.Temperature = *req.Temperature
	}
	if req.TopP != nil {
		o.TopP = *req.TopP
	}
	return o
}

// final is the finished response object and its text. It is stored,
// when the request asks for that, before the client can see it, so a
// follow-up never misses it.
func (rw *responsesWriter) final() (object []byte, text string) {
	r := rw.r
	n := len(r.seq.Output)
	status := "completed"
	if n >= rw.c.maxTokens { // vLLM: finish_reason "length"
		status = "incomplete"
	}
	u := &responseUsage{InputTokens: len(r.seq.Prompt), OutputTokens: n, TotalTokens: len(r.seq.Prompt) + n}
	u.InputTokensDetails.CachedTokens = int(r.cached.Load())
	var output any
	var texts []string // a call is no text a follow-up replays, as in vLLM
	if r.call != nil {
		output = rw.callItem("completed")
	} else {
		var sb strings.Builder
		for _, k := range r.words {
			sb.WriteString(rw.e.words[k].text)
		}
		text = sb.String()
		output, texts = rw.message("completed", text), []string{text}
	}
	object, _ = json.Marshal(rw.object(status, []any{output}, u))
	if rw.c.store {
		rw.e.responses.put(&storedResponse{id: rw.id, messages: rw.c.messages, outputTexts: texts, object: object})
	}
	return object, text
}

// callItem is the function_call output item of a call answer, with the
// arguments it has when done ("" while in progress, as vLLM adds it).
func (rw *responsesWriter) callItem(status string) functionCallItem {
	c := rw.r.call
	item := functionCallItem{CallID: "call_" + c.id[len("chatcmpl-tool-"):], Name: c.name, Type: "function_call", ID: rw.itemID, Status: status}
	if status == "completed" {
		item.Arguments = c.arguments
	}
	return item
}

func (rw *responsesWriter) message(status, text string) outputMessage {
	return outputMessage{ID: rw.itemID, Role: "assistant", Status: status, Type: "message",
		Content: []outputText{{Annotations: []struct{}{}, Text: text, Type: "output_text", Logprobs: json.RawMessage("null")}}}
}

// whole waits for the last token and sends the response object. It
// reports false if the client went away first.
func (rw *responsesWriter) whole(ctx context.Context, w http.ResponseWriter) bool {
	if !rw.r.waitDone(ctx) {
		return false
	}
	rw.e.genToks.Add(uint64(len(rw.r.seq.Output)))
	b, _ := rw.final()
	w.Header().Set("Content-Type", "application/json")
	_, err := w.Write(b)
	return err == nil
}

// event appends one SSE event: its type line and its data, the event's
// members (a JSON object without its braces) followed by sequence_number
// and type, the order in which pydantic dumps OpenAI's event types.
func (rw *responsesWriter) event(b []byte, typ string, members string) []byte {
	b = append(b, "event: "...)
	b = append(b, typ...)
	b = append(b, "\ndata: {"...)
	b = append(b, members...)
	b = append(b, `,"sequence_number":`...)
	b = strconv.AppendInt(b, int64(rw.seq), 10)
	b = append(b, `,"type":"`...)
	b = append(b, typ...)
	b = append(b, "\"}\n\n"...)
	rw.seq++
	return b
}

func jsonText(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// stream sends vLLM's event sequence: response.created and
// response.in_progress at once, the output item and content part with the
// first token, one response.output_text.delta per token as the engine
// produces them, then the done events and response.completed. There is no
// [DONE]. It reports false if the client went away first.
func (rw *responsesWriter) stream(ctx context.Context, w http.ResponseWriter) bool {
	sse := startSSE(w)
	initial := `"response":` + jsonText(rw.object("in_progress", nil, nil))
	buf := rw.event(nil, "response.created", initial)
	buf = rw.event(buf, "response.in_progress", initial)
	if !sse.send(buf) {
		return false
	}
	if rw.r.call != nil {
		return rw.e.streamTokens(ctx, sse, rw.r, rw.callEvents)
	}
	itemID := `"item_id":"` + rw.itemID + `"`
	return rw.e.streamTokens(ctx, sse, rw.r, func(b []byte, from, to int, done bool) []byte {
		if from == 0 && to > 0 {
			b = rw.event(b, "response.output_item.added", `"item":`+jsonText(outputMessage{
				ID: rw.itemID, Content: []outputText{}, Role: "assistant", Status: "in_progress", Type: "message"})+`,"output_index":0`)
			b = rw.event(b, "response.content_part.added", `"content_index":0,`+itemID+
				`,"output_index":0,"part":{"annotations":[],"text":"","type":"output_text","logprobs":[]}`)
		}
		for j := from; j < to; j++ {
			b = rw.event(b, "response.output_text.delta", `"content_index":0,"delta":"`+
				rw.e.words[rw.r.words[j]].text+`",`+itemID+`,"logprobs":[],"output_index":0`)
		}
		if done {
			object, text := rw.final()
			msg := rw.message("completed", text)
			b = rw.event(b, "response.output_text.done", `"content_index":0,`+itemID+
				`,"logprobs":[],"output_index":0,"text":`+jsonText(text))
			b = rw.event(b, "response.content_part.done", `"content_index":0,`+itemID+
				`,"output_index":0,"part":`+jsonText(msg.Content[0]))
			b = rw.event(b, "response.output_item.done", `"item":`+jsonText(msg)+`,"output_index":0`)
			b = rw.event(b, "response.completed", `"response":`+string(object))
		}
		return b
	})
}

// serveGetResponse answers GET /v1/responses/{id} with the stored object.
func (e *Engine) serveGetResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	s := e.responses.get(id)
	if s == nil {
		e.fail(w, responseNotFound(id))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write(s.object)
}

// serveCancelResponse answers POST /v1/responses/{id}/cancel as vLLM does
// for a response that is not running in the background, which is every
// response here: a 400.
func (e *Engine) serveCancelResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if e.responses.get(id) == nil {
		e.fail(w, responseNotFound(id))
		return
	}
	e.fail(w, invalid("response_id", "Cannot cancel a synchronous response."))
}

// serveDeleteResponse answers DELETE /v1/responses/{id} as OpenAI does
// (vLLM has no such route).
func (e *Engine) serveDeleteResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !e.responses.remove(id) {
		e.fail(w, responseNotFound(id))
		return
	}
	b, _ := json.Marshal(map[string]any{"id": id, "object": "response.deleted", "deleted": true})
	w.Header().Set("Content-Type", "application/json")
	w.Write(b)
}

// callEvents appends the events of a call answer's tokens [from, to), as
// vLLM streams a function call: the item added with the first token, an
// arguments delta for each token that adds text, then the arguments done,
// the item done and response.completed.
func (rw *responsesWriter) callEvents(b []byte, from, to int, done bool) []byte {
	c := rw.r.call
	itemID := `"item_id":"` + rw.itemID + `"`
	if from == 0 && to > 0 {
		b = rw.event(b, "response.output_item.added", `"item":`+jsonText(rw.callItem("in_progress"))+`,"output_index":0`)
	}
	for j := from; j < to; j++ {
		if text := c.piece(j, j+1); text != "" {
			b = rw.event(b, "response.function_call_arguments.delta", `"delta":`+jsonText(text)+`,`+itemID+`,"output_index":0`)
		}
	}
	if done {
		object, _ := rw.final()
		b = rw.event(b, "response.function_call_arguments.done", `"arguments":`+jsonText(c.arguments)+`,`+itemID+
			`,"name":`+jsonText(c.name)+`,"output_index":0`)
		b = rw.event(b, "response.output_item.done", `"item":`+jsonText(rw.callItem("completed"))+`,"output_index":0`)
		b = rw.event(b, "response.completed", `"response":`+string(object))
	}
	return b
}
