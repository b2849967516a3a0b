package proxy

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

// TestPassthroughClientHangUp: a client that leaves while the engine works
// on its embeddings request cancels the engine's request and frees the
// router's and the backend's counts.
func TestPassthroughClientHangUp(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	p := startProxy(t, "kv", e)
	body := `{"model":"m","input":"hello"}`
	c := rawPost(t, p, "HTTP/1.1", "/v1/embeddings", body)
	waitFor(t, "the engine to get the request", func() bool { return e.current.Load() == 1 })
	c.Close()
	waitFor(t, "the engine's request to be cancelled", func() bool { return e.aborted.Load() == 1 })
	p.waitIdle(t)
}

// TestPassthroughHTTP10: an HTTP/1.0 client gets the whole answer.
func TestPassthroughHTTP10(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	body := `{"model":"m","input":"hello","stream":true}`
	c := rawPost(t, p, "HTTP/1.0", "/v1/embeddings", body)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	var got struct{ Path, Model string }
	if resp.StatusCode != 200 || json.Unmarshal(b, &got) != nil || got.Path != "/v1/embeddings" || got.Model != "engine-m" {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if sent := e.lastBody(); sent["stream"] != true {
		t.Fatalf("the engine got %v", sent)
	}
	p.waitIdle(t)
}

// TestPassthroughGzip: a gzip body is decoded before it is read and sent
// on uncompressed.
func TestPassthroughGzip(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	var zb bytes.Buffer
	zw := gzip.NewWriter(&zb)
	zw.Write([]byte(`{"model":"alias-m","input":["a","b"]}`))
	zw.Close()
	req, _ := http.NewRequest("POST", p.url+"/v1/embeddings", &zb)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Content-Encoding", "gzip")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if sent := e.lastBody(); sent["model"] != "engine-m" || fmt.Sprint(sent["input"]) != "[a b]" {
		t.Fatalf("the engine got %v", sent)
	}
	p.waitIdle(t)
}

// TestPassthroughQueueAndRefusal: a pass-through request waits for a full
// backend's slot, times out of the queue with a 503 in OpenAI's shape, and
// an engine's 429 comes back as the engine gave it; no count is left.
func TestPassthroughQueueAndRefusal(t *testing.T) {
	// The first holds the only slot far longer than the queue timeout: on a
	// loaded machine (CI with the race detector) 600 ms was not enough, and
	// the second found the slot free.
	slow := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m, max_concurrency: 1}]\n"+
		"limits: {max_queue: 4, queue_timeout: 150ms}\n", slow)
	first := make(chan int, 1)
	go func() {
		resp, _ := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"one"}`)
		first <- resp.StatusCode
	}()
	waitFor(t, "the first request to reach the engine", func() bool { return slow.current.Load() == 1 })
	resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"two"}`)
	var answer struct {
		Error *struct {
			Message, Type string
			Param, Code   any
		}
	}
	json.Unmarshal(b, &answer)
	if resp.StatusCode != 503 || answer.Error == nil || answer.Error.Message == "" || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("queued past its timeout: %d %s", resp.StatusCode, b)
	}
	if code := <-first; code != 200 {
		t.Fatalf("first: %d", code)
	}
	p.waitIdle(t)

	busy := startFake(t, "busy", func(f *fakeEngine) {
		f.status, f.errBody, f.retryAfter = 429, `{"error":{"message":"busy","type":"rate_limit_error","param":null,"code":429}}`, "7"
	})
	p = startProxy(t, "kv", busy)
	resp, b = post(t, p.url+"/v1/rerank", `{"model":"m","query":"q","documents":["a"]}`)
	answer.Error = nil
	json.Unmarshal(b, &answer)
	if resp.StatusCode != 429 || answer.Error == nil || answer.Error.Message != "busy" || resp.Header.Get("Retry-After") != "7" {
		t.Fatalf("engine refusal: %d %s (Retry-After %q)", resp.StatusCode, b, resp.Header.Get("Retry-After"))
	}
	p.waitIdle(t)
}

// TestPassthroughDrainCut: a pass-through request still running at the
// drain deadline is answered 503 and leaves no count behind.
func TestPassthroughDrainCut(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 3 * time.Second })
	p := startProxy(t, "kv", e)
	res := make(chan string, 1)
	go func() {
		resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"one"}`)
		res <- fmt.Sprint(resp.StatusCode, " ", string(b))
	}()
	waitFor(t, "the request to reach the engine", func() bool { return e.current.Load() == 1 })
	if n := p.s.Cut(); n != 1 {
		t.Fatalf("cut %d requests", n)
	}
	if r := <-res; !strings.HasPrefix(r, "503 ") || !strings.Contains(r, `"error"`) {
		t.Fatalf("cut: %s", r)
	}
	p.waitIdle(t)
}

// TestPassthroughHugeAnswer: a pass-through answer is streamed to the
// client as it comes, however large (a big batch of float embeddings went
// over the 64 MiB kvproxy reads whole: a 502, and the engine ejected); a
// non-streamed completion that large fails alone, and the engine stays in.
func TestPassthroughHugeAnswer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	big := bytes.Repeat([]byte("0.123456789,"), (65<<20)/12)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Input, Prompt string }
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/json")
		if req.Input == "big" || req.Prompt == "big" {
			fmt.Fprintf(w, `{"object":"list","data":[{"embedding":[%s1]}]}`, big)
			return
		}
		w.Write([]byte(`{"object":"list","data":[{"embedding":[1]}]}`))
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+ln.Addr().String()+"', model: m}]\n")
	resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"big"}`)
	if want := len(big) + len(`{"object":"list","data":[{"embedding":[1]}]}`); resp.StatusCode != 200 || len(b) != want ||
		resp.Header.Get("Content-Type") != "application/json" || !bytes.HasSuffix(b, []byte(",1]}]}")) {
		t.Fatalf("huge answer: %d, %d bytes of %d: %.300s", resp.StatusCode, len(b), want, b)
	}
	resp, b = post(t, p.url+"/v1/completions", `{"model":"m","prompt":"big"}`)
	var answer struct {
		Error *struct{ Message, Type string }
	}
	json.Unmarshal(b, &answer)
	if resp.StatusCode != 502 || answer.Error == nil || !strings.Contains(answer.Error.Message, "larger than") {
		t.Fatalf("huge unstreamed completion: %d %.300s", resp.StatusCode, b)
	}
	resp, b = post(t, p.url+"/v1/embeddings", `{"model":"m","input":"small"}`)
	if resp.StatusCode != 200 || string(b) != `{"object":"list","data":[{"embedding":[1]}]}` {
		t.Fatalf("the next request: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// TestPassthroughNoLifetime: tokenizing holds no KV memory on the engine,
// so it does not count in the mean request lifetime the kv policy prices
// the wait for memory with; a completion does.
func TestPassthroughNoLifetime(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	lifetime := func() float64 {
		for _, pool := range p.s.st.Load().pools {
			for _, w := range pool.rt.Workers() {
				return w.LifetimeMs
			}
		}
		t.Fatal("no worker")
		return 0
	}
	for i := 0; i < 5; i++ {
		if resp, b := post(t, p.url+"/tokenize", `{"model":"m","prompt":"hello there"}`); resp.StatusCode != 200 {
			t.Fatalf("tokenize: %d %s", resp.StatusCode, b)
		}
	}
	p.waitIdle(t)
	if l := lifetime(); l != 0 {
		t.Fatalf("after tokenize requests alone the mean lifetime is %vms", l)
	}
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"hello there"}`); resp.StatusCode != 200 {
		t.Fatalf("completion: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
	if l := lifetime(); l <= 0 {
		t.Fatalf("after a completion the mean lifetime is %vms", l)
	}
}

// TestRequestAtReplacedBackend: a queued request that a reload's new
// backend (same id, a new URL) takes at once goes to the new engine, and
// reads the new backend's event feed (for its data-parallel ranks) only
// once the feed is set: the backend was put in the pool first, a data race
// with every request routed to it meanwhile.
func TestRequestAtReplacedBackend(t *testing.T) {
	old := startFake(t, "old", func(f *fakeEngine) { f.prefillDelay = 500 * time.Millisecond })
	nu := startFake(t, "new", nil)
	head := "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
		"limits: {max_queue: 4, queue_timeout: 5s}\n" +
		"backends:\n"
	p := startProxyYAML(t, head+"  - {id: e0, url: 'http://{{e0}}', model: m, max_concurrency: 1, kv_events: {mode: http}}\n", old)
	ids := promptIDs(100)
	pushRank(t, p, "e0", 1, ids)
	body := `{"model":"m","prompt":[` + ids + `]}`
	res := make(chan int, 2)
	go func() {
		resp, _ := post(t, p.url+"/v1/completions", body)
		res <- resp.StatusCode
	}()
	waitFor(t, "the first request at the old engine", func() bool { return old.current.Load() == 1 })
	go func() {
		resp, _ := post(t, p.url+"/v1/completions", body)
		res <- resp.StatusCode
	}()
	waitFor(t, "the second request to queue", func() bool { return p.s.queued.Load() == 1 })
	cfg, err := config.Parse([]byte(head + "  - {id: e0, url: 'http://" + nu.addr + "', model: m, max_concurrency: 1, kv_events: {mode: http}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if code := <-res; code != 200 {
			t.Fatalf("status %d", code)
		}
	}
	if old.requests.Load() != 1 || nu.requests.Load() != 1 {
		t.Fatalf("the old engine got %d requests (ranks %q), the new one %d", old.requests.Load(), old.headers, nu.requests.Load())
	}
	p.waitIdle(t)
}

// TestQueuedRankRequestAfterReplace: a request queued across a reload that
// replaced its backend (same id, a new URL), then routed to one of the
// backend's data-parallel ranks, goes to the new engine as one routed to
// rank 0 does; it went to the old backend, the old engine.
func TestQueuedRankRequestAfterReplace(t *testing.T) {
	slow := func(f *fakeEngine) { f.prefillDelay = 600 * time.Millisecond }
	old, nu := startFake(t, "old", slow), startFake(t, "new", slow)
	head := "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
		"limits: {max_queue: 4, queue_timeout: 5s}\n" +
		"backends:\n"
	p := startProxyYAML(t, head+"  - {id: e0, url: 'http://{{e0}}', model: m, max_concurrency: 1, kv_events: {mode: http}}\n", old)
	ids := promptIDs(100)
	body := `{"model":"m","prompt":[` + ids + `]}`
	res := make(chan int, 3)
	send := func() {
		resp, _ := post(t, p.url+"/v1/completions", body)
		res <- resp.StatusCode
	}
	go send()
	waitFor(t, "the first request at the old engine", func() bool { return old.current.Load() == 1 })
	go send()
	go send()
	waitFor(t, "two requests to queue", func() bool { return p.s.queued.Load() == 2 })
	cfg, err := config.Parse([]byte(head + "  - {id: e0, url: 'http://" + nu.addr + "', model: m, max_concurrency: 1, kv_events: {mode: http}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a queued request at the new engine", func() bool { return nu.current.Load() == 1 })
	pushRank(t, p, "e0", 1, ids) // the new engine's rank 1 holds the prompt
	for i := 0; i < 3; i++ {
		if code := <-res; code != 200 {
			t.Fatalf("status %d", code)
		}
	}
	if old.requests.Load() != 1 || nu.requests.Load() != 2 || nu.headers[1].Get("X-Data-Parallel-Rank") != "1" {
		t.Fatalf("the old engine got %d requests (ranks %q), the new one %d", old.requests.Load(), old.headers, nu.requests.Load())
	}
	p.waitIdle(t)
}
