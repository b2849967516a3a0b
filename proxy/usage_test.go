package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// Every completion an engine took adds its tokens to its model and tenant:
// the engine's usage where the answer has one, else kvproxy's own count
// (the prompt it tokenized, the chunks that carried output). Dry runs and
// pass-through requests add none; every proxied request is timed.
func TestTokensCountedPerTenant(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens = 5 })
	p := startProxyYAML(t, tenantsYAML, e)
	chat := func(extra string) string {
		return `{"model":"m","messages":[{"role":"user","content":"count these tokens please"}]` + extra + `}`
	}
	send := func(key, path, body string) string {
		t.Helper()
		resp, b := postAuth(t, p.url+path, key, body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s %s: %d %s", path, body, resp.StatusCode, b)
		}
		return b
	}
	var dry struct {
		TokenIDs []int `json:"token_ids"`
	}
	if err := json.Unmarshal([]byte(send("key-beta-4567", "/v1/chat/completions", chat(`,"nvext":{"annotations":["query_instance_id"]}`))), &dry); err != nil || len(dry.TokenIDs) == 0 {
		t.Fatalf("dry run: %v %v", err, dry)
	}
	send("key-alpha-123", "/v1/chat/completions", chat(""))                                                        // usage 10 / 1 / 3
	send("key-alpha-123", "/v1/chat/completions", chat(`,"stream":true,"stream_options":{"include_usage":true}`))  // usage 10 / 10 / 3 in 5 chunks
	send("key-beta-4567", "/v1/chat/completions", chat(`,"stream":true,"stream_options":{"include_usage":false}`)) // no usage: counted
	send("key-alpha-123", "/v1/embeddings", `{"model":"m","input":"not a completion"}`)
	p.waitIdle(t)

	m := p.metrics(t)
	want := map[string]int{
		`kvproxy_tokens_total{model="m",tenant="alpha",type="prompt"}`:     20,
		`kvproxy_tokens_total{model="m",tenant="alpha",type="completion"}`: 11,
		`kvproxy_tokens_total{model="m",tenant="alpha",type="cached"}`:     6,
		`kvproxy_tokens_total{model="m",tenant="beta",type="prompt"}`:      len(dry.TokenIDs),
		`kvproxy_tokens_total{model="m",tenant="beta",type="completion"}`:  5,
		`kvproxy_tokens_total{model="m",tenant="beta",type="cached"}`:      0,
		`kvproxy_request_duration_seconds_count{backend="e0"}`:             4,
	}
	for series, v := range want {
		if line := series + " " + itoa(v) + "\n"; !strings.Contains(m, line) {
			t.Errorf("/metrics lacks %q", strings.TrimSpace(line))
		}
	}
	if strings.Count(m, "kvproxy_tokens_total{") != 6 {
		t.Errorf("token series other than alpha's and beta's:\n%s", grepLines(m, "kvproxy_tokens_total{"))
	}
	logs := p.logs.String()
	for _, s := range []string{`"tenant":"alpha","backend":"e0","overlap_blocks"`, `"prompt_tokens":10,"output_tokens":10,"cached_tokens":3`, `"tenant":"beta"`, `"path":"/v1/embeddings"`} {
		if !strings.Contains(logs, s) {
			t.Errorf("access log lacks %s:\n%s", s, logs)
		}
	}
}

// metrics is the proxy's /metrics page.
func (p *testProxy) metrics(t *testing.T) string {
	t.Helper()
	resp, err := http.Get(p.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// usage.read takes the figures of the usage object only, keeps known ones
// where a chunk has none, and ignores the same keys in generated text.
func TestUsageRead(t *testing.T) {
	u := tokenUsage{-1, -1, -1}
	u.read([]byte(`{"choices":[{"delta":{"content":"\"prompt_tokens\":99"}}],"usage":null}`))
	if u != (tokenUsage{-1, -1, -1}) {
		t.Fatalf("after a chunk without usage: %+v", u)
	}
	u.read([]byte(`{"choices":[],"usage":{"prompt_tokens": 12,"completion_tokens":7,"total_tokens":19}}`))
	if u != (tokenUsage{12, 7, -1}) {
		t.Fatalf("usage without details: %+v", u)
	}
	u.read([]byte(`{"usage":{"prompt_tokens":12,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":4}}}`))
	if u != (tokenUsage{12, 8, 4}) {
		t.Fatalf("usage with details: %+v", u)
	}
	u.read([]byte(`{"usage":{"prompt_tokens":"x"}}`))
	if u != (tokenUsage{12, 8, 4}) {
		t.Fatalf("malformed usage changed known figures: %+v", u)
	}
}

// A stream with continuous_usage_stats (usage in every chunk) that the
// engine breaks off before its last chunk counts at least the chunks that
// carried output, not the 0 of the role chunk's usage.
func TestCutStreamWithContinuousUsage(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":0,\"total_tokens\":7}}\n\n")
		for i := 1; i <= 5; i++ {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d\"}}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n", i, i, 7+i)
		}
		w.(http.Flusher).Flush()
		c, _, _ := w.(http.Hijacker).Hijack()
		c.Close() // before the final usage chunk and [DONE]
	}
	p := startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://"+startRawEngine(t, h)+"', model: m}]\n")
	post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"messages":[{"role":"user","content":"hi"}]}`)
	p.waitIdle(t)
	m := p.metrics(t)
	if !strings.Contains(m, `kvproxy_tokens_total{model="m",tenant="",type="completion"} 5`+"\n") || !strings.Contains(m, `kvproxy_tokens_total{model="m",tenant="",type="prompt"} 7`+"\n") {
		t.Fatalf("5 chunks carried output of a 7-token prompt:\n%s", grepLines(m, "kvproxy_tokens_total{"))
	}
}

// Every access log line names the tenant, those of requests refused before
// they reach an engine too.
func TestRefusedRequestsLogTheirTenant(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, tenantsYAML, e)
	got429 := false
	for i := 0; i < 6 && !got429; i++ { // delta: 2 requests/s
		resp, _ := postAuth(t, p.url+"/v1/chat/completions", "key-delta-890", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
		got429 = resp.StatusCode == 429
	}
	if !got429 {
		t.Fatal("no 429")
	}
	postAuth(t, p.url+"/v1/chat/completions", "key-alpha-123", `{"model":"nosuch","messages":[{"role":"user","content":"hi"}]}`)
	for _, want := range []string{`"tenant":"delta","status":429`, `"model":"nosuch","tenant":"alpha","status":404`} {
		if !strings.Contains(p.logs.String(), want) {
			t.Errorf("no log line with %s:\n%s", want, p.logs.String())
		}
	}
}

// Pass-through answers are relayed unread, but their last bytes are kept:
// an embeddings answer's usage (where OpenAI and vLLM put it, at the end)
// counts the tenant's prompt tokens, whatever the answer's size or framing.
// An answer without usage, or compressed, counts none.
func TestPassthroughUsageCounted(t *testing.T) {
	vec := strings.TrimSuffix(strings.Repeat("0.0123456789,", 3000), ",")
	h := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		answer := `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[` + vec + `]}],"model":"m","usage":{"prompt_tokens":17,"total_tokens":17,"completion_tokens":0,"prompt_tokens_details":null}}`
		w.Header().Set("Content-Type", "application/json")
		switch {
		case strings.Contains(string(b), "chunked"):
			w.Write([]byte(answer[:1000]))
			w.(http.Flusher).Flush() // no length: chunked
			w.Write([]byte(answer[1000:]))
		case strings.Contains(string(b), "plain"):
			w.Header().Set("Content-Length", itoa(len(answer)))
			w.Write([]byte(answer))
		default:
			w.Write([]byte(`{"object":"list","data":[]}`)) // no usage
		}
	}
	p := startProxyYAML(t, tenantsYAML, &fakeEngine{addr: startRawEngine(t, h)})
	for _, in := range []string{"plain", "chunked", "none"} {
		resp, b := postAuth(t, p.url+"/v1/embeddings", "key-alpha-123", `{"model":"m","input":"`+in+`"}`)
		if resp.StatusCode != 200 || (in != "none" && !strings.HasSuffix(b, `"prompt_tokens_details":null}}`)) {
			t.Fatalf("%s: %d %.200s", in, resp.StatusCode, b)
		}
	}
	p.waitIdle(t)
	m := p.metrics(t)
	if !strings.Contains(m, `kvproxy_tokens_total{model="m",tenant="alpha",type="prompt"} 34`+"\n") || !strings.Contains(m, `kvproxy_tokens_total{model="m",tenant="alpha",type="completion"} 0`+"\n") {
		t.Fatalf("two embeddings answers of 17 prompt tokens each:\n%s", grepLines(m, "kvproxy_tokens_total{"))
	}
}

// keepTail keeps the last bytes across reads of any size.
func TestRawRelayKeepsTheTail(t *testing.T) {
	var r rawRelay
	var all []byte
	for i, n := range []int{3, 700, 1, 511, 512, 0, 40, 1000, 2} {
		b := []byte(strings.Repeat(string(rune('a'+i)), n))
		r.keepTail(b)
		all = append(all, b...)
		want := all[max(0, len(all)-len(r.tail)):]
		if string(r.tail[:r.tailN]) != string(want) {
			t.Fatalf("after %d reads: tail %q…, want %q…", i+1, r.tail[:min(r.tailN, 20)], want[:min(len(want), 20)])
		}
	}
}
