package proxy

import (
	"bytes"
	"fmt"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/router"
)

// passthroughPaths are engine endpoints whose requests carry no
// conversation to route on: embeddings, scores, tokenizing. kvproxy reads
// only their model (which picks the engines, and is rewritten to the
// engine's name), strips nvext and cache_salt, and forwards the rest
// untouched to the model's engine with the lowest load; the answer comes
// back as the engine gave it (errors in OpenAI's shape). The value is the
// prompt work the request is counted as while it runs, in tokens per byte
// of body: the router has no tokens to count, and tokenizing costs an
// engine no prefill.
var passthroughPaths = map[string]float64{
	"/v1/embeddings": 0.25, // OpenAI's and every engine's
	"/v1/score":      0.25, // vLLM's cross-encoder and embedding scoring
	"/score":         0.25,
	"/v1/rerank":     0.25, // vLLM (Jina and Cohere shapes)
	"/rerank":        0.25,
	"/v2/rerank":     0.25,
	"/pooling":       0.25, // vLLM
	"/classify":      0.25,
	"/tokenize":      0, // vLLM, SGLang
	"/detokenize":    0,
}

// handlePassthrough proxies a request to one of passthroughPaths.
func (s *Server) handlePassthrough(ctx *fasthttp.RequestCtx, st *state, path string) {
	in, ok := s.admit(ctx, st)
	if !ok {
		return
	}
	sc := s.getScratch()
	defer s.putScratch(sc)
	req := &sc.req
	if pe := req.parseModel(in.body); pe != nil {
		badRequest(ctx, pe.param, pe.msg)
		s.logRejected(in.rid, "", fasthttp.StatusBadRequest, in.start, pe.msg)
		return
	}
	p := st.models[req.model]
	if p == nil {
		writeError(ctx, fasthttp.StatusNotFound, fmt.Sprintf("the model %q does not exist", req.model), "invalid_request_error", "model", "model_not_found")
		s.logRejected(in.rid, req.model, fasthttp.StatusNotFound, in.start, "unknown model")
		return
	}
	tokens := int(float64(len(req.body)) * passthroughPaths[path])
	if ok, wait := in.t.tokens.take(float64(tokens)); !ok {
		s.rateLimited(ctx, in.rid, in.start, wait, "tokens")
		return
	}
	sc.route = router.Request{PromptTokens: tokens, Unstreamed: true, CandidateBuf: sc.cands}
	x := s.newExchange(in.rid, in.engineID, path, false, in.start, p, req.model)
	x.pass = true
	s.dispatch(ctx, st, sc, x, "")
}

// parseModel fills r from a pass-through request body: a JSON object whose
// model member (matched as parse matches it) names a model. Its stream
// member, if any, is forwarded as it came.
func (r *apiRequest) parseModel(body []byte) *paramError {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 {
		return perr("", "the request body is empty; expected a JSON object")
	}
	if trimmed[0] != '{' || !json.Valid(trimmed) {
		return perr("", "the request body is not a valid JSON object")
	}
	r.body = trimmed
	for m := (members{b: trimmed}); m.next(); {
		switch {
		case keyIs(m.key, "model"):
			r.fields.Model = m.value
		case keyIs(m.key, "stream"):
			r.fields.Stream = m.value
		}
	}
	if r.fields.Model == nil {
		return perr("model", "you must provide a model parameter")
	}
	if r.fields.Model[0] == '"' {
		r.model = r.decodeString(r.fields.Model)
	}
	if r.model == "" {
		return perr("model", "model must be a non-empty string")
	}
	return nil
}
