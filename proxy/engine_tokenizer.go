package proxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"
	"github.com/zeebo/xxh3"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/kv"
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

// engineTokenizeTimeout bounds one /tokenize call: past it the request is
// routed by load alone rather than wait (stream_idle_timeout is minutes).
const engineTokenizeTimeout = 5 * time.Second

// engineTokenizeBackoff is how long a backend whose /tokenize failed is not
// asked again, so that one stuck engine does not delay every request.
const engineTokenizeBackoff = 30 * time.Second

type engineTokenizeBody struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt,omitempty"`
	Messages            json.RawMessage `json:"messages,omitempty"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt,omitempty"`
	// What else the engine's chat template or tokenizer renders: tools
	// (Llama 3.1 and Qwen 2.5 put them in the prompt), and the template
	// and its arguments a request may choose.
	Tools                json.RawMessage `json:"tools,omitempty"`
	ChatTemplate         json.RawMessage `json:"chat_template,omitempty"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs,omitempty"`
	ContinueFinalMessage json.RawMessage `json:"continue_final_message,omitempty"`
	AddSpecialTokens     json.RawMessage `json:"add_special_tokens,omitempty"`
}

// tokens returns the engine's token ids for req; more than maxTokens are
// returned but not cached (the request is refused for them). Answers are
// cached per scope (the tenant's cache namespace): a cached answer comes
// without an engine call, which would tell a tenant what another one sent.
func (et *engineTokenizer) tokens(p *modelPool, req *apiRequest, chat bool, maxTokens int, scope kv.Namespace) ([]uint32, error) {
	body := engineTokenizeBody{}
	if chat {
		body.Messages = req.fields.Messages
		gen := req.addGenPrompt
		body.AddGenerationPrompt = &gen
		if req.converted {
			// The chat request the engine makes of the request.
			body.Messages, body.Tools = req.chatJSON(), json.RawMessage(req.tools)
		}
	} else {
		body.Prompt = req.fields.Prompt
	}
	h := xxh3.New()
	var sb [8]byte
	binary.LittleEndian.PutUint64(sb[:], uint64(scope))
	h.Write(sb[:])
	if chat && req.addGenPrompt {
		h.Write([]byte{1})
	}
	h.Write(body.Messages)
	h.Write(body.Prompt)
	h.Write(body.Tools)
	for m := (members{b: req.body}); m.next() && !req.converted; {
		if isNull(m.value) {
			continue
		}
		var f *json.RawMessage
		switch {
		case keyIs(m.key, "add_special_tokens"):
			f = &body.AddSpecialTokens
		case !chat:
			continue
		case keyIs(m.key, "tools"):
			f = &body.Tools
		case keyIs(m.key, "chat_template"):
			f = &body.ChatTemplate
		case keyIs(m.key, "chat_template_kwargs"):
			f = &body.ChatTemplateKwargs
		case keyIs(m.key, "continue_final_message"):
			f = &body.ContinueFinalMessage
		default:
			continue
		}
		*f = m.value
		h.Write([]byte{0})
		h.Write(m.key)
		h.Write(m.value)
	}
	key := h.Sum64()
	if ids, ok := et.cache.get(key); ok {
		return ids, nil
	}
	ws := *p.workers.Load()
	var lastErr error = errors.New("no available backend to tokenize with")
	now := time.Now().UnixNano()
	for range ws {
		b := ws[int(et.next.Add(1))%len(ws)]
		if b == nil || !b.isAvailable() || b.tokenizeDown.Load() > now {
			continue
		}
		// An adapter's request too: adapters share their base model's
		// tokenizer, and an engine without the adapter would 404.
		body.Model = b.cfg.ServedModel
		ids, err := et.ask(b, &body)
		if errors.As(err, new(requestRefused)) {
			// The request's own fault (a template error, a chat_template
			// the engine does not trust): every engine would refuse it,
			// and the next request may be fine.
			return nil, err
		}
		if err != nil {
			b.tokenizeDown.Store(time.Now().Add(engineTokenizeBackoff).UnixNano())
			lastErr = err
			continue
		}
		if len(ids) <= maxTokens {
			et.cache.put(key, ids)
		}
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
	var ab backends.Abort
	timer := time.AfterFunc(engineTokenizeTimeout, ab.Abort)
	defer timer.Stop()
	if _, err := b.up.Do(req, resp, false, &ab); err != nil {
		if ab.Aborted() {
			return nil, fmt.Errorf("backend %s /tokenize: no answer within %v", b.cfg.ID, engineTokenizeTimeout)
		}
		return nil, fmt.Errorf("backend %s /tokenize: %w", b.cfg.ID, err)
	}
	if code := resp.StatusCode(); code != fasthttp.StatusOK {
		// Logged by its type, code and param: the message may quote the
		// messages, or the key kvproxy sent.
		err := fmt.Errorf("backend %s /tokenize answered %d%s", b.cfg.ID, code, engineErrorKind(resp.Body()))
		// What the request asked for, not the engine (a 404 is an engine
		// without /tokenize, a 401 a wrong api_key: try the next).
		if code == fasthttp.StatusBadRequest || code == fasthttp.StatusRequestEntityTooLarge || code == fasthttp.StatusUnprocessableEntity {
			return nil, requestRefused{err, fmt.Sprintf("backend %s /tokenize answered %d: %s", b.cfg.ID, code, engineMessage(code, resp.Body()))}
		}
		return nil, err
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(resp.Body(), &out); err != nil {
		return nil, fmt.Errorf("backend %s /tokenize: %w", b.cfg.ID, err)
	}
	return out.Tokens, nil
}

// requestRefused is an engine's 4xx to a request: not the engine's fault.
// said is the engine's words, for the client whose request it is.
type requestRefused struct {
	error
	said string
}

func (e requestRefused) Unwrap() error { return e.error }

// tokenCache is a map of token ids by content hash, bounded in entries and
// in ids; when either is full it drops half of its entries (cheap, and good
// enough for a fallback path).
type tokenCache struct {
	mu  sync.Mutex
	m   map[uint64][]uint32
	ids int // token ids held
}

const (
	tokenCacheEntries = 4096
	tokenCacheIDs     = 8 << 20 // 32 MiB of ids
)

// bytes is what the cache holds, in bytes of token ids.
func (c *tokenCache) bytes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return 4 * c.ids
}

func (c *tokenCache) get(k uint64) ([]uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ids, ok := c.m[k]
	return ids, ok
}

func (c *tokenCache) put(k uint64, ids []uint32) {
	if len(ids) > tokenCacheIDs/4 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = make(map[uint64][]uint32)
	}
	for len(c.m) >= tokenCacheEntries || c.ids+len(ids) > tokenCacheIDs {
		n, half := 0, (len(c.m)+1)/2
		for k, v := range c.m {
			if n++; n > half {
				break
			}
			c.ids -= len(v)
			delete(c.m, k)
		}
	}
	if old, ok := c.m[k]; ok {
		c.ids -= len(old)
	}
	c.m[k] = ids
	c.ids += len(ids)
}
