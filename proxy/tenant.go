package proxy

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/kv"
)

// tenant is who a request is from: its cache namespace, the cache_salt the
// proxy injects for it, and its rate limits.
type tenant struct {
	name string
	// salt is injected as cache_salt into requests to vLLM/SGLang engines;
	// "" for the anonymous tenant of a proxy without keys.
	salt string
	// ns seeds block 0 of the tenant's hashes: derived from the salt, so
	// the router's namespaces and the engines' salted caches line up.
	ns       kv.Namespace
	requests *bucket // nil: unlimited
	tokens   *bucket
	// inflight counts the requests in flight against maxInflight (0: no
	// cap, nothing counted). A reload keeps the count.
	maxInflight int64
	inflight    *atomic.Int64
	// priority is tenants[].priority (capped set): the least a request's
	// priority may be (lower: more urgent), and its default.
	priority int
	capped   bool
	// models are the models (by name) the tenant may use; nil: all.
	models map[string]bool
}

// mayUse reports whether the tenant may use the model of pool p (nil: no
// model, which the caller answers as unknown).
func (t *tenant) mayUse(p *modelPool) bool {
	return p != nil && (t.models == nil || t.models[p.cfg.Name])
}

// queuePriority is the priority a request of t that asked for asked (has:
// it named one kvproxy reads) waits at: what it asked, or the tenant's
// when the tenant has one and allows no more urgency, or it asked none.
func (t *tenant) queuePriority(asked int, has bool) int {
	switch {
	case !t.capped && has:
		return asked
	case !t.capped:
		return 0
	case has:
		return max(asked, t.priority)
	}
	return t.priority
}

// tenantSlot is a request's place in its tenant's max_concurrency, taken
// at admission and given back once when the request ends: when its handler
// returns, or, for an answer streamed after that, when the stream ends.
type tenantSlot struct {
	count    *atomic.Int64
	handed   bool // a streamed answer gives it back (set and read on the handler's goroutine)
	released atomic.Bool
}

// acquire takes a slot of t's max_concurrency; nil when t has no cap, and
// ok false when it is full.
func (t *tenant) acquire() (slot *tenantSlot, ok bool) {
	if t.maxInflight == 0 {
		return nil, true
	}
	if t.inflight.Add(1) > t.maxInflight {
		t.inflight.Add(-1)
		return nil, false
	}
	return &tenantSlot{count: t.inflight}, true
}

func (s *tenantSlot) release() {
	if s != nil && s.released.CompareAndSwap(false, true) {
		s.count.Add(-1)
	}
}

// hand leaves the release to the answer's stream.
func (s *tenantSlot) hand() {
	if s != nil {
		s.handed = true
	}
}

// handlerDone releases the slot unless a streamed answer holds it.
func (s *tenantSlot) handlerDone() {
	if s != nil && !s.handed {
		s.release()
	}
}

// authTable resolves API keys. Keys are looked up by their SHA-256 so the
// table never holds them in plain text.
type authTable struct {
	byKey     map[[32]byte]*tenant
	admin     map[[32]byte]bool
	metrics   map[[32]byte]bool // auth.metrics_keys: with any, /metrics takes one (or an admin key)
	anonymous *tenant           // set when no keys are configured
	tenants   map[string]*tenant
}

// sharedNamespace is the cache namespace of tenants with shared_cache.
const sharedNamespace = "\x00shared"

func newAuthTable(cfg *config.Config, prev *authTable) *authTable {
	a := &authTable{byKey: map[[32]byte]*tenant{}, admin: map[[32]byte]bool{}, metrics: map[[32]byte]bool{}, tenants: map[string]*tenant{}}
	settings := map[string]config.Tenant{}
	for _, t := range cfg.Tenants {
		settings[t.Name] = t
	}
	get := func(name string) *tenant {
		if t, ok := a.tenants[name]; ok {
			return t
		}
		ts := settings[name]
		t := &tenant{name: name}
		if name != "" || len(cfg.Auth.Keys) > 0 {
			ns := name
			if ts.SharedCache {
				ns = sharedNamespace
			}
			t.salt = cacheSalt(cfg.Auth.CacheSaltSecret, ns)
		}
		t.ns = kv.NewNamespace(t.salt)
		// Keep the buckets of a tenant across reloads when its limits stay.
		var old *tenant
		if prev != nil {
			old = prev.tenants[name]
		}
		t.requests = reuseBucket(old, true, ts.RequestsPerSecond, math.Max(1, ts.RequestsPerSecond))
		t.tokens = reuseBucket(old, false, ts.TokensPerMinute/60, ts.TokensPerMinute)
		if old != nil && old.inflight != nil {
			// The requests it admitted under a cap still count, even
			// through a reload that lifts the cap and one that brings it
			// back (those admitted without a cap are not counted).
			t.inflight = old.inflight
		}
		if ts.Priority != nil {
			t.priority, t.capped = *ts.Priority, true
		}
		if ts.Models != nil {
			t.models = map[string]bool{}
			for _, name := range ts.Models {
				if m, ok := cfg.ModelByName(name); ok {
					t.models[m.Name] = true
				}
			}
		}
		if ts.MaxConcurrency > 0 {
			t.maxInflight = int64(ts.MaxConcurrency)
			if t.inflight == nil {
				t.inflight = new(atomic.Int64)
			}
		}
		a.tenants[name] = t
		return t
	}
	for _, k := range cfg.Auth.Keys {
		a.byKey[sha256.Sum256([]byte(k.Key))] = get(k.Tenant)
	}
	for _, k := range cfg.Auth.AdminKeys {
		a.admin[sha256.Sum256([]byte(k))] = true
	}
	for _, k := range cfg.Auth.MetricsKeys {
		a.metrics[sha256.Sum256([]byte(k))] = true
	}
	if len(cfg.Auth.Keys) == 0 {
		a.anonymous = get("")
	}
	return a
}

func reuseBucket(old *tenant, requests bool, rate, burst float64) *bucket {
	if rate <= 0 {
		return nil
	}
	headers := &tokenLimitHeaders
	if requests {
		headers = &requestLimitHeaders
	}
	if old != nil {
		b := old.tokens
		if requests {
			b = old.requests
		}
		if b != nil && b.rate == rate && b.burst == burst {
			return b
		}
		if b != nil {
			// New limits, not a new allowance: the tenant keeps what it
			// has spent, or a reload would refill the bucket of a tenant
			// being throttled. A raised limit gives it the difference at
			// once (it kept what it had left, no more than before); a
			// lowered one leaves it what it had left, up to the new
			// burst, not a debt of what it spent above it (minutes of
			// refusals for what the old limit allowed).
			nb := newBucket(rate, burst, headers)
			b.mu.Lock()
			left := math.Min(b.burst, b.level+nb.last.Sub(b.last).Seconds()*b.rate)
			spent := b.burst - left
			b.mu.Unlock()
			nb.level = math.Max(burst-spent, math.Min(burst, left))
			return nb
		}
	}
	return newBucket(rate, burst, headers)
}

// cacheSalt derives a tenant's cache_salt: an HMAC of its namespace, so it
// cannot be guessed from the tenant's name without the secret.
func cacheSalt(secret, namespace string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte("kvproxy cache_salt\x00"))
	m.Write([]byte(namespace))
	return hex.EncodeToString(m.Sum(nil)[:16])
}

// composeSalt is the cache_salt an engine gets for a request whose client
// sent its own: the client's alone from the anonymous tenant of a proxy
// without keys, else the tenant's followed by the client's. A client can
// split its tenant's cache (per end user, as vLLM's cache_salt is meant
// for) but never reach another tenant's: the tenant part is fixed-length.
func composeSalt(tenantSalt, clientSalt string) string {
	if tenantSalt == "" {
		return clientSalt
	}
	return tenantSalt + "/" + clientSalt
}

func bearer(ctx *fasthttp.RequestCtx) string { return bearerOf(&ctx.Request.Header) }

func bearerOf(h *fasthttp.RequestHeader) string {
	v := string(h.Peek("Authorization"))
	if len(v) > 7 && strings.EqualFold(v[:7], "bearer ") {
		return strings.TrimSpace(v[7:])
	}
	return ""
}

// knows reports whether a request's headers carry a key kvproxy knows (a
// client's, an admin's or a metrics reader's), or no keys are configured:
// whether its body is worth reading in full before the key is checked.
func (a *authTable) knows(h *fasthttp.RequestHeader) bool {
	if a.anonymous != nil {
		return true
	}
	key := sha256.Sum256([]byte(bearerOf(h)))
	if a.byKey[key] != nil || a.admin[key] || a.metrics[key] {
		return true
	}
	if k := h.Peek("X-Api-Key"); len(k) > 0 {
		return a.byKey[sha256.Sum256(k)] != nil
	}
	return false
}

// client finds the tenant of a request; nil means the key is missing or wrong.
func (a *authTable) client(ctx *fasthttp.RequestCtx) *tenant {
	if a.anonymous != nil {
		return a.anonymous
	}
	if t := a.byKey[sha256.Sum256([]byte(bearer(ctx)))]; t != nil {
		return t
	}
	// Anthropic's SDKs send their key so (with an auth token as well, when
	// they have both).
	if key := ctx.Request.Header.Peek("X-Api-Key"); len(key) > 0 {
		return a.byKey[sha256.Sum256(key)]
	}
	return nil
}

// isAdmin checks the admin key. With no admin keys, admin endpoints are open
// only on a proxy without client keys.
func (a *authTable) isAdmin(ctx *fasthttp.RequestCtx) bool {
	if len(a.admin) == 0 {
		return a.anonymous != nil
	}
	key := bearer(ctx)
	return key != "" && a.admin[sha256.Sum256([]byte(key))]
}

// readsMetrics checks the key of a request for /metrics: open without
// metrics keys; with them, one of them or an admin key.
func (a *authTable) readsMetrics(ctx *fasthttp.RequestCtx) bool {
	if len(a.metrics) == 0 {
		return true
	}
	key := sha256.Sum256([]byte(bearer(ctx)))
	return a.metrics[key] || a.admin[key]
}

// bucket is a token bucket: rate per second, holding at most burst.
type bucket struct {
	rate, burst float64
	headers     *limitHeaders
	mu          sync.Mutex
	level       float64
	last        time.Time
}

// limitHeaders names the x-ratelimit-* headers that report one bucket, as
// OpenAI names them.
type limitHeaders struct{ limit, remaining, reset []byte }

var (
	requestLimitHeaders = limitHeaders{[]byte("X-Ratelimit-Limit-Requests"), []byte("X-Ratelimit-Remaining-Requests"), []byte("X-Ratelimit-Reset-Requests")}
	tokenLimitHeaders   = limitHeaders{[]byte("X-Ratelimit-Limit-Tokens"), []byte("X-Ratelimit-Remaining-Tokens"), []byte("X-Ratelimit-Reset-Tokens")}
)

func newBucket(rate, burst float64, headers *limitHeaders) *bucket {
	return &bucket{rate: rate, burst: burst, headers: headers, level: burst, last: time.Now()}
}

// take removes n tokens if available; otherwise it returns how long until
// they would be. Either way it reports the bucket in h (nil: not at all)
// as OpenAI does: its size, what is left (whole units; 0 in debt) and how
// long until it is full again ("6m0s", "20ms").
// charge takes n more from the bucket, into debt if need be: what a
// request turned out to cost beyond what it was admitted for.
func (b *bucket) charge(n float64) {
	if b == nil || n <= 0 {
		return
	}
	b.mu.Lock()
	b.level -= n
	b.mu.Unlock()
}

func (b *bucket) take(n float64, h *fasthttp.ResponseHeader) (ok bool, wait time.Duration) {
	if b == nil {
		return true, 0
	}
	b.mu.Lock()
	now := time.Now()
	b.level = math.Min(b.burst, b.level+now.Sub(b.last).Seconds()*b.rate)
	b.last = now
	// A request larger than the burst (a long prompt, a batch) waits for
	// a full bucket, then is charged in full: the bucket goes into debt,
	// which later requests wait out (a batch of 8,000 tokens cost a
	// 100-token budget 100 before; found by the eighth session's trial).
	need := math.Min(n, b.burst)
	ok = b.level >= need
	if ok {
		b.level -= n
	} else {
		wait = time.Duration((need - b.level) / b.rate * float64(time.Second))
	}
	level := b.level
	b.mu.Unlock()
	if h != nil {
		var buf [24]byte
		h.SetCanonical(b.headers.limit, strconv.AppendInt(buf[:0], int64(b.burst), 10))
		h.SetCanonical(b.headers.remaining, strconv.AppendInt(buf[:0], int64(math.Max(0, level)), 10))
		full := time.Duration((b.burst - level) / b.rate * float64(time.Second))
		h.SetCanonical(b.headers.reset, appendMillis(buf[:0], full.Round(time.Millisecond)))
	}
	return ok, wait
}

// appendMillis writes d, a whole number of milliseconds, as Duration.String
// does ("20ms", "1.5s", "6m0s", "1h0m0s"), without its allocation.
func appendMillis(b []byte, d time.Duration) []byte {
	ms := d.Milliseconds()
	switch {
	case ms <= 0:
		return append(b, "0s"...)
	case ms < 1000:
		return append(strconv.AppendInt(b, ms, 10), "ms"...)
	}
	if h := ms / 3_600_000; h > 0 {
		b = append(strconv.AppendInt(b, h, 10), 'h')
	}
	if ms >= 60_000 {
		b = append(strconv.AppendInt(b, ms/60_000%60, 10), 'm')
	}
	b = strconv.AppendInt(b, ms/1000%60, 10)
	if frac := ms % 1000; frac > 0 {
		b = append(b, '.', byte('0'+frac/100), byte('0'+frac/10%10), byte('0'+frac%10))
		for b[len(b)-1] == '0' {
			b = b[:len(b)-1]
		}
	}
	return append(b, 's')
}
