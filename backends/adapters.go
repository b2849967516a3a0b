package backends

import (
	"fmt"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"
)

// ModelList is what an engine's /v1/models says of what it serves.
type ModelList struct {
	// Adapters are the cards with a parent: the LoRA adapters given by
	// --lora-modules or loaded at run time, as vLLM lists them.
	Adapters []string
	// Bases are the cards without a parent: the models the engine serves.
	Bases []string
	// MaxModelLen is the base model's context length in tokens (the
	// smallest its cards give), 0 when they give none.
	MaxModelLen int
}

// Models fetches an engine's model list (GET url, its /v1/models). A list
// without a data array is an error: the engine's adapters are then unknown,
// not none. apiKey, if set, is sent as a bearer token.
func (s *MetricsScraper) Models(url, apiKey string, insecure bool) (ModelList, error) {
	c := s.client()
	if insecure {
		c = s.insecure
	}
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url)
	req.Header.SetMethod(fasthttp.MethodGet)
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	if err := c.DoTimeout(req, resp, s.timeout()); err != nil {
		return ModelList{}, fmt.Errorf("list models %s: %w", url, err)
	}
	if sc := resp.StatusCode(); sc != fasthttp.StatusOK {
		return ModelList{}, fmt.Errorf("list models %s: status %d", url, sc)
	}
	var list struct {
		Data *[]struct {
			ID          string  `json:"id"`
			Parent      *string `json:"parent"`
			MaxModelLen int     `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal(resp.Body(), &list); err != nil || list.Data == nil {
		return ModelList{}, fmt.Errorf("list models %s: not a model list", url)
	}
	ml := ModelList{Adapters: []string{}}
	for _, card := range *list.Data {
		switch {
		case card.Parent != nil && *card.Parent != "":
			if card.ID != "" {
				ml.Adapters = append(ml.Adapters, card.ID)
			}
		default:
			if card.ID != "" {
				ml.Bases = append(ml.Bases, card.ID)
			}
			if card.MaxModelLen > 0 && (ml.MaxModelLen == 0 || card.MaxModelLen < ml.MaxModelLen) {
				ml.MaxModelLen = card.MaxModelLen
			}
		}
	}
	return ml, nil
}
