package backends

import (
	"fmt"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"
)

// Adapters fetches an engine's model list (GET url, its /v1/models) and
// returns the LoRA adapters it serves: the cards with a parent, as vLLM
// lists the adapters given by --lora-modules or loaded at run time. A list
// without a data array is an error: the engine's adapters are then unknown,
// not none. apiKey, if set, is sent as a bearer token.
func (s *MetricsScraper) Adapters(url, apiKey string, insecure bool) ([]string, error) {
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
		return nil, fmt.Errorf("list models %s: %w", url, err)
	}
	if sc := resp.StatusCode(); sc != fasthttp.StatusOK {
		return nil, fmt.Errorf("list models %s: status %d", url, sc)
	}
	var list struct {
		Data *[]struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.Unmarshal(resp.Body(), &list); err != nil || list.Data == nil {
		return nil, fmt.Errorf("list models %s: not a model list", url)
	}
	adapters := []string{}
	for _, card := range *list.Data {
		if card.Parent != nil && *card.Parent != "" && card.ID != "" {
			adapters = append(adapters, card.ID)
		}
	}
	return adapters, nil
}
