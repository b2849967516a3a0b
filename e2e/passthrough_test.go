package e2e

import (
	"context"
	"encoding/json"
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
)

// The OpenAI SDK's embeddings call, and vLLM's /tokenize and /v1/rerank, through kvproxy
// to simulated engines in their own processes: the model alias is resolved,
// the vectors come back whole in both encodings, and the load is freed.
func TestEmbeddingsAndTokenizeThroughTheProxy(t *testing.T) {
	engines := fleet(t, 2, "-speedup", "20")
	url, _ := kvproxy(t, engines, "kv")
	c := client(url)
	ctx := context.Background()

	var httpResp *http.Response
	res, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{
		Model: "default", // the alias
		Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"the cat sat on the mat", "the cat sat on the hat"}},
	}, option.WithResponseInto(&httpResp))
	if err != nil {
		t.Fatal(err)
	}
	if w := httpResp.Header.Get("x-kvproxy-worker"); !strings.HasPrefix(w, "mock-") {
		t.Fatalf("x-kvproxy-worker: %q", w)
	}
	if len(res.Data) != 2 || res.Model != "mock-model" || res.Usage.PromptTokens == 0 || len(res.Data[0].Embedding) != 64 {
		t.Fatalf("embeddings: %+v", res)
	}
	dot := 0.0
	for i, f := range res.Data[0].Embedding {
		dot += f * res.Data[1].Embedding[i]
	}
	if dot < 0.5 || dot > 1+1e-6 {
		t.Fatalf("cosine of two near-identical texts: %v", dot)
	}

	b64, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{
		Model:          "mock-model",
		Input:          openai.EmbeddingNewParamsInputUnion{OfString: openai.String("the cat sat on the mat")},
		EncodingFormat: openai.EmbeddingNewParamsEncodingFormatBase64,
	})
	if err != nil {
		t.Fatal(err)
	}
	for i, f := range b64.Data[0].Embedding {
		if math.Abs(f-res.Data[0].Embedding[i]) > 1e-6 {
			t.Fatalf("base64 component %d: %v, float gave %v", i, f, res.Data[0].Embedding[i])
		}
	}

	var apiErr *openai.Error
	if _, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "no-such-model", Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("x")}}); !asAPIError(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" {
		t.Fatalf("unknown model: %v", err)
	}

	resp, err := http.Post(url+"/tokenize", "application/json", strings.NewReader(`{"model":"default","prompt":"hello world"}`))
	if err != nil {
		t.Fatal(err)
	}
	var tok struct {
		Count  int   `json:"count"`
		Tokens []int `json:"tokens"`
	}
	json.NewDecoder(resp.Body).Decode(&tok)
	resp.Body.Close()
	if resp.StatusCode != 200 || tok.Count != 2 || len(tok.Tokens) != 2 {
		t.Fatalf("/tokenize: %d %+v", resp.StatusCode, tok)
	}
	resp, err = http.Post(url+"/v1/rerank", "application/json", strings.NewReader(`{"model":"default","query":"the cat sat on the mat","documents":["stock prices fell","the cat sat on the hat"]}`))
	if err != nil {
		t.Fatal(err)
	}
	var rr struct {
		Results []struct {
			Index int `json:"index"`
		} `json:"results"`
	}
	json.NewDecoder(resp.Body).Decode(&rr)
	resp.Body.Close()
	if resp.StatusCode != 200 || len(rr.Results) != 2 || rr.Results[0].Index != 1 {
		t.Fatalf("/v1/rerank: %d %+v", resp.StatusCode, rr)
	}
	assertIdle(t, url)
}
