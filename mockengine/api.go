package mockengine

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/tokenize"
)

// DefaultMaxTokens is the output length when a request names none.
const DefaultMaxTokens = 16

// maxBody bounds a request body.
const maxBody = 64 << 20

// Handler returns the engine's HTTP routes.
func (e *Engine) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { e.serveCompletion(w, r, true) })
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { e.serveCompletion(w, r, false) })
	mux.HandleFunc("POST /v1/responses", e.serveResponses)
	mux.HandleFunc("GET /v1/responses/{id}", e.serveGetResponse)
	mux.HandleFunc("POST /v1/responses/{id}/cancel", e.serveCancelResponse)
	mux.HandleFunc("DELETE /v1/responses/{id}", e.serveDeleteResponse)
	mux.HandleFunc("POST /v1/messages", e.serveMessages)
	mux.HandleFunc("POST /v1/messages/count_tokens", e.serveCountTokens)
	mux.HandleFunc("GET /v1/models", e.serveModels)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"version":"kvmock"}`))
	})
	mux.HandleFunc("GET /metrics", e.serveMetrics)
	mux.HandleFunc("GET /debug/cache", e.serveDebugCache)
	mux.HandleFunc("POST /tokenize", e.serveTokenize)
	mux.HandleFunc("POST /v1/embeddings", e.serveEmbeddings)
	for _, path := range []string{"/score", "/v1/score"} {
		mux.HandleFunc("POST "+path, e.serveScore)
	}
	for _, path := range []string{"/rerank", "/v1/rerank", "/v2/rerank"} {
		mux.HandleFunc("POST "+path, e.serveRerank)
	}
	mux.HandleFunc("POST /reset_prefix_cache", e.serveResetPrefixCache)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "NotFoundError", "", "no route for "+r.Method+" "+r.URL.Path)
	})
	return mux
}

// minTokens is a request's min_tokens (0 when it names none).
func minTokens(m *int) int {
	if m == nil {
		return 0
	}
	return *m
}

// apiRequest holds the fields of a chat or completions request the engine
// understands; everything else is ignored, as vLLM ignores what it does not
// use.
type apiRequest struct {
	Model               string          `json:"model"`
	Messages            []apiMessage    `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	ToolChoice          json.RawMessage `json:"tool_choice"`
	Prompt              json.RawMessage `json:"prompt"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	IgnoreEOS           bool            `json:"ignore_eos"`
	MinTokens           *int            `json:"min_tokens"` // vLLM's: no end of sequence before it
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	CacheSalt string `json:"cache_salt"`
	N         *int   `json:"n"`
	// Temperature and TopP are only checked, as vLLM's SamplingParams
	// checks them: the simulated engine samples by its seed.
	Temperature *float64 `json:"temperature"`
	TopP        *float64 `json:"top_p"`
	// AddGenerationPrompt (default true) ends a chat prompt with the
	// assistant's turn opened; ContinueFinalMessage leaves the final
	// message (the assistant's) open instead, to be continued.
	AddGenerationPrompt  *bool `json:"add_generation_prompt"`
	ContinueFinalMessage bool  `json:"continue_final_message"`
	// KVTransfer is vLLM's kv_transfer_params (NixlConnector): a prefill
	// engine is asked to keep the prompt's KV for a decode engine
	// (do_remote_decode), a decode engine to pull it (do_remote_prefill).
	KVTransfer *struct {
		DoRemoteDecode  bool `json:"do_remote_decode"`
		DoRemotePrefill bool `json:"do_remote_prefill"`
	} `json:"kv_transfer_params"`
}

type apiMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	ToolCalls  json.RawMessage `json:"tool_calls"`
	ToolCallID *string         `json:"tool_call_id"`
	Name       *string         `json:"name"`
	// vLLM takes reasoning, else reasoning_content (a non-string is none)
	Reasoning        json.RawMessage `json:"reasoning"`
	ReasoningContent json.RawMessage `json:"reasoning_content"`
}

// chatMessages reads messages as the template renders them; kvproxy reads
// them the same way (proxy/request.go), so its prompts are the engine's.
func chatMessages(msgs []apiMessage) ([]tokenize.Message, error) {
	if len(msgs) == 0 {
		return nil, invalid("messages", "messages must be a non-empty array")
	}
	out := make([]tokenize.Message, len(msgs))
	for i, m := range msgs {
		if m.Role == "" {
			return nil, invalid(fmt.Sprintf("messages[%d].role", i), "role is required")
		}
		text, err := messageText(m.Content, i)
		if err != nil {
			return nil, err
		}
		out[i] = tokenize.Message{Role: m.Role, Content: text}
		if c := bytes.TrimSpace(m.ToolCalls); len(c) > 2 && c[0] == '[' && len(bytes.TrimSpace(c[1:len(c)-1])) > 0 {
			out[i].ToolCalls = string(m.ToolCalls)
		}
		if m.ToolCallID != nil {
			out[i].ToolCallID = *m.ToolCallID
		}
		if m.Name != nil {
			out[i].Name = *m.Name
		}
		json.Unmarshal(m.Reasoning, &out[i].Reasoning) // reasoning or else reasoning_content
		if out[i].Reasoning == "" {
			json.Unmarshal(m.ReasoningContent, &out[i].Reasoning)
		}
	}
	return out, nil
}

// chatTools is the request's tools as the template sees them: "" for none
// (null), an empty array as it is.
func chatTools(raw json.RawMessage) string {
	if t := bytes.TrimSpace(raw); len(t) > 0 && t[0] == '[' {
		return string(raw)
	}
	return ""
}

// chatToolChoice reads what a chat request's tool_choice forces:
// "required", or {"type":"function","function":{"name":...}}.
func chatToolChoice(raw json.RawMessage) toolChoice {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return toolChoice{forced: s == "required"}
	}
	var named struct {
		Type     string `json:"type"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if json.Unmarshal(raw, &named) == nil && named.Type == "function" && named.Function.Name != "" {
		return toolChoice{forced: true, name: named.Function.Name}
	}
	return toolChoice{}
}

// chatFunctionTools lists a chat request's function tools.
func chatFunctionTools(raw json.RawMessage) []toolDef {
	var tools []struct {
		Type     string `json:"type"`
		Function *struct {
			Name       string          `json:"name"`
			Parameters json.RawMessage `json:"parameters"`
		} `json:"function"`
	}
	json.Unmarshal(raw, &tools)
	var defs []toolDef
	for _, t := range tools {
		if t.Type == "function" && t.Function != nil && t.Function.Name != "" {
			defs = append(defs, toolDef{name: t.Function.Name, schema: t.Function.Parameters})
		}
	}
	return defs
}

// badRequest is a client error naming the offending field.
type badRequest struct {
	status int
	typ    string
	param  string
	msg    string
}

func (b *badRequest) Error() string { return b.msg }

func invalid(param, format string, args ...any) *badRequest {
	return &badRequest{status: http.StatusBadRequest, typ: "invalid_request_error", param: param, msg: fmt.Sprintf(format, args...)}
}

// tooLong is vLLM's refusal of a prompt that, with its max_tokens, does not
// fit max_model_len (here the KV cache, which /v1/models reports as it), in
// vLLM's words: clients read the numbers from them.
func tooLong(param string, prompt, maxTokens, maxModelLen int) *badRequest {
	if prompt >= maxModelLen {
		return invalid(param, "This model's maximum context length is %d tokens. However, your request has %d input tokens. Please reduce the length of the input messages.",
			maxModelLen, prompt)
	}
	return invalid(param, "'max_tokens' or 'max_completion_tokens' is too large: %d. This model's maximum context length is %d tokens and your request has %d input tokens (%d > %d - %d).",
		maxTokens, maxModelLen, prompt, maxTokens, maxModelLen, prompt)
}

// messageText joins a message's content: a string, or an array of parts of
// which the text ones count; null is empty.
func messageText(raw json.RawMessage, i int) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", invalid(fmt.Sprintf("messages[%d].content", i), "content is not a valid string")
		}
		return s, nil
	}
	var parts []json.RawMessage
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", invalid(fmt.Sprintf("messages[%d].content", i), "content must be a string or an array of content parts")
	}
	// Text parts are joined with newlines, as vLLM joins them; what is not
	// text (an image) is a digest, as kvproxy routes it.
	var b []byte
	n := 0
	for j, raw := range parts {
		var p struct {
			Type                    string `json:"type"`
			Text, Refusal, Thinking json.RawMessage
		}
		if raw[0] == '"' { // a plain string is a text part
			p.Type, p.Text = "text", raw
		} else if err := json.Unmarshal(raw, &p); err != nil || p.Type == "" {
			return "", invalid(fmt.Sprintf("messages[%d].content[%d]", i, j), "content part must be an object with a type, or a string")
		}
		var text json.RawMessage
		switch p.Type { // what vLLM reads as text, and where
		case "text", "input_text", "output_text":
			text = p.Text
		case "refusal":
			text = p.Refusal
		case "thinking":
			text = p.Thinking
		}
		var s string
		if text != nil {
			if string(text) == "null" {
				continue // vLLM skips a text part without text
			}
			if json.Unmarshal(text, &s) != nil {
				return "", invalid(fmt.Sprintf("messages[%d].content[%d]", i, j), "a text part's text must be a string")
			}
		} else if _, isText := map[string]bool{"text": true, "input_text": true, "output_text": true, "refusal": true, "thinking": true}[p.Type]; isText {
			continue
		}
		if n++; n > 1 {
			b = append(b, '\n')
		}
		if text != nil {
			b = append(b, s...)
		} else {
			b = tokenize.AppendMediaStandIn(b, tokenize.MediaOf(raw))
		}
	}
	return string(b), nil
}

// promptTokens reads a completions prompt: a string, an array of token ids,
// or a one-element array of either.
func (e *Engine) promptTokens(raw json.RawMessage) ([]uint32, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, invalid("prompt", "prompt is required")
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, invalid("prompt", "prompt is not a valid string")
		}
		return e.enc.EncodeText(nil, s), nil
	case '[':
		var ids []uint32
		if err := json.Unmarshal(raw, &ids); err == nil {
			return ids, nil
		}
		var batch []json.RawMessage
		if err := json.Unmarshal(raw, &batch); err != nil {
			return nil, invalid("prompt", "prompt must be a string, an array of token ids, or a one-element array of either")
		}
		if len(batch) != 1 {
			return nil, invalid("prompt", "only one prompt per request is supported, got %d", len(batch))
		}
		if t := bytes.TrimSpace(batch[0]); len(t) > 0 && (t[0] == '"' || t[0] == '[') {
			return e.promptTokens(t)
		}
	}
	return nil, invalid("prompt", "prompt must be a string, an array of token ids, or a one-element array of either")
}

// parse validates a request and tokenizes its prompt.
func (e *Engine) parse(w http.ResponseWriter, r *http.Request, chat bool) (*apiRequest, []uint32, int, error) {
	body, err := readBody(w, r)
	if err != nil {
		return nil, nil, 0, err
	}
	var req apiRequest
	if err := unmarshalExact(body, &req); err != nil {
		if fe := fieldError(err); fe != nil {
			return nil, nil, 0, fe
		}
		return nil, nil, 0, invalid("", "request body is not valid JSON: %v", err)
	}
	if err := e.checkModel(req.Model); err != nil {
		return nil, nil, 0, err
	}
	if err := req.checkSampling(); err != nil {
		return nil, nil, 0, err
	}
	maxTokens := DefaultMaxTokens
	if req.MaxCompletionTokens != nil {
		maxTokens = *req.MaxCompletionTokens
		if maxTokens < 1 {
			return nil, nil, 0, invalid("max_completion_tokens", "max_completion_tokens must be at least 1, got %d", maxTokens)
		}
	} else if req.MaxTokens != nil {
		maxTokens = *req.MaxTokens
		if maxTokens < 1 {
			return nil, nil, 0, invalid("max_tokens", "max_tokens must be at least 1, got %d", maxTokens)
		}
	}
	if m := req.MinTokens; m != nil {
		// vLLM's SamplingParams checks, in its words. Without a max_tokens
		// vLLM's default is 16 for completions, and for chat the context
		// left, which a min_tokens may exceed 16 by: the answer is then
		// made as long as it.
		switch {
		case *m < 0:
			return nil, nil, 0, invalid("min_tokens", "min_tokens must be greater than or equal to 0, got %d.", *m)
		case *m > maxTokens && (!chat || req.MaxTokens != nil || req.MaxCompletionTokens != nil):
			return nil, nil, 0, invalid("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.", maxTokens, *m)
		case *m > maxTokens:
			maxTokens = *m
		}
	}
	var prompt []uint32
	if chat {
		msgs, err := chatMessages(req.Messages)
		if err != nil {
			return nil, nil, 0, err
		}
		if prompt, err = e.chatPrompt(&req, msgs); err != nil {
			return nil, nil, 0, err
		}
	} else {
		if prompt, err = e.promptTokens(req.Prompt); err != nil {
			return nil, nil, 0, err
		}
	}
	if len(prompt) == 0 {
		param := "prompt"
		if chat {
			param = "messages"
		}
		return nil, nil, 0, invalid(param, "the prompt is empty")
	}
	return &req, prompt, maxTokens, nil
}

// checkSampling refuses what vLLM's SamplingParams refuses, in its words.
func (req *apiRequest) checkSampling() error {
	switch {
	case req.N != nil && *req.N < 1:
		return invalid("n", "n must be at least 1, got %d.", *req.N)
	case req.N != nil && *req.N != 1:
		return invalid("n", "the simulated engine generates one choice per request (n = 1), got n = %d", *req.N)
	case req.Temperature != nil && *req.Temperature < 0:
		return invalid("temperature", "temperature must be non-negative, got %v.", *req.Temperature)
	case req.TopP != nil && !(*req.TopP > 0 && *req.TopP <= 1):
		return invalid("top_p", "top_p must be in (0, 1], got %v.", *req.TopP)
	}
	return nil
}

// chatPrompt renders a chat request's messages as the model's prompt.
func (e *Engine) chatPrompt(req *apiRequest, msgs []tokenize.Message) ([]uint32, error) {
	gen := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt
	if !req.ContinueFinalMessage {
		ids, err := e.enc.TryEncodeChatTools(nil, msgs, chatTools(req.Tools), gen)
		if err != nil {
			// vLLM answers 400 when the chat template raises.
			return nil, invalid("messages", "chat template: %v", err)
		}
		return ids, nil
	}
	if gen {
		return nil, invalid("continue_final_message", "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	last := msgs[len(msgs)-1]
	if last.Role != "assistant" || last.ToolCalls != "" {
		return nil, invalid("messages", "continue_final_message continues the final message, which must be the assistant's text")
	}
	// The turns before it, the assistant's opened, then its text with the
	// turn left open: what the template's continuation renders.
	ids, err := e.enc.TryEncodeChatTools(nil, msgs[:len(msgs)-1], chatTools(req.Tools), true)
	if err != nil {
		return nil, invalid("messages", "chat template: %v", err)
	}
	return e.enc.EncodeText(ids, last.Content), nil
}

// checkModel is vLLM's 404 for a request naming a model the engine does
// not serve ("" names none).
func (e *Engine) checkModel(model string) error {
	if model == "" || model == e.cfg.Model || slices.Contains(e.cfg.LoRAModules, model) {
		return nil
	}
	return &badRequest{status: http.StatusNotFound, typ: "NotFoundError", param: "model",
		msg: fmt.Sprintf("The model `%s` does not exist.", model)}
}

// adapterOf is model when it names one of the engine's LoRA adapters.
func (e *Engine) adapterOf(model string) string {
	if model != e.cfg.Model && slices.Contains(e.cfg.LoRAModules, model) {
		return model
	}
	return ""
}

// answerModel is the model an answer names, as a JSON string: the adapter
// the request ran with (vLLM names it), else the served model.
func (e *Engine) answerModel(lora string) []byte {
	if lora == "" {
		return e.modelJSON
	}
	b, _ := json.Marshal(lora)
	return b
}

// decodeRequest reads a request body into v (a 400 when it is not JSON)
// and checks the model it names (*model, a field of v).
func (e *Engine) decodeRequest(w http.ResponseWriter, r *http.Request, v any, model *string) error {
	body, err := readBody(w, r)
	if err != nil {
		return err
	}
	if err := unmarshalExact(body, v); err != nil {
		if fe := fieldError(err); fe != nil {
			return fe
		}
		return invalid("", "request body is not valid JSON: %v", err)
	}
	return e.checkModel(*model)
}

func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, &badRequest{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error", msg: "request body too large"}
		}
		return nil, invalid("", "reading request body: %v", err)
	}
	return b, nil
}

func (e *Engine) serveCompletion(w http.ResponseWriter, hr *http.Request, chat bool) {
	e.enter()
	defer e.leave()
	req, prompt, maxTokens, err := e.parse(w, hr, chat)
	if err != nil {
		e.fail(w, err)
		return
	}
	var force *forcedCall
	if chat {
		if force, err = forcedTool(chatToolChoice(req.ToolChoice), chatFunctionTools(req.Tools)); err != nil {
			e.fail(w, err)
			return
		}
		if force != nil && req.MaxTokens == nil && req.MaxCompletionTokens == nil {
			maxTokens = e.callMaxTokens(len(prompt))
		}
	}
	if capacity := e.cfg.CacheBlocks * e.cfg.BlockSize; maxTokens > capacity-len(prompt) { // not len+max: a max_tokens near 2^63 overflows
		// vLLM refuses what exceeds max_model_len; here the cache is the limit.
		e.fail(w, tooLong("max_tokens", len(prompt), maxTokens, capacity))
		return
	}
	r := e.newAnswer(prompt, minTokens(req.MinTokens), maxTokens, req.IgnoreEOS, req.CacheSalt, force)
	r.seq.LoRA = e.adapterOf(req.Model)
	r.seq.RemoteKV = req.KVTransfer != nil && req.KVTransfer.DoRemotePrefill
	if err := e.submit(r); err != nil {
		e.fail(w, err)
		return
	}
	rs := &responder{e: e, model: e.answerModel(r.seq.LoRA), chat: chat, created: time.Now().Unix(), promptTokens: len(prompt), maxTokens: maxTokens}
	prefix := "cmpl"
	if chat {
		prefix = "chatcmpl"
	}
	rs.id = fmt.Sprintf("%s-%s-%d", prefix, e.idPrefix, r.seq.ID)
	if rid := hr.Header.Get("X-Request-Id"); rid != "" {
		rs.id = prefix + "-" + rid // as vLLM names its answers
	}
	if req.KVTransfer != nil && req.KVTransfer.DoRemoteDecode {
		// Where a decode engine finds the prompt's KV, as vLLM's
		// NixlConnector tells it (the blocks are this engine's to name).
		rs.kvTransfer = fmt.Appendf(nil, `{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":%q,"remote_block_ids":[%d],"remote_host":%q,"remote_port":%d,"remote_request_id":%q,"tp_size":1}`,
			e.idPrefix, r.seq.ID, hostOf(hr.Host), 5600, hr.Header.Get("X-Request-Id"))
	}
	ctx := hr.Context()
	if req.Stream {
		includeUsage := req.StreamOptions != nil && req.StreamOptions.IncludeUsage
		e.settle(r, rs.stream(ctx, w, r, includeUsage))
	} else {
		e.settle(r, rs.whole(ctx, w, r))
	}
}

// fail answers with an OpenAI error object.
func (e *Engine) fail(w http.ResponseWriter, err error) {
	e.rejected.Add(1)
	var b *badRequest
	if errors.As(err, &b) {
		writeError(w, b.status, b.typ, b.param, b.msg)
		return
	}
	writeError(w, http.StatusInternalServerError, "internal_error", "", err.Error())
}

func writeError(w http.ResponseWriter, status int, typ, param, msg string) {
	var body struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    int     `json:"code"`
		} `json:"error"`
	}
	body.Error.Message, body.Error.Type, body.Error.Code = msg, typ, status
	if param != "" {
		body.Error.Param = &param
	}
	b, _ := json.Marshal(&body)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(b)
}

func (e *Engine) serveModels(w http.ResponseWriter, _ *http.Request) {
	now := time.Now().Unix()
	b := fmt.Appendf(nil, `{"object":"list","data":[{"id":%s,"object":"model","created":%d,"owned_by":"kvmock","root":%s,"parent":null,"max_model_len":%d}`,
		e.modelJSON, now, e.modelJSON, e.cfg.CacheBlocks*e.cfg.BlockSize)
	for _, a := range e.cfg.LoRAModules { // as vLLM lists --lora-modules
		name, _ := json.Marshal(a)
		b = fmt.Appendf(b, `,{"id":%s,"object":"model","created":%d,"owned_by":"kvmock","root":%s,"parent":%s,"max_model_len":%d}`,
			name, now, name, e.modelJSON, e.cfg.CacheBlocks*e.cfg.BlockSize)
	}
	b = append(b, "]}"...)
	w.Header().Set("Content-Type", "application/json")
	w.Write(b)
}

// serveMetrics writes vLLM's metric names in Prometheus text format.
// Counters carry the _total suffix, as vLLM's Python client exposes them.
func (e *Engine) serveMetrics(w http.ResponseWriter, _ *http.Request) {
	st := e.Stats()
	lbl := `{model_name=` + string(e.modelJSON) + `}`
	var b []byte
	metric := func(name, typ, help, value string) {
		b = fmt.Appendf(b, "# HELP %s %s\n# TYPE %s %s\n%s%s %s\n", name, help, name, typ, name, lbl, value)
	}
	f := func(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }
	u := func(v uint64) string { return strconv.FormatUint(v, 10) }
	metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", strconv.Itoa(st.Running))
	metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", strconv.Itoa(st.Waiting))
	metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", f(st.KVUsage))
	metric("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage (older name). 1 means 100 percent usage.", f(st.KVUsage))
	metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", u(st.PrefixQueries))
	metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", u(st.PrefixHits))
	metric("vllm:external_prefix_cache_hits_total", "counter", "Prefix cache hits from the host tier, in terms of number of loaded tokens.", u(st.HostHits))
	b = fmt.Appendf(b, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"%d\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_cpu_blocks=\"%d\",num_gpu_blocks=\"%d\"} 1.0\n",
		e.cfg.BlockSize, e.cfg.HostCacheBlocks, e.cfg.CacheBlocks)
	metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions from the engine.", u(st.Preemptions))
	metric("kvmock:tokenize_requests_total", "counter", "POST /tokenize requests answered.", u(st.TokenizeCalls))
	metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", u(st.PromptTokens))
	metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", u(st.GenerationTokens))
	metric("vllm:request_success_total", "counter", "Count of successfully processed requests.", u(st.Finished))
	if len(e.cfg.LoRAModules) > 0 {
		// As vLLM with LoRA on: one series whose value is the time it was
		// set (vLLM keeps the older label sets too; the latest counts).
		b = fmt.Appendf(b, "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n"+
			"vllm:lora_requests_info{max_lora=\"%d\",running_lora_adapters=%q,waiting_lora_adapters=%q} %s\n",
			e.cfg.maxLoRAs(), strings.Join(st.RunningLoRAs, ","), strings.Join(st.WaitingLoRAs, ","), f(float64(time.Now().UnixNano())/1e9))
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.Write(b)
}

// DebugCache is the /debug/cache answer: every block findable in the
// engine's prefix cache, device tier first (medium GPU), then host (CPU).
// Hash is in the router's scheme, kv.HashBlocks(tokens, BlockSize, 0)
// chained from the start of the sequence, with no namespace even when the
// request had a cache_salt; EngineHash and Parent are what the engine's
// events carry. With ?tokens=1 each block also lists its token ids, so a
// consumer can rehash under another namespace.
type DebugCache struct {
	ID        string       `json:"id"`
	Model     string       `json:"model"`
	BlockSize int          `json:"block_size"`
	Blocks    []DebugBlock `json:"blocks"`
}

// DebugBlock is one resident block.
type DebugBlock struct {
	Hash       uint64   `json:"hash"`
	EngineHash uint64   `json:"engine_hash"`
	Parent     *uint64  `json:"parent,omitempty"` // absent for a sequence's first block
	Medium     string   `json:"medium"`
	Tokens     []uint32 `json:"tokens,omitempty"`
}

func (e *Engine) serveDebugCache(w http.ResponseWriter, r *http.Request) {
	withTokens := r.URL.Query().Get("tokens") == "1"
	e.mu.Lock()
	res := e.model.AppendResident(nil)
	var toks []uint32
	if withTokens {
		toks = e.model.AppendResidentTokens(nil)
	}
	e.mu.Unlock()
	bs := e.cfg.BlockSize
	out := DebugCache{ID: e.cfg.ID, Model: e.cfg.Model, BlockSize: bs, Blocks: make([]DebugBlock, len(res))}
	parents := make([]uint64, len(res))
	for i, rb := range res {
		b := DebugBlock{Hash: uint64(rb.Hash), EngineHash: uint64(rb.EngineHash), Medium: kv.MediumOf(rb.Tier)}
		if rb.HasParent {
			parents[i] = uint64(rb.Parent)
			b.Parent = &parents[i]
		}
		if withTokens {
			b.Tokens = toks[i*bs : (i+1)*bs]
		}
		out.Blocks[i] = b
	}
	b, _ := json.Marshal(&out)
	w.Header().Set("Content-Type", "application/json")
	w.Write(b)
}

// serveResetPrefixCache empties the prefix cache, as vLLM's endpoint of the
// same name does; it answers 409 while requests hold blocks.
func (e *Engine) serveResetPrefixCache(w http.ResponseWriter, _ *http.Request) {
	e.mu.Lock()
	ok := e.model.ResetPrefixCache()
	e.mu.Unlock()
	select { // let the scheduler publish the event
	case e.wake <- struct{}{}:
	default:
	}
	if !ok {
		writeError(w, http.StatusConflict, "conflict_error", "", "requests are running; the prefix cache was not reset")
		return
	}
	w.WriteHeader(http.StatusOK)
}

// hostOf is the host of a Host header (host:port).
func hostOf(hostport string) string {
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		return h
	}
	return hostport
}
