package mockengine

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"time"
)

// scoreRequest is vLLM's /score body: text_1 against each of text_2 (one
// text_1 for all, or pairs of equal-length lists).
type scoreRequest struct {
	Model string          `json:"model"`
	Text1 json.RawMessage `json:"text_1"`
	Text2 json.RawMessage `json:"text_2"`
}

// rerankRequest is vLLM's /rerank body (Jina's and Cohere's shape).
type rerankRequest struct {
	Model     string   `json:"model"`
	Query     string   `json:"query"`
	Documents []string `json:"documents"`
	TopN      int      `json:"top_n"`
}

// similarity is the relevance of two texts for the simulated engine: the
// cosine of their embeddings, mapped to [0, 1].
func (e *Engine) similarity(a, b string) (float64, int) {
	ta, tb := e.enc.EncodeText(nil, a), e.enc.EncodeText(nil, b)
	va, vb := embed(ta, DefaultEmbeddingDims), embed(tb, DefaultEmbeddingDims)
	dot := 0.0
	for i := range va {
		dot += float64(va[i]) * float64(vb[i])
	}
	return (dot + 1) / 2, len(ta) + len(tb)
}

// textOrTexts reads a string or an array of strings.
func textOrTexts(raw json.RawMessage, param string) ([]string, error) {
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []string{one}, nil
	}
	var many []string
	if json.Unmarshal(raw, &many) == nil && len(many) > 0 {
		return many, nil
	}
	return nil, invalid(param, "%s must be a string or a non-empty array of strings", param)
}

// serveScore answers vLLM's /score and /v1/score.
func (e *Engine) serveScore(w http.ResponseWriter, r *http.Request) {
	var req scoreRequest
	err := e.decodeRequest(w, r, &req, &req.Model)
	var t1, t2 []string
	if err == nil {
		t1, err = textOrTexts(req.Text1, "text_1")
	}
	if err == nil {
		t2, err = textOrTexts(req.Text2, "text_2")
	}
	if err == nil && len(t1) != 1 && len(t1) != len(t2) {
		err = invalid("text_1", "text_1 must hold one text or as many as text_2 (%d), got %d", len(t2), len(t1))
	}
	if err != nil {
		e.fail(w, err)
		return
	}
	type item struct {
		Index  int     `json:"index"`
		Object string  `json:"object"`
		Score  float64 `json:"score"`
	}
	data := make([]item, len(t2))
	tokens := 0
	for i, b := range t2 {
		a := t1[0]
		if len(t1) > 1 {
			a = t1[i]
		}
		s, n := e.similarity(a, b)
		data[i], tokens = item{Index: i, Object: "score", Score: s}, tokens+n
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{
		"id": fmt.Sprintf("score-%d", time.Now().UnixNano()), "object": "list", "created": time.Now().Unix(),
		"model": e.cfg.Model, "data": data,
		"usage": map[string]int{"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
	})
}

// serveRerank answers vLLM's /rerank, /v1/rerank and /v2/rerank: the
// documents by relevance to the query, best first, top_n of them (0: all).
func (e *Engine) serveRerank(w http.ResponseWriter, r *http.Request) {
	var req rerankRequest
	err := e.decodeRequest(w, r, &req, &req.Model)
	if err == nil && len(req.Documents) == 0 {
		err = invalid("documents", "documents must be a non-empty array of strings")
	}
	if err == nil && req.TopN < 0 {
		err = invalid("top_n", "top_n must not be negative, got %d", req.TopN)
	}
	if err != nil {
		e.fail(w, err)
		return
	}
	type result struct {
		Index    int `json:"index"`
		Document struct {
			Text string `json:"text"`
		} `json:"document"`
		RelevanceScore float64 `json:"relevance_score"`
	}
	results := make([]result, len(req.Documents))
	tokens := 0
	for i, d := range req.Documents {
		s, n := e.similarity(req.Query, d)
		results[i].Index, results[i].Document.Text, results[i].RelevanceScore = i, d, s
		tokens += n
	}
	sort.SliceStable(results, func(a, b int) bool { return results[a].RelevanceScore > results[b].RelevanceScore })
	if req.TopN > 0 && req.TopN < len(results) {
		results = results[:req.TopN]
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{
		"id": fmt.Sprintf("rerank-%d", time.Now().UnixNano()), "model": e.cfg.Model,
		"usage": map[string]int{"total_tokens": tokens}, "results": results,
	})
}
