package proxy

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
)

// bigCompletion is an engine's completion answer of about size bytes.
func bigCompletion(size int) string {
	return `{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"` + strings.Repeat("x", size) +
		`","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`
}

// Large bodies share limits.body_memory_mb: an engine's answer read whole
// takes its size once its headers declare it, and while it is held, a
// second large answer, or a large request body (of a declared length, or
// chunked), gets a 503 body_memory_full; small ones pass. The room comes
// back once the answer went out, and when a client leaves mid-answer.
func TestLargeBodiesShareTheBodyMemory(t *testing.T) {
	answer := bigCompletion(2 << 20)
	release := make(chan struct{})
	var n atomic.Int64
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" {
			w.WriteHeader(404)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", fmt.Sprint(len(answer)))
		w.WriteHeader(200)
		if k := n.Add(1); k == 1 || k == 4 { // the body when released
			w.(http.Flusher).Flush()
			<-release
		}
		io.WriteString(w, answer)
	})
	p := startProxyYAML(t, `
models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}'}]
limits: {body_memory_mb: 3}
`, &fakeEngine{id: "e0", addr: addr})
	mem := p.s.bodyMem
	var releasing sync.Once
	free := func() { releasing.Do(func() { close(release) }) }
	t.Cleanup(free) // before the proxy's shutdown, which waits for the held request
	const small = `{"model":"m","prompt":"hi","max_tokens":1}`
	first := make(chan int)
	go func() {
		resp, b := post(t, p.url+"/v1/completions", small)
		if len(b) < 2<<20 {
			t.Errorf("the first answer came with %d bytes", len(b))
		}
		first <- resp.StatusCode
	}()
	waitFor(t, "the first answer to take its room", func() bool { return mem.Used() >= 2<<20 })

	refused := func(what string, resp *http.Response, b []byte) {
		t.Helper()
		if resp.StatusCode != 503 || !strings.Contains(string(b), `"code":"body_memory_full"`) || resp.Header.Get("Retry-After") != "1" {
			t.Fatalf("%s: %d %.300s (Retry-After %q), want 503 body_memory_full", what, resp.StatusCode, b, resp.Header.Get("Retry-After"))
		}
	}
	resp, b := post(t, p.url+"/v1/completions", small)
	refused("a second large answer", resp, b)
	if resp.Header.Get(WorkerHeader) != "e0" {
		t.Errorf("the refusal names worker %q, want e0", resp.Header.Get(WorkerHeader))
	}
	large := `{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("y ", 1<<20) + `"}`
	resp, b = post(t, p.url+"/v1/completions", large)
	refused("a large request body", resp, b)
	resp, err := http.Post(p.url+"/v1/completions", "application/json", io.MultiReader(strings.NewReader(large))) // chunked
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	refused("a large chunked request body", resp, b)

	free()
	if code := <-first; code != 200 {
		t.Fatalf("the first request got %d", code)
	}
	waitFor(t, "the first answer's room to come back", func() bool { return mem.Used() == 0 })
	// A large request body read whole gives its room back with its request.
	if resp, b := post(t, p.url+"/v1/completions", strings.Replace(large, `"m"`, `"other"`, 1)); resp.StatusCode != 404 {
		t.Fatalf("a large body for an unknown model: %d %.300s", resp.StatusCode, b)
	}
	waitFor(t, "the large request body's room to come back", func() bool { return mem.Used() == 0 })
	if resp, b := post(t, p.url+"/v1/completions", small); resp.StatusCode != 200 || len(b) < 2<<20 {
		t.Fatalf("after the first: %d, %d bytes", resp.StatusCode, len(b))
	}

	// A client that leaves while its answer's body is awaited gives the
	// room back (the engine's 4th connection sends headers, then waits).
	release, releasing = make(chan struct{}), sync.Once{}
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(small), small)
	waitFor(t, "the abandoned answer to take its room", func() bool { return mem.Used() >= 2<<20 })
	c.Close()
	waitFor(t, "the abandoned answer's room to come back", func() bool { return mem.Used() == 0 })
	p.waitIdle(t)

	m := p.metrics(t)
	for _, want := range []string{`kvproxy_unavailable_total{reason="body_memory_full"} 3`, "kvproxy_body_memory_bytes 0"} {
		if !strings.Contains(m, want+"\n") {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// startBudgetProxy starts a proxy of body_memory_mb mb in front of e, for
// prompts of millions of tokens.
func startBudgetProxy(t *testing.T, mb int, e *fakeEngine) *testProxy {
	t.Helper()
	return startProxyYAML(t, fmt.Sprintf(`
models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}'}]
limits: {body_memory_mb: %d, max_prompt_tokens: 4000000}
`, mb), e)
}

// budgetEngine answers completions as their prompt says: "big" a 2 MiB
// answer, "huge" 3 MiB, "fail" a 500 of 2 MiB, "hold" a small one once
// release is closed; anything else a small one. hits counts completions.
func budgetEngine(t *testing.T, hits *atomic.Int64, release chan struct{}) *fakeEngine {
	big, huge, small := bigCompletion(2<<20), bigCompletion(3<<20), bigCompletion(10)
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" {
			w.WriteHeader(404)
			return
		}
		hits.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		switch {
		case bytes.Contains(b, []byte(`"prompt":"big`)):
			io.WriteString(w, big)
		case bytes.Contains(b, []byte(`"prompt":"huge`)):
			io.WriteString(w, huge)
		case bytes.Contains(b, []byte(`"prompt":"fail`)):
			w.WriteHeader(500)
			io.WriteString(w, `{"error":{"message":"`+strings.Repeat("e", 2<<20)+`","type":"InternalServerError","code":500}}`)
		case bytes.Contains(b, []byte(`"prompt":"hold`)):
			<-release
			io.WriteString(w, small)
		default:
			io.WriteString(w, small)
		}
	})
	return &fakeEngine{id: "e0", addr: addr}
}

// A request or an answer larger than the whole budget is refused for good
// (413, 502), not told to retry: it would never fit, and each retry would
// run the engine again. A body decompressed counts at its decompressed
// size. An attempt's answer that is not relayed (an engine's 500, retried
// on another) gives its room back at once: the client gets the engine's
// error, not a 503 for the memory its own first attempt held.
func TestBodiesBeyondTheBudget(t *testing.T) {
	var hits, hits2 atomic.Int64
	e, e2 := budgetEngine(t, &hits, nil), budgetEngine(t, &hits2, nil)
	e2.id = "e1"
	p := startProxyYAML(t, `
models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}'}, {id: e1, url: 'http://{{e1}}'}]
limits: {body_memory_mb: 3, max_prompt_tokens: 4000000}
`, e, e2)
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"huge","max_tokens":1}`)
	if resp.StatusCode != 502 || !strings.Contains(string(b), "limits.body_memory_mb") || hits.Load()+hits2.Load() != 1 {
		t.Fatalf("an answer over the budget: %d %.300s, %d engine hits; want one 502", resp.StatusCode, b, hits.Load()+hits2.Load())
	}
	withBody := `{"model":"m","max_tokens":1,"prompt":"big ` + strings.Repeat("y ", 3<<18) + `"}` // 1.5 MiB
	if resp, b := post(t, p.url+"/v1/completions", withBody); resp.StatusCode != 502 || !strings.Contains(string(b), "limits.body_memory_mb") || hits.Load()+hits2.Load() != 2 {
		t.Fatalf("an answer over what its request's body leaves of the budget: %d %.300s, %d engine hits; want one 502", resp.StatusCode, b, hits.Load()+hits2.Load())
	}
	large := `{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("y ", 2<<20) + `"}`
	if resp, b := post(t, p.url+"/v1/completions", large); resp.StatusCode != 413 || !strings.Contains(string(b), "limits.body_memory_mb") {
		t.Fatalf("a request body over the budget: %d %.300s, want 413", resp.StatusCode, b)
	}
	var zb bytes.Buffer
	zw := gzip.NewWriter(&zb)
	zw.Write([]byte(large))
	zw.Close()
	req, _ := http.NewRequest("POST", p.url+"/v1/completions", &zb)
	req.Header.Set("Content-Encoding", "gzip")
	if status, body := doAuth(t, req, ""); status != 413 || !strings.Contains(body, "limits.body_memory_mb") {
		t.Fatalf("a request body over the budget once decompressed (%d bytes sent): %d %.300s, want 413", zb.Len(), status, body)
	}
	// A body declared beyond the budget is refused before it is read (it
	// was read up to the whole budget first, taking it from every other
	// body), and one that waits with Expect: 100-continue is refused
	// before it is sent.
	for _, expect := range []string{"", "Expect: 100-continue\r\n"} {
		c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n", expect, 4<<20)
		if expect == "" {
			c.Write(bytes.Repeat([]byte(" "), 16<<10)) // past what fasthttp reads before the handler
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil || resp.StatusCode != 413 {
			t.Fatalf("a body declared beyond the budget, %q: %v %v", expect, resp, err)
		}
		b, _ := io.ReadAll(resp.Body)
		c.Close()
		if !strings.Contains(string(b), "limits.body_memory_mb") {
			t.Fatalf("a body declared beyond the budget, %q: %s", expect, b)
		}
	}
	if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"fail","max_tokens":1}`); resp.StatusCode != 500 || hits.Load()+hits2.Load() != 4 {
		t.Fatalf("two engines' 500s of 2 MiB: %d %.300s, %d engine hits; want the 500 after a retry", resp.StatusCode, b, hits.Load()+hits2.Load())
	}
	waitFor(t, "the room to come back", func() bool { return p.s.bodyMem.Used() == 0 })
	p.waitIdle(t)
}

// A request whose connection is hijacked to close it (its client hung up)
// gives back its body's room even when the hijack fails: a pipelined
// request's hang-up with a reset, with the answer before it not yet
// flushed, left fasthttp's request never reset, and its room taken for
// good (the review).
func TestHijackedRequestGivesBackItsRoom(t *testing.T) {
	var hits atomic.Int64
	release := make(chan struct{})
	defer close(release)
	p := startBudgetProxy(t, 64, budgetEngine(t, &hits, release))
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	small := `{"model":"m","prompt":"hi","max_tokens":1}`
	held := `{"model":"m","max_tokens":1,"prompt":"hold ` + strings.Repeat("y ", 1200<<10) + `"}`
	var both bytes.Buffer // in one write: the second is there when the first is answered, which is not flushed
	for _, body := range []string{small, held} {
		fmt.Fprintf(&both, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	}
	go c.Write(both.Bytes())
	waitFor(t, "the held request to reach the engine", func() bool { return hits.Load() == 2 && p.s.bodyMem.Used() >= 2<<20 })
	c.(*net.TCPConn).SetLinger(0) // a reset: the flush of the first answer fails
	c.Close()
	waitFor(t, "the hung-up request's room to come back", func() bool { return p.s.bodyMem.Used() == 0 })
}

// A small body is not charged the size of a pooled buffer a large one left
// (the review: a 20 KB request held 3 MiB of the budget, and a 2 MiB
// answer beside it got a 503). A compressed body whose two copies, as
// sent and decompressed, could never fit together gets a 413, not a 503
// to retry for ever.
func TestBodyBudgetCountsWhatABodyNeeds(t *testing.T) {
	var hits atomic.Int64
	release := make(chan struct{})
	defer close(release)
	p := startBudgetProxy(t, 4, budgetEngine(t, &hits, release))
	for range 4 { // large bodies, read whole, their buffers pooled
		if resp, b := post(t, p.url+"/v1/completions", `{"model":"other","prompt":"`+strings.Repeat("y", 3<<20)+`"}`); resp.StatusCode != 404 {
			t.Fatalf("%d %.300s", resp.StatusCode, b)
		}
	}
	waitFor(t, "the large bodies' room to come back", func() bool { return p.s.bodyMem.Used() == 0 })
	send := func(body string, chunked bool) {
		var r io.Reader = strings.NewReader(body)
		if chunked { // no length declared (the soak: such a body was charged the pooled array whole)
			pr, pw := io.Pipe()
			go func() {
				time.Sleep(50 * time.Millisecond) // after the headers: read from the stream
				io.WriteString(pw, body)
				pw.Close()
			}()
			r = pr
		}
		if resp, err := http.Post(p.url+"/v1/completions", "application/json", r); err == nil {
			resp.Body.Close()
		}
	}
	small := `{"model":"m","max_tokens":1,"prompt":"hold ` + strings.Repeat("z", 20<<10) + `"}`
	for i := range 4 {
		go send(small, i%2 == 1)
	}
	waitFor(t, "the small requests to reach the engine", func() bool { return hits.Load() == 4 })
	if used := p.s.bodyMem.Used(); used != 0 {
		t.Fatalf("4 bodies of 20 KB, 2 of them chunked, hold %d bytes of the budget", used)
	}
	// A body over 1 MiB after bodies of 3 MiB is charged its own size (the
	// soak: it was charged a pooled array's).
	mid := `{"model":"m","max_tokens":1,"prompt":"hold ` + strings.Repeat("w", 1200<<10) + `"}`
	go send(mid, false)
	waitFor(t, "the 1.2 MiB request to reach the engine", func() bool { return hits.Load() == 5 })
	if used := p.s.bodyMem.Used(); used != int64(len(mid)) {
		t.Fatalf("a body of %d bytes holds %d bytes of the budget", len(mid), used)
	}

	random := make([]byte, 2<<20)
	rand.Read(random)
	text := base64.StdEncoding.EncodeToString(random) // 2.7 MiB, about 2 MiB gzipped: each fits alone
	var zb bytes.Buffer
	zw := gzip.NewWriter(&zb)
	zw.Write([]byte(`{"model":"m","max_tokens":1,"prompt":"` + text + `"}`))
	zw.Close()
	req, _ := http.NewRequest("POST", p.url+"/v1/completions", &zb)
	req.Header.Set("Content-Encoding", "gzip")
	if status, body := doAuth(t, req, ""); status != 413 || !strings.Contains(body, "limits.body_memory_mb") {
		t.Fatalf("a body whose copies could never fit together: %d %.300s, want 413", status, body)
	}
}

// An HTTP/1.0 stream keeps its request body's room in the budget until its
// relay ends, as an HTTP/1.1 stream does until its request ends (the
// soak: given back when the connection was hijacked, the bodies of
// HTTP/1.0 streams stayed in memory uncounted, and took past the budget).
func TestHTTP10StreamKeepsItsBodysRoom(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.tokenEvery = 10, 30*time.Millisecond })
	p := startProxyYAML(t, `models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
limits: {body_memory_mb: 64, max_prompt_tokens: 4000000}
`, e)
	body := `{"model":"m","stream":true,"prompt":"` + strings.Repeat("v", 2<<20) + `"}`
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	br := bufio.NewReader(c)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("the stream ended before its first event: %v", err)
		}
		if strings.HasPrefix(line, "data: {") {
			break
		}
	}
	if used := p.s.bodyMem.Used(); used < int64(len(body)) {
		t.Fatalf("an HTTP/1.0 stream of a %d-byte body holds %d bytes of the budget while it runs", len(body), used)
	}
	if rest, err := io.ReadAll(br); err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("the stream's end: %v %q", err, rest)
	}
	waitFor(t, "the stream's room to come back", func() bool { return p.s.bodyMem.Used() == 0 })
}

// A small request does not pin a large body's array, uncharged: each
// large body, charged and given back, left its array to a small one,
// whose request held it while the budget showed nothing (the review:
// 35-65 MiB of live heap under a 4 MiB budget after 40 rounds of 3 MiB
// bodies). Bodies just under 1 MiB, not charged, did the same through the
// pool of arrays up to 1 MiB, before it had size classes.
func TestSmallRequestsPinNoLargeArray(t *testing.T) {
	for _, size := range []int{3 << 20, 1<<20 - 64} {
		t.Run(fmt.Sprint(size), func(t *testing.T) { smallRequestsPinNoLargeArray(t, size) })
	}
}

func smallRequestsPinNoLargeArray(t *testing.T, size int) {
	var hits atomic.Int64
	release := make(chan struct{})
	p := startBudgetProxy(t, 4, budgetEngine(t, &hits, release))
	large := `{"model":"other","prompt":"` + strings.Repeat("y", size-30) + `"}`
	small := `{"model":"m","max_tokens":1,"prompt":"hold ` + strings.Repeat("z", 20<<10) + `"}`
	// Two collections: the first moves what the pools hold to their
	// victim caches, the second frees it, pinned arrays alone stay.
	heap := func() int64 { runtime.GC(); return liveHeap() }
	base := settledHeap()
	const rounds = 40
	var done sync.WaitGroup
	defer done.Wait()
	defer close(release)
	for i := range rounds {
		if resp, b := post(t, p.url+"/v1/completions", large); resp.StatusCode != 404 {
			t.Fatalf("%d %.300s", resp.StatusCode, b)
		}
		waitFor(t, "the large body's room to come back", func() bool { return p.s.bodyMem.Used() == 0 })
		done.Go(func() {
			if resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(small)); err == nil {
				resp.Body.Close()
			}
		})
		waitFor(t, "the small request to reach the engine", func() bool { return hits.Load() == int64(i+1) })
	}
	if grown := heap() - base; grown > 12<<20 { // about 5.5 MiB with size classes, 23 without
		t.Fatalf("%d small requests in flight grew the live heap %d MiB, the 4 MiB budget showing %d bytes used", rounds, grown>>20, p.s.bodyMem.Used())
	}
}

// A request's body is charged its own size, whatever large bodies came
// before it: with pooled arrays charged whole, the same request, 2.1 MiB
// with a 4.5 MiB answer under 8 MiB, got 200, a 503 or a 502 "larger than
// kvproxy holds at once" as the pool had a 4 MiB array or not (the
// review).
func TestPooledArrayDoesNotMakeARequestNeverFit(t *testing.T) {
	answer := bigCompletion(4<<20 + 512<<10)
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", fmt.Sprint(len(answer)))
		io.WriteString(w, answer)
	})
	p := startBudgetProxy(t, 8, &fakeEngine{id: "e0", addr: addr})
	body := `{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("w", 2150<<10) + `"}`
	filler := `{"model":"other","prompt":"` + strings.Repeat("y", 4<<20-40) + `"}`
	for round := range 3 {
		if resp, b := post(t, p.url+"/v1/completions", body); resp.StatusCode != 200 {
			t.Fatalf("round %d: %d %.300s", round, resp.StatusCode, b)
		}
		for range 4 { // 4 MiB arrays to the pool
			if resp, b := post(t, p.url+"/v1/completions", filler); resp.StatusCode != 404 {
				t.Fatalf("%d %.300s", resp.StatusCode, b)
			}
		}
		waitFor(t, "the fillers' room to come back", func() bool { return p.s.bodyMem.Used() == 0 })
	}
}

// A decompressed body holds an array of about its own size: the first
// chunk, sized at four times the compressed input, stayed whole behind
// a body that filled a quarter of it, while the budget charged the body's
// length (the review: 3 MiB of incompressible data held 12 MiB).
func TestDecodedBodyHoldsItsOwnSize(t *testing.T) {
	for _, size := range []int{3 << 20, 1<<20 - 4096, 100 << 10} {
		random := make([]byte, size)
		rand.Read(random)
		var zb bytes.Buffer
		zw := gzip.NewWriter(&zb)
		zw.Write(random)
		zw.Close()
		out, _, err := decoded([]byte("gzip"), zb.Bytes(), 64<<20, budgetShare{})
		if err != nil || !bytes.Equal(out, random) {
			t.Fatalf("%d bytes: %v", size, err)
		}
		if cap(out) > len(out)+len(out)/8+64<<10 {
			t.Errorf("%d bytes decompressed hold an array of %d", len(out), cap(out))
		}
	}
}

// The copy of a large stream's body kept for a move (migration_limit) is
// charged as bodies are: it doubled what the stream held, unseen by the
// budget (the twenty-ninth session's review: 12 streams of 2 MiB held 27
// MiB more with migration on); and it is given back when the stream ends.
func TestMigrationCopyOfABodyIsCharged(t *testing.T) {
	var hits atomic.Int64
	release := make(chan struct{})
	p := startProxyYAML(t, `
models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}'}]
limits: {body_memory_mb: 16, max_prompt_tokens: 4000000, migration_limit: 1}
`, budgetEngine(t, &hits, release))
	body := `{"model":"m","stream":true,"max_tokens":1,"prompt":"hold ` + strings.Repeat("z", 2<<20) + `"}`
	done := make(chan struct{})
	go func() {
		defer close(done)
		post(t, p.url+"/v1/completions", body)
	}()
	waitFor(t, "the stream to reach its engine", func() bool { return hits.Load() == 1 })
	if used := p.s.bodyMem.Used(); used < 2*int64(len(body)) {
		close(release)
		t.Fatalf("a %d-byte stream that may move holds %d bytes of the budget, want its body and the copy", len(body), used)
	}
	close(release)
	<-done
	waitFor(t, "the stream's room to come back", func() bool { return p.s.bodyMem.Used() == 0 })
}

// The copy is given back when no engine takes the stream (a refusal, a
// 503 of kvproxy's, an engine down): it stayed charged for good, and the
// budget shrank by a body each time (the second review).
func TestMigrationCopyGoesBackWhenNoEngineTakesIt(t *testing.T) {
	p := serveYAML(t, "models: [{name: m}]\nbackends: [{id: down, url: 'http://"+deadAddr(t)+"', model: m, kind: vllm}]\n"+
		"limits: {body_memory_mb: 16, max_prompt_tokens: 4000000, migration_limit: 1}\n", true)
	body := `{"model":"m","stream":true,"max_tokens":1,"prompt":"hold ` + strings.Repeat("z", 2<<20) + `"}`
	for range 3 {
		if resp, b := post(t, p.url+"/v1/completions", body); resp.StatusCode < 500 {
			t.Fatalf("%d %.200s", resp.StatusCode, b)
		}
	}
	waitFor(t, "the copies' room to come back", func() bool { return p.s.bodyMem.Used() == 0 })
}

// A pooled body array is at most a quarter over the body's length: with
// classes a power of two apart, a 300 KB body held a 512 KiB array for its
// whole request, and a stream waiting for a long prefill with it
// (TestStreamsWaitingForTheirFirstEventHoldLittle).
func TestBodyArraysFitTheirBodies(t *testing.T) {
	for n := 1; n <= maxPooledBody; n += 997 {
		bb := newBodyBuffer(n)
		c := cap(bb.b)
		if c < n || (n > minPooledBody && 4*c > 5*n) || (n <= minPooledBody && c != minPooledBody) {
			t.Fatalf("a %d-byte body got a %d-byte array", n, c)
		}
		bb.Close()
	}
	if c := cap(newBodyBuffer(maxPooledBody).b); c != maxPooledBody {
		t.Fatalf("the largest pooled body got a %d-byte array", c)
	}
}

// A chunked body, its length unknown until it ends, holds an array of its
// class (or past 1 MiB, of its length, which is what it is charged): the
// array doubled as the body came, and once more to read its end, and a
// chunked 300 KB body held 512 KiB, one of exactly 1 MiB 2 MiB charged
// (the review).
func TestChunkedBodiesFitTheirArrays(t *testing.T) {
	for _, n := range []int{20 << 10, 300_000, 1 << 20, 1200 << 10} {
		mem := backends.NewBudget(16 << 20)
		ctx := &fasthttp.RequestCtx{}
		ctx.Request.SetBodyStream(strings.NewReader(strings.Repeat("x", n)), -1)
		b, err := rawBody(ctx, 8<<20, mem)
		if err != nil || len(b) != n {
			t.Fatalf("%d bytes: %d read, %v", n, len(b), err)
		}
		bb := ctx.UserValue(bodyBufferKey{}).(*bodyBuffer)
		if c := cap(bb.b); c < n || 4*c > 5*n {
			t.Errorf("a chunked body of %d bytes holds an array of %d", n, c)
		}
		want := int64(0)
		if n > maxPooledBody {
			want = int64(n)
		}
		if used := mem.Used(); used != want {
			t.Errorf("a chunked body of %d bytes is charged %d, want %d", n, used, want)
		}
		ctx.Request.Reset() // closes the buffer, as fasthttp does after a request
		if used := mem.Used(); used != 0 {
			t.Errorf("a chunked body of %d bytes left %d charged", n, used)
		}
	}
}

// A chunked body as large as the room left in the budget gets in, as the
// same body with its length declared does: its array, full, grew to twice
// its size just to read its end, and a body the budget's size was refused
// 413, one of half the room left 503 (the review).
func TestChunkedBodyTheSizeOfTheRoomFits(t *testing.T) {
	for _, c := range []struct{ budget, held, body int }{{4 << 20, 0, 4 << 20}, {5 << 20, 2 << 20, 2 << 20}} {
		mem := backends.NewBudget(int64(c.budget))
		if !mem.Take(int64(c.held)) {
			t.Fatal("no room for the other body")
		}
		ctx := &fasthttp.RequestCtx{}
		ctx.Request.SetBodyStream(bytes.NewReader(make([]byte, c.body)), -1)
		if b, err := rawBody(ctx, 8<<20, mem); err != nil || len(b) != c.body {
			t.Fatalf("a chunked body of %d bytes with %d of %d taken: %d read, %v", c.body, c.held, c.budget, len(b), err)
		}
		if used := mem.Used(); used != int64(c.held+c.body) {
			t.Fatalf("%d bytes used, want %d", used, c.held+c.body)
		}
		ctx.Request.Reset()
	}
}

// A chunked body one byte over a limit its array fills exactly (the
// default 32 MiB is one) is refused for its size: its array grew, and was
// charged, to read that byte, and a budget without the room for it
// answered 503, retry, which could never succeed (the review).
func TestChunkedBodyOneOverTheLimitIsTooLarge(t *testing.T) {
	for _, max := range []int{1 << 20, 4 << 20} {
		mem := backends.NewBudget(8 << 20)
		mem.Take(int64(8<<20 - max)) // room for a body at the limit, not a byte more
		ctx := &fasthttp.RequestCtx{}
		ctx.Request.SetBodyStream(bytes.NewReader(make([]byte, max+1)), -1)
		if _, err := rawBody(ctx, max, mem); !errors.Is(err, fasthttp.ErrBodyTooLarge) {
			t.Errorf("limit %d: %v, want ErrBodyTooLarge", max, err)
		}
		ctx.Request.Reset()
	}
}

// A compressed body is charged as it decompresses, with its compressed
// copy: only once whole, a request without a tenant's max_concurrency
// decompressed up to twice the body limit uncounted (the review). What it
// took is given back when it fails, or is what the body holds after.
func TestDecompressionIsCharged(t *testing.T) {
	plain := bytes.Repeat([]byte("kv cache "), 6<<20/9) // 6 MiB
	var zb bytes.Buffer
	zw := gzip.NewWriter(&zb)
	zw.Write(plain)
	zw.Close()
	for _, c := range []struct {
		budget, other int64
		want          error
	}{
		{4 << 20, 0, backends.ErrBeyondBudget}, // never fits
		{32 << 20, 28 << 20, backends.ErrOverBudget},
		{32 << 20, 0, nil},
	} {
		mem := backends.NewBudget(c.budget)
		mem.Take(c.other)
		out, held, err := decoded([]byte("gzip"), zb.Bytes(), 16<<20, budgetShare{mem, 0})
		if !errors.Is(err, c.want) && err != c.want {
			t.Fatalf("budget %d, %d held by others: %v, want %v", c.budget, c.other, err, c.want)
		}
		if err != nil {
			if mem.Used() != c.other {
				t.Errorf("a refused decompression left %d charged", mem.Used()-c.other)
			}
			continue
		}
		if !bytes.Equal(out, plain) || held != int64(len(plain)) || mem.Used() != held {
			t.Errorf("decompressed %d bytes, held %d, %d charged", len(out), held, mem.Used())
		}
	}
	// Charged while it grows, past the first MiB, before it is whole.
	mem := backends.NewBudget(32 << 20)
	w := newCappedBuffer(1000, 16<<20, budgetShare{mem, 0})
	w.Write(plain[:3<<20])
	if used := mem.Used(); used < 3<<20 || used != int64(w.allocated) {
		t.Errorf("3 MiB written in chunks of %d bytes in all, %d charged", w.allocated, used)
	}
}

// A body refused for its size gives back its room as it is refused, not
// once the rest of it has been read and dropped (250 ms to 2 s after, for
// a client that stalls or keeps sending; the review).
func TestRefusedBodyGivesBackItsRoomAtOnce(t *testing.T) {
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {body_memory_mb: 64}\n",
		startFake(t, "e0", nil))
	ctx := &fasthttp.RequestCtx{}
	ctx.Request.SetBodyStream(bytes.NewReader(make([]byte, 3<<20)), -1)
	if _, ok := p.s.requestBody(ctx, 2<<20); ok || ctx.Response.StatusCode() != 413 {
		t.Fatalf("a body over the limit: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
	}
	if used := p.s.bodyMem.Used(); used != 0 {
		t.Fatalf("%d bytes still charged to a refused body", used)
	}
	ctx.Request.Reset()
}

// A compressed body that fits the budget, with its compressed copy and
// its join, gets in: the first chunk of its decompression, four times the
// compressed size and charged whole before a byte was written, refused 7
// MiB of random bytes under a budget of 32 (the review).
func TestIncompressibleBodyThatFitsGetsIn(t *testing.T) {
	random := make([]byte, 7<<20)
	rand.Read(random)
	zipped := fasthttp.AppendGzipBytes(nil, random)
	mem := backends.NewBudget(32 << 20)
	own := int64(len(zipped)) // the compressed copy, as rawBody charged it
	mem.Take(own)
	out, held, err := decoded([]byte("gzip"), zipped, 32<<20, budgetShare{mem, own})
	if err != nil || !bytes.Equal(out, random) || held != int64(len(random)) || mem.Used() != own+held {
		t.Fatalf("%v: %d bytes, held %d, %d charged", err, len(out), held, mem.Used())
	}
}

// A body refused for its size is logged as such (the log said
// "undecodable body" of a 413: the verifying trial).
func TestRefusedBodyLoggedForWhatItWas(t *testing.T) {
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {max_request_body_bytes: 2048}\n", startFake(t, "e0", nil))
	resp, _ := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"`+strings.Repeat("x", 4096)+`"}`)
	if resp.StatusCode != 413 {
		t.Fatalf("%d", resp.StatusCode)
	}
	waitFor(t, "the request's line", func() bool { return strings.Contains(p.logs.String(), `"status":413`) })
	if l := p.logs.String(); !strings.Contains(l, "body too large") || strings.Contains(l, "undecodable") {
		t.Fatalf("log: %s", l)
	}
}

// A compressed body whose decompression finds no room gives back its
// compressed copy's room at once, not after the request (the review).
func TestBodyWhoseDecompressionFoundNoRoomGivesBackItsCopy(t *testing.T) {
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {body_memory_mb: 8}\n", startFake(t, "e0", nil))
	random := make([]byte, 3<<20)
	rand.Read(random)
	zipped := fasthttp.AppendGzipBytes(nil, random)
	const other = 4 << 20 // another body's: room for the copy, not for the decompression beside it
	p.s.bodyMem.Take(other)
	defer p.s.bodyMem.Give(other)
	ctx := &fasthttp.RequestCtx{}
	ctx.Request.Header.Set("Content-Encoding", "gzip")
	ctx.Request.SetBodyStream(bytes.NewReader(zipped), -1)
	if _, ok := p.s.requestBody(ctx, 32<<20); ok || ctx.Response.StatusCode() != 503 {
		t.Fatalf("%d %s", ctx.Response.StatusCode(), ctx.Response.Body())
	}
	if used := p.s.bodyMem.Used(); used != other {
		t.Fatalf("%d still charged to the refused body", used-other)
	}
	ctx.Request.Reset()
}
