package mockengine

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"testing"
)

type embeddingsAnswer struct {
	Object string `json:"object"`
	Model  string `json:"model"`
	Data   []struct {
		Object    string          `json:"object"`
		Index     int             `json:"index"`
		Embedding json.RawMessage `json:"embedding"`
	} `json:"data"`
	Usage struct {
		PromptTokens int `json:"prompt_tokens"`
		TotalTokens  int `json:"total_tokens"`
	} `json:"usage"`
	Error *struct {
		Param string `json:"param"`
	} `json:"error"`
}

func postEmbeddings(t *testing.T, url string, body any) (int, embeddingsAnswer) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+"/v1/embeddings", "application/json", bytes.NewReader(b))
	code, _, a := readJSON[embeddingsAnswer](t, resp, err)
	return code, a
}

func floats(t *testing.T, raw json.RawMessage) []float32 {
	t.Helper()
	var v []float32
	if err := json.Unmarshal(raw, &v); err == nil {
		return v
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatalf("embedding is neither floats nor base64: %s", raw)
	}
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil || len(b)%4 != 0 {
		t.Fatalf("bad base64 embedding %q", s)
	}
	for i := 0; i < len(b); i += 4 {
		v = append(v, math.Float32frombits(binary.LittleEndian.Uint32(b[i:])))
	}
	return v
}

func cosine(a, b []float32) float64 {
	dot := 0.0
	for i := range a {
		dot += float64(a[i]) * float64(b[i])
	}
	return dot
}

// The simulated engine's embeddings: unit vectors, deterministic, closer for
// texts sharing words, in both encodings and every input shape.
func TestEmbeddings(t *testing.T) {
	_, url := startEngine(t, Config{})
	code, a := postEmbeddings(t, url, map[string]any{"model": "mock-model",
		"input": []string{"the cat sat on the mat", "the cat sat on the hat", "quarterly revenue grew by four percent"}})
	if code != 200 || a.Object != "list" || len(a.Data) != 3 || a.Usage.PromptTokens == 0 || a.Usage.TotalTokens != a.Usage.PromptTokens {
		t.Fatalf("%d %+v", code, a)
	}
	v := make([][]float32, 3)
	for i, d := range a.Data {
		if d.Index != i || d.Object != "embedding" {
			t.Fatalf("item %d: %+v", i, d)
		}
		v[i] = floats(t, d.Embedding)
		if len(v[i]) != DefaultEmbeddingDims || math.Abs(cosine(v[i], v[i])-1) > 1e-5 {
			t.Fatalf("item %d: %d dims, norm² %v", i, len(v[i]), cosine(v[i], v[i]))
		}
	}
	if near, far := cosine(v[0], v[1]), cosine(v[0], v[2]); near <= far || near < 0.5 {
		t.Fatalf("similar texts %.3f, unrelated %.3f", near, far)
	}
	_, again := postEmbeddings(t, url, map[string]any{"input": "the cat sat on the mat", "encoding_format": "base64"})
	if got := floats(t, again.Data[0].Embedding); cosine(got, v[0]) < 1-1e-5 {
		t.Fatalf("the same text, base64: cosine %v", cosine(got, v[0]))
	}
	_, ids := postEmbeddings(t, url, map[string]any{"input": [][]int{{1, 2, 3}, {4, 5}}, "dimensions": 8})
	if len(ids.Data) != 2 || len(floats(t, ids.Data[1].Embedding)) != 8 || ids.Usage.PromptTokens != 5 {
		t.Fatalf("token id inputs: %+v", ids)
	}
	for _, bad := range []map[string]any{
		{"input": nil}, {"input": []string{}}, {"input": 7}, {"input": "x", "dimensions": 0},
		{"input": "x", "encoding_format": "int8"}, {"input": [][]int{{}}},
	} {
		if code, a := postEmbeddings(t, url, bad); code != 400 || a.Error == nil {
			t.Fatalf("%v: %d %+v", bad, code, a)
		}
	}
	if code, _ := postEmbeddings(t, url, map[string]any{"model": "other", "input": "x"}); code != 404 {
		t.Fatalf("unknown model: %d", code)
	}
}

// Scoring and reranking rank by the same similarity the embeddings have:
// a near-identical text above an unrelated one.
func TestScoreAndRerank(t *testing.T) {
	_, url := startEngine(t, Config{})
	postJSON := func(path string, body any, out any) int {
		t.Helper()
		b, _ := json.Marshal(body)
		resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s: not JSON: %s", path, raw)
		}
		return resp.StatusCode
	}
	docs := []string{"quarterly revenue grew by four percent", "the cat sat on the hat", "a dog barked"}
	var score struct {
		Object string
		Data   []struct {
			Index  int
			Object string
			Score  float64
		}
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
		}
	}
	for _, path := range []string{"/score", "/v1/score"} {
		if code := postJSON(path, map[string]any{"text_1": "the cat sat on the mat", "text_2": docs}, &score); code != 200 ||
			score.Object != "list" || len(score.Data) != 3 || score.Data[1].Score <= score.Data[0].Score || score.Data[1].Object != "score" || score.Usage.PromptTokens == 0 {
			t.Fatalf("%s: %d %+v", path, code, score)
		}
	}
	var rerank struct {
		Results []struct {
			Index          int
			Document       struct{ Text string }
			RelevanceScore float64 `json:"relevance_score"`
		}
	}
	for _, path := range []string{"/rerank", "/v1/rerank", "/v2/rerank"} {
		if code := postJSON(path, map[string]any{"model": "mock-model", "query": "the cat sat on the mat", "documents": docs, "top_n": 2}, &rerank); code != 200 ||
			len(rerank.Results) != 2 || rerank.Results[0].Index != 1 || rerank.Results[0].Document.Text != docs[1] || rerank.Results[0].RelevanceScore < rerank.Results[1].RelevanceScore {
			t.Fatalf("%s: %d %+v", path, code, rerank)
		}
	}
	var bad struct{ Error *struct{ Param string } }
	for path, body := range map[string]any{
		"/score":     map[string]any{"text_1": []string{"a", "b"}, "text_2": docs},
		"/v1/score":  map[string]any{"text_1": "a"},
		"/rerank":    map[string]any{"query": "q", "documents": []string{}},
		"/v2/rerank": map[string]any{"query": "q", "documents": docs, "top_n": -1},
	} {
		bad.Error = nil
		if code := postJSON(path, body, &bad); code != 400 || bad.Error == nil {
			t.Fatalf("%s %v: %d %+v", path, body, code, bad)
		}
	}
}
