package proxy

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Answers to a tenant with limits carry OpenAI's x-ratelimit-* headers:
// the bucket's size, what is left of it and how long until it is full
// again; a 429 also says in milliseconds when to retry (Retry-After-Ms,
// which the OpenAI SDKs prefer to Retry-After's whole seconds).
func TestRateLimitHeaders(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, block_size: 16, tokenizer: cl100k_base, template: chatml}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
auth:
  keys:
    - {key: key-slow-1234, tenant: slow}
    - {key: key-tiny-1234, tenant: tiny}
    - {key: key-free-1234, tenant: free}
tenants:
  - {name: slow, requests_per_second: 0.5, tokens_per_minute: 6000}
  - {name: tiny, tokens_per_minute: 100}
`, e)
	short := `{"model":"m","messages":[{"role":"user","content":"hello there"}]}`
	duration := func(resp *http.Response, name string, lo, hi time.Duration) {
		t.Helper()
		d, err := time.ParseDuration(resp.Header.Get(name))
		if err != nil || d < lo || d > hi {
			t.Errorf("%s: %q, want a duration in [%v, %v]", name, resp.Header.Get(name), lo, hi)
		}
	}
	header := func(resp *http.Response, name, want string) {
		t.Helper()
		if got := resp.Header.Get(name); got != want {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
	}

	resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-slow-1234", short)
	if resp.StatusCode != 200 {
		t.Fatalf("first request: %d %s", resp.StatusCode, b)
	}
	header(resp, "X-Ratelimit-Limit-Requests", "1")
	header(resp, "X-Ratelimit-Remaining-Requests", "0")
	duration(resp, "X-Ratelimit-Reset-Requests", time.Second, 2*time.Second) // 0.5 a second
	header(resp, "X-Ratelimit-Limit-Tokens", "6000")
	left, err := strconv.Atoi(resp.Header.Get("X-Ratelimit-Remaining-Tokens"))
	if err != nil || left < 5900 || left >= 6000 {
		t.Errorf("X-Ratelimit-Remaining-Tokens: %q, want 6,000 less the prompt's few tokens", resp.Header.Get("X-Ratelimit-Remaining-Tokens"))
	}
	duration(resp, "X-Ratelimit-Reset-Tokens", time.Millisecond, 2*time.Second) // 100 tokens a second

	resp, b = postAuth(t, p.url+"/v1/chat/completions", "key-slow-1234", short)
	if resp.StatusCode != 429 || !strings.Contains(b, "rate_limit_exceeded") {
		t.Fatalf("second request within 2 s at 0.5 a second: %d %s, want 429", resp.StatusCode, b)
	}
	header(resp, "X-Ratelimit-Remaining-Requests", "0")
	if ms, err := strconv.Atoi(resp.Header.Get("Retry-After-Ms")); err != nil || ms <= 0 || ms > 2000 {
		t.Errorf("Retry-After-Ms: %q, want the wait in milliseconds, at most 2,000", resp.Header.Get("Retry-After-Ms"))
	}
	header(resp, "Retry-After", "2")

	long := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("many words of a long prompt ", 50) + `"}]}`
	postAuth(t, p.url+"/v1/chat/completions", "key-tiny-1234", long) // a full bucket takes it, into debt
	resp, b = postAuth(t, p.url+"/v1/chat/completions", "key-tiny-1234", short)
	if resp.StatusCode != 429 {
		t.Fatalf("a request after a prompt larger than the budget: %d %s, want 429", resp.StatusCode, b)
	}
	header(resp, "X-Ratelimit-Limit-Tokens", "100")
	header(resp, "X-Ratelimit-Remaining-Tokens", "0") // in debt
	duration(resp, "X-Ratelimit-Reset-Tokens", time.Minute, 5*time.Minute)
	header(resp, "X-Ratelimit-Limit-Requests", "") // no request rate for tiny

	resp, _ = postAuth(t, p.url+"/v1/chat/completions", "key-free-1234", short)
	for name := range resp.Header {
		if strings.HasPrefix(name, "X-Ratelimit") {
			t.Errorf("a tenant without limits got %s", name)
		}
	}
	p.waitIdle(t)
}

// The reset headers read as Go's (and OpenAI's) durations do.
func TestAppendMillisIsDurationString(t *testing.T) {
	for _, ms := range []int64{0, 1, 20, 999, 1000, 1001, 1500, 1230, 59_999, 60_000, 61_500, 360_000, 3_599_999, 3_600_000, 3_661_001, 90_000_000} {
		d := time.Duration(ms) * time.Millisecond
		if got, want := string(appendMillis(nil, d)), d.String(); got != want {
			t.Errorf("%d ms: %q, want %q", ms, got, want)
		}
	}
	if allocs := testing.AllocsPerRun(100, func() {
		var buf [24]byte
		appendMillis(buf[:0], 61500*time.Millisecond)
	}); allocs != 0 {
		t.Errorf("%v allocations", allocs)
	}
}
