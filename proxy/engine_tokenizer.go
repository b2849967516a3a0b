package proxy

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"
	"github.com/zeebo/xxh3"
)

// engineTokenizer asks a backend's own POST /tokenize (vLLM's endpoint takes
// a prompt or chat messages) for a model configured with tokenizer: engine,
// so the router hashes exactly the engine's tokens without a tokenizer file.
// Answers are cached by the request's content: a repeated prompt or a
// retried conversation turn costs no engine call.
type engineTokenizer struct {
	next  atomic.Uint32
	cache tokenCache
	calls atomic.Uint64 // engine calls made
}

type engineTokenizeBody struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt,omitempty"`
	Messages            json.RawMessage `json:"messages,omitempty"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt,omitempty"`
}

// tokens returns the engine's token ids for req.
func (et *engineTokenizer) tokens(p *modelPool, req *apiRequest, chat bool) ([]uint32, error) {
	body := engineTokenizeBody{}
	if chat {
		body.Messages = req.fields.Messages
		gen := req.addGenPrompt
		body.AddGenerationPrompt = &gen
	} else {
		body.Prompt = req.fields.Prompt
	}
	h := xxh3.New()
	if chat && req.addGenPrompt {
		h.Write([]byte{1})
	}
	h.Write(body.Messages)
	h.Write(body.Prompt)
	key := h.Sum64()
	if ids, ok := et.cache.get(key); ok {
		return ids, nil
	}
	ws := *p.workers.Load()
	var lastErr error = errors.New("no available backend to tokenize with")
	for range ws {
		b := ws[int(et.next.Add(1))%len(ws)]
		if b == nil || !b.isAvailable() {
			continue
		}
		body.Model = b.cfg.ServedModel
		ids, err := et.ask(b, &body)
		if err != nil {
			lastErr = err
			continue
		}
		et.cache.put(key, ids)
		return ids, nil
	}
	return nil, lastErr
}

func (et *engineTokenizer) ask(b *backend, body *engineTokenizeBody) ([]uint32, error) {
	et.calls.Add(1)
	raw, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.Header.SetMethod(fasthttp.MethodPost)
	req.SetRequestURI("/tokenize")
	req.Header.SetHost(b.host)
	req.Header.SetContentType("application/json")
	if b.authHeader != "" {
		req.Header.Set("Authorization", b.authHeader)
	}
	req.SetBodyRaw(raw)
	if _, err := b.up.Do(req, resp, false, nil); err != nil {
		return nil, fmt.Errorf("backend %s /tokenize: %w", b.cfg.ID, err)
	}
	if resp.StatusCode() != fasthttp.StatusOK {
		return nil, fmt.Errorf("backend %s /tokenize answered %d", b.cfg.ID, resp.StatusCode())
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(resp.Body(), &out); err != nil {
		return nil, fmt.Errorf("backend %s /tokenize: %w", b.cfg.ID, err)
	}
	return out.Tokens, nil
}

// tokenCache is a bounded map of token ids by content hash; when full it
// drops half of its entries (cheap, and good enough for a fallback path).
type tokenCache struct {
	mu sync.Mutex
	m  map[uint64][]uint32
}

const tokenCacheEntries = 4096

func (c *tokenCache) get(k uint64) ([]uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ids, ok := c.m[k]
	return ids, ok
}

func (c *tokenCache) put(k uint64, ids []uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = make(map[uint64][]uint32)
	}
	if len(c.m) >= tokenCacheEntries {
		n := 0
		for k := range c.m {
			if n++; n > tokenCacheEntries/2 {
				break
			}
			delete(c.m, k)
		}
	}
	c.m[k] = ids
}
