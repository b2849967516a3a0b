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

// Pass-through requests answer to the same keys and tenant limits as
// completions: no key is a 401 that never reaches an engine, a tenant's
// prompt-token budget counts their bodies (4 bytes a token), and the
// tenant's key stays at the proxy.
func TestPassthroughKeysAndTenantLimits(t *testing.T) {
	engines := fleet(t, 1, "-speedup", "20")
	url, p, _ := startProxyConfig(t, backendsYAML(map[string]string{"m": engines[0]}, `
auth:
  keys:
    - {key: alpha-key-0001, tenant: alpha}
    - {key: small-key-0002, tenant: small}
  admin_keys: [admin-key-0005]
tenants:
  - {name: small, tokens_per_minute: 600}
`))
	embed := func(key, input string) (*openai.CreateEmbeddingResponse, error) {
		c := openai.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey(key), option.WithMaxRetries(0))
		return c.Embeddings.New(context.Background(), openai.EmbeddingNewParams{
			Model: "default", Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String(input)},
		})
	}
	var apiErr *openai.Error
	if _, err := embed("not-a-key-000", "x"); !asAPIError(err, &apiErr) || apiErr.StatusCode != 401 {
		t.Fatalf("bad key: %v", err)
	}
	if res, err := embed("alpha-key-0001", "hello"); err != nil || len(res.Data) != 1 {
		t.Fatalf("alpha: %v %+v", err, res)
	}
	// ≈ 2,800 bytes, counted as 700 tokens: more than the bucket holds, so
	// it takes a full bucket, and the next one waits for it to refill.
	long := strings.Repeat("tokens of a long document to embed ", 80)
	if res, err := embed("small-key-0002", long); err != nil || len(res.Data) != 1 {
		t.Fatalf("small, a full bucket: %v %+v", err, res)
	}
	if _, err := embed("small-key-0002", long); !asAPIError(err, &apiErr) || apiErr.StatusCode != 429 {
		t.Fatalf("over the tenant's tokens per minute: %v", err)
	}
	if res, err := embed("alpha-key-0001", long); err != nil || len(res.Data) != 1 {
		t.Fatalf("alpha, unlimited: %v %+v", err, res)
	}
	assertIdle(t, url)
	for _, secret := range []string{"alpha-key-0001", "small-key-0002"} {
		if strings.Contains(p.String(), secret) {
			t.Fatalf("%q leaked into kvproxy's output", secret)
		}
	}
}
