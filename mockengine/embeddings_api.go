package mockengine

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"time"
)

// DefaultEmbeddingDims is the length of the simulated engine's embeddings
// when a request names no dimensions.
const DefaultEmbeddingDims = 64

// embeddingsRequest is OpenAI's (and vLLM's) POST /v1/embeddings body.
type embeddingsRequest struct {
	Model          string          `json:"model"`
	Input          json.RawMessage `json:"input"`
	EncodingFormat string          `json:"encoding_format"`
	Dimensions     *int            `json:"dimensions"`
}

// serveEmbeddings answers /v1/embeddings at once (embeddings are not run on
// the simulated clock): each input's vector is the normalised sum of a
// fixed pseudo-random vector per token, so equal inputs get equal vectors
// and inputs sharing tokens point the same way.
func (e *Engine) serveEmbeddings(w http.ResponseWriter, r *http.Request) {
	var req embeddingsRequest
	err := e.decodeRequest(w, r, &req, &req.Model)
	if err != nil {
		e.fail(w, err)
		return
	}
	dims := DefaultEmbeddingDims
	if req.Dimensions != nil {
		if dims = *req.Dimensions; dims < 1 || dims > 4096 {
			e.fail(w, invalid("dimensions", "dimensions must be between 1 and 4096, got %d", dims))
			return
		}
	}
	if req.EncodingFormat != "" && req.EncodingFormat != "float" && req.EncodingFormat != "base64" {
		e.fail(w, invalid("encoding_format", "encoding_format must be float or base64, got %q", req.EncodingFormat))
		return
	}
	inputs, err := e.embeddingInputs(req.Input)
	if err != nil {
		e.fail(w, err)
		return
	}
	type item struct {
		Object    string `json:"object"`
		Index     int    `json:"index"`
		Embedding any    `json:"embedding"`
	}
	data := make([]item, len(inputs))
	tokens := 0
	for i, ids := range inputs {
		if len(ids) == 0 {
			e.fail(w, invalid("input", "input %d is empty", i))
			return
		}
		tokens += len(ids)
		v := embed(ids, dims)
		data[i] = item{Object: "embedding", Index: i, Embedding: v}
		if req.EncodingFormat == "base64" {
			raw := make([]byte, 4*len(v))
			for j, f := range v {
				binary.LittleEndian.PutUint32(raw[4*j:], math.Float32bits(f))
			}
			data[i].Embedding = base64.StdEncoding.EncodeToString(raw)
		}
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{
		"id": fmt.Sprintf("embd-%d", time.Now().UnixNano()), "object": "list", "created": time.Now().Unix(),
		"model": e.cfg.Model, "data": data,
		"usage": map[string]int{"prompt_tokens": tokens, "total_tokens": tokens},
	})
}

// embeddingInputs reads input: a string, an array of strings, an array of
// token ids, or an array of arrays of token ids.
func (e *Engine) embeddingInputs(raw json.RawMessage) ([][]uint32, error) {
	raw = bytes.TrimSpace(raw)
	bad := invalid("input", "input must be a string, an array of strings, an array of token ids or an array of arrays of token ids")
	if len(raw) == 0 || string(raw) == "null" {
		return nil, invalid("input", "input is required")
	}
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return [][]uint32{e.enc.EncodeText(nil, text)}, nil
	}
	var ids []uint32
	if json.Unmarshal(raw, &ids) == nil {
		return [][]uint32{ids}, nil
	}
	var texts []string
	if json.Unmarshal(raw, &texts) == nil {
		out := make([][]uint32, len(texts))
		for i, t := range texts {
			out[i] = e.enc.EncodeText(nil, t)
		}
		return nonEmpty(out, bad)
	}
	var batch [][]uint32
	if json.Unmarshal(raw, &batch) == nil {
		return nonEmpty(batch, bad)
	}
	return nil, bad
}

func nonEmpty(inputs [][]uint32, bad error) ([][]uint32, error) {
	if len(inputs) == 0 {
		return nil, bad
	}
	return inputs, nil
}

// embed is the unit vector of dims components summing a splitmix64 stream
// seeded by each token id.
func embed(ids []uint32, dims int) []float32 {
	sum := make([]float64, dims)
	for _, id := range ids {
		x := uint64(id)*0x9e3779b97f4a7c15 + 1
		for j := range sum {
			x += 0x9e3779b97f4a7c15
			z := x
			z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
			z = (z ^ z>>27) * 0x94d049bb133111eb
			z ^= z >> 31
			sum[j] += float64(int64(z)) / math.MaxInt64
		}
	}
	norm := 0.0
	for _, f := range sum {
		norm += f * f
	}
	norm = math.Sqrt(norm)
	out := make([]float32, dims)
	for j, f := range sum {
		if norm > 0 {
			out[j] = float32(f / norm)
		}
	}
	return out
}
