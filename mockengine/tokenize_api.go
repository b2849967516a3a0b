package mockengine

import (
	"encoding/json"
	"net/http"
)

// tokenizeRequest is vLLM's POST /tokenize body: a completions prompt, or
// chat messages rendered with the chat template.
type tokenizeRequest struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            []apiMessage    `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
}

// serveTokenize answers vLLM's /tokenize: {"count", "max_model_len",
// "tokens"} with the ids the engine itself would compute.
func (e *Engine) serveTokenize(w http.ResponseWriter, r *http.Request) {
	var req tokenizeRequest
	err := e.decodeRequest(w, r, &req, &req.Model)
	if err != nil {
		e.fail(w, err)
		return
	}
	var ids []uint32
	switch {
	case req.Messages != nil:
		msgs, err := chatMessages(req.Messages)
		if err != nil {
			e.fail(w, err)
			return
		}
		gen := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt
		if ids, err = e.enc.TryEncodeChatTools(nil, msgs, chatTools(req.Tools), gen); err != nil {
			e.fail(w, invalid("messages", "chat template: %v", err))
			return
		}
	case len(req.Prompt) > 0 && req.Prompt[0] == '"':
		if ids, err = e.promptTokens(req.Prompt); err != nil {
			e.fail(w, err)
			return
		}
	default:
		e.fail(w, invalid("prompt", "give a prompt string or chat messages"))
		return
	}
	if ids == nil {
		ids = []uint32{}
	}
	e.tokenizeCalls.Add(1)
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"count": len(ids), "max_model_len": e.cfg.CacheBlocks * e.cfg.BlockSize, "tokens": ids})
}
