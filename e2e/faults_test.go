package e2e

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func backendsYAML(addrs map[string]string, extra string) string {
	var b strings.Builder
	b.WriteString("models: [{name: mock-model, aliases: [default], block_size: 16}]\nbackends:\n")
	for _, id := range sortedKeys(addrs) {
		fmt.Fprintf(&b, "  - {id: %s, url: 'http://%s', model: mock-model, kind: vllm}\n", id, addrs[id])
	}
	b.WriteString(extra)
	return b.String()
}

func sortedKeys(m map[string]string) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	for i := range ks {
		for j := i + 1; j < len(ks); j++ {
			if ks[j] < ks[i] {
				ks[i], ks[j] = ks[j], ks[i]
			}
		}
	}
	return ks
}

func streamBody(prompt string, tokens int) string {
	return fmt.Sprintf(`{"model":"default","stream":true,"max_tokens":%d,"ignore_eos":true,"messages":[{"role":"user","content":%q}]}`, tokens, prompt)
}

// openStream starts a streaming chat request and returns the response with
// a reader positioned at the start of the body.
func openStream(t *testing.T, url, body string) (*http.Response, *bufio.Reader) {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("stream status %d: %s", resp.StatusCode, b)
	}
	return resp, bufio.NewReader(resp.Body)
}

// startStreams opens n streams of the given length, reads their first
// events, and returns a function that waits for the rest of each.
func startStreams(t *testing.T, url string, n, tokens int) func() []string {
	t.Helper()
	var wg sync.WaitGroup
	results := make([]string, n)
	for i := 0; i < n; i++ {
		resp, br := openStream(t, url, streamBody(fmt.Sprintf("stream %d", i), tokens))
		if err := readEvents(br, 2); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer resp.Body.Close()
			b, _ := io.ReadAll(br)
			results[i] = string(b)
		}()
	}
	return func() []string {
		wg.Wait()
		return results
	}
}

func readEvents(br *bufio.Reader, n int) error {
	for seen := 0; seen < n; {
		l, err := br.ReadString('\n')
		if err != nil {
			return err
		}
		if strings.HasPrefix(l, "data: ") {
			seen++
		}
	}
	return nil
}

// An engine killed with SIGKILL mid-stream: the client gets an OpenAI error
// event and [DONE], the slot is freed, and traffic moves to the other engine.
func TestEngineKilledMidStream(t *testing.T) {
	a := fleet(t, 1, "-speedup", "4")
	bAddrs, bProc := fleetProc(t, 1, "-speedup", "4")
	url, _, _ := startProxyConfig(t, backendsYAML(map[string]string{"mock-a": a[0], "mock-b": bAddrs[0]}, ""))
	body := strings.Replace(streamBody("a long answer please", 400), `"model":"default"`, `"model":"default","nvext":{"backend_instance_id":"mock-b"}`, 1)
	resp, br := openStream(t, url, body)
	defer resp.Body.Close()
	if err := readEvents(br, 5); err != nil {
		t.Fatal(err)
	}
	bProc.cmd.Process.Signal(syscall.SIGKILL)
	rest, _ := io.ReadAll(br)
	s := string(rest)
	if !strings.Contains(s, `data: {"error":{"message":`) || !strings.HasSuffix(s, "data: [DONE]\n\n") {
		t.Fatalf("stream did not end with an error event and [DONE]:\n%s", tail(s, 600))
	}
	assertIdle(t, url)
	for i := 0; i < 4; i++ {
		resp := chat(t, url, `{"model":"default","max_tokens":2,"messages":[{"role":"user","content":"after the crash"}]}`)
		if w := resp.Header.Get("x-kvproxy-worker"); w != "mock-a" {
			t.Fatalf("request %d after the crash went to %s", i, w)
		}
	}
	assertIdle(t, url)
}

// fleetProc is fleet that also returns the kvmock process.
func fleetProc(t *testing.T, n int, extra ...string) ([]string, *proc) {
	t.Helper()
	p := start(t, "kvmock", append([]string{"-n", fmt.Sprint(n), "-base-port", "0"}, extra...)...)
	var addrs []string
	waitFor(t, 15*time.Second, "kvmock to start", func() bool {
		m := listenRe.FindAllStringSubmatch(p.String(), -1)
		if len(m) != n {
			return false
		}
		for _, x := range m {
			addrs = append(addrs, x[1])
		}
		return true
	})
	return addrs, p
}

// An engine answering 503 (overloaded) is skipped: the request is retried
// on another engine before any byte reached the client.
func TestEngine503IsRetried(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var refused sync.Map
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return // the probe and the scrape: only client requests count as tried
		}
		refused.Store(r.Header.Get("X-Request-Id"), true)
		w.Header().Set("Retry-After", "2")
		w.WriteHeader(503)
		w.Write([]byte(`{"error":{"message":"engine overloaded","type":"server_error"}}`))
	})}
	go srv.Serve(ln)
	defer srv.Close()
	good := fleet(t, 1, "-speedup", "20")
	url, _, _ := startProxyConfig(t, backendsYAML(map[string]string{"busy": ln.Addr().String(), "good": good[0]}, "router: {policy: round_robin}\n"))
	for i := 0; i < 6; i++ {
		resp := chat(t, url, fmt.Sprintf(`{"model":"default","max_tokens":2,"messages":[{"role":"user","content":"q%d"}]}`, i))
		if w := resp.Header.Get("x-kvproxy-worker"); w != "good" {
			t.Fatalf("request %d answered by %q", i, w)
		}
	}
	n := 0
	refused.Range(func(any, any) bool { n++; return true })
	if n == 0 {
		t.Fatal("the busy engine was never tried")
	}
	assertIdle(t, url)
}

func TestSlowHeadersAndOversizedBodies(t *testing.T) {
	engines := fleet(t, 1)
	url, _, _ := startProxyConfig(t, backendsYAML(map[string]string{"m": engines[0]}, "limits: {header_timeout: 500ms, max_request_body_bytes: 4096}\n"))
	c, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, _ := io.ReadAll(c)
	if time.Since(start) > 3*time.Second {
		t.Fatalf("a client that never finished its headers kept the connection %v", time.Since(start))
	}
	if len(b) > 0 && !strings.Contains(string(b), "408") {
		t.Fatalf("slow header answer: %q", b)
	}
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"default","messages":[{"role":"user","content":"`+strings.Repeat("x", 8000)+`"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 413 || !strings.Contains(string(body), `"code":"request_too_large"`) {
		t.Fatalf("oversized body: %d %s", resp.StatusCode, body)
	}
	chat(t, url, `{"model":"default","max_tokens":2,"messages":[{"role":"user","content":"still serving"}]}`)
	assertIdle(t, url)
}

// A reload that swaps the fleet during streams: the streams finish on the
// removed backend, new requests go to the added one.
func TestReloadDuringStreams(t *testing.T) {
	engines := fleet(t, 2, "-speedup", "4")
	url, p, path := startProxyConfig(t, backendsYAML(map[string]string{"old": engines[0]}, ""))
	rest := startStreams(t, url, 4, 150)
	rewriteConfig(t, p, path, backendsYAML(map[string]string{"new": engines[1]}, ""))
	waitFor(t, 5*time.Second, "the new backend to serve", func() bool {
		resp := chat(t, url, `{"model":"default","max_tokens":1,"messages":[{"role":"user","content":"who?"}]}`)
		return resp.Header.Get("x-kvproxy-worker") == "new"
	})
	for _, s := range rest() {
		if strings.Contains(s, `"error"`) || !strings.HasSuffix(s, "data: [DONE]\n\n") {
			t.Fatalf("a stream was disturbed by the reload:\n%s", tail(s, 400))
		}
	}
	waitFor(t, 5*time.Second, "the old backend to be retired", func() bool {
		rows := adminBackends(t, url)
		return len(rows) == 1 && rows[0].ID == "new"
	})
	// An invalid config is rejected; the current one keeps serving.
	rewriteConfig(t, p, path, "models: [{name: broken\n")
	time.Sleep(200 * time.Millisecond)
	chat(t, url, `{"model":"default","max_tokens":1,"messages":[{"role":"user","content":"still here"}]}`)
	if !strings.Contains(p.String(), "reload rejected") {
		t.Fatal("the invalid config was not reported")
	}
	assertIdle(t, url)
}

// SIGTERM: stop accepting, let in-flight streams finish, exit 0.
func TestSIGTERMDrainsStreams(t *testing.T) {
	engines := fleet(t, 1, "-speedup", "4")
	url, p, _ := startProxyConfig(t, backendsYAML(map[string]string{"m": engines[0]}, "limits: {drain_timeout: 20s}\n"))
	rest := startStreams(t, url, 3, 120)
	p.cmd.Process.Signal(syscall.SIGTERM)
	exited := make(chan error, 1)
	go func() { exited <- p.cmd.Wait() }()
	for _, s := range rest() {
		if !strings.HasSuffix(s, "data: [DONE]\n\n") || strings.Contains(s, `"error"`) {
			t.Fatalf("a stream was cut by SIGTERM:\n%s", tail(s, 400))
		}
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("kvproxy exited with %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("kvproxy did not exit after draining")
	}
	if _, err := http.Get(url + "/health"); err == nil {
		t.Fatal("kvproxy still accepts connections after exiting")
	}
}
