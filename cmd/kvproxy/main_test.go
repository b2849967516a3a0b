package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/internal/testutil"
)

// freePort returns a loopback port nothing listens on, never given before.
func freePort(t *testing.T) int { return testutil.FreePort(t) }

type mockSpec struct {
	id      string
	port    int
	speedup float64 // 0: 1000 (fast)
}

// writeConfig writes a config of kind: mock backends to path.
func writeConfig(t *testing.T, path, extra string, mocks ...mockSpec) {
	t.Helper()
	var b strings.Builder
	b.WriteString("listen: 127.0.0.1:0\nlog_level: warn\nmodels:\n  - name: m\n    tokenizer: cl100k_base\n    template: chatml\nbackends:\n")
	for _, m := range mocks {
		sp := m.speedup
		if sp == 0 {
			sp = 1000
		}
		fmt.Fprintf(&b, "  - {id: %s, url: \"http://127.0.0.1:%d\", model: m, kind: mock, mock: {speedup: %g}}\n", m.id, m.port, sp)
	}
	b.WriteString(extra)
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// proxyRun is kvproxy running in this process, driven by signals sent on
// hup and term.
type proxyRun struct {
	c    *command
	hup  chan os.Signal
	term chan os.Signal
	addr string
	code chan int
	logs *syncBuffer
}

// syncBuffer is the log sink the tests read while servers write.
type syncBuffer = testutil.SyncBuffer

func startProxy(t *testing.T, cfgPath string) *proxyRun {
	t.Helper()
	return startProxyWith(t, cfgPath, nil)
}

// startProxyWith is startProxy with set, when not nil, changing the
// command before it runs.
func startProxyWith(t *testing.T, cfgPath string, set func(*command)) *proxyRun {
	t.Helper()
	p := &proxyRun{hup: make(chan os.Signal, 1), term: make(chan os.Signal, 1), code: make(chan int, 1), logs: &syncBuffer{}}
	ready := make(chan string, 1)
	p.c = &command{hup: p.hup, term: p.term, stderr: p.logs, ready: func(a string) { ready <- a }}
	if set != nil {
		set(p.c)
	}
	go func() { p.code <- p.c.run([]string{"-config", cfgPath}) }()
	select {
	case p.addr = <-ready:
	case code := <-p.code:
		t.Fatalf("kvproxy exited with %d at start: %s", code, p.logs.String())
	}
	t.Cleanup(func() {
		select {
		case p.term <- syscall.SIGTERM:
		default: // the test sent one
		}
		select {
		case <-p.code:
		case <-time.After(20 * time.Second):
			t.Errorf("kvproxy did not exit after SIGTERM")
		}
		if t.Failed() {
			t.Logf("kvproxy log:\n%s", p.logs.String())
		}
	})
	return p
}

// reload reloads through POST /admin/reload, answered once done.
func (p *proxyRun) reload(t *testing.T) {
	t.Helper()
	resp, err := http.Post("http://"+p.addr+"/admin/reload", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("reload: %d %s", resp.StatusCode, body)
	}
}

func (p *proxyRun) reloadRejected(t *testing.T) string {
	t.Helper()
	resp, err := http.Post("http://"+p.addr+"/admin/reload", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode == 200 {
		t.Fatalf("reload accepted: %s", body)
	}
	return string(body)
}

func (p *proxyRun) complete(t *testing.T, stream bool, maxTokens int) (int, string) {
	t.Helper()
	body := fmt.Sprintf(`{"model":"m","prompt":"hello there","max_tokens":%d,"stream":%v}`, maxTokens, stream)
	resp, err := http.Post("http://"+p.addr+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func listening(port int) bool {
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// A reload that is rejected (here: a new mock's port is taken) must leave
// nothing of itself running: the mocks it started before failing stop.
func TestRejectedReloadStopsTheMocksItStarted(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	m0, m1 := mockSpec{id: "m0", port: freePort(t)}, mockSpec{id: "m1", port: freePort(t)}
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	m2 := mockSpec{id: "m2", port: taken.Addr().(*net.TCPAddr).Port}
	writeConfig(t, cfg, "", m0)
	p := startProxy(t, cfg)
	writeConfig(t, cfg, "", m0, m1, m2)
	msg := p.reloadRejected(t)
	if !strings.Contains(msg, "m2") {
		t.Fatalf("rejection does not name the backend: %s", msg)
	}
	if listening(m1.port) {
		t.Fatal("a rejected reload left the mock engine it started running")
	}
	// And the same reload succeeds once the port is free.
	taken.Close()
	p.reload(t)
	if code, body := p.complete(t, false, 2); code != 200 {
		t.Fatalf("after the reload: %d %s", code, body)
	}
}

// drain1s bounds how long a removed mock waits for the proxy's connections
// to it (idle probe connections last longer).
const drain1s = "limits: {drain_timeout: 1s}\n"

// A mock removed from the configuration stops once the proxy is done with
// it, and can be added back by a later reload.
func TestReloadStopsRemovedMocks(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	m0, m1 := mockSpec{id: "m0", port: freePort(t)}, mockSpec{id: "m1", port: freePort(t)}
	writeConfig(t, cfg, drain1s, m0, m1)
	p := startProxy(t, cfg)
	// A keep-alive connection to m1, as the proxy's pool holds: m1 drains
	// until it closes (or drain_timeout).
	held := &http.Client{Transport: &http.Transport{}}
	resp, err := held.Get(fmt.Sprintf("http://127.0.0.1:%d/health", m1.port))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	writeConfig(t, cfg, drain1s, m0)
	p.reload(t)
	// Added back while it drains: refused, saying why.
	writeConfig(t, cfg, drain1s, m0, m1)
	if msg := p.reloadRejected(t); !strings.Contains(msg, "still draining") {
		t.Fatalf("re-adding a draining mock: %s", msg)
	}
	writeConfig(t, cfg, drain1s, m0)
	held.CloseIdleConnections() // the last connection goes: m1 stops
	p.c.waitRetired()
	if listening(m1.port) {
		t.Fatal("the removed mock engine still listens")
	}
	writeConfig(t, cfg, drain1s, m0, m1)
	p.reload(t)
	if !listening(m1.port) {
		t.Fatal("the mock engine added back does not listen")
	}
}

// An idle mock a reload removed stops within seconds, not at drain_timeout
// (30 s here): the proxy's health probes and metrics scrapes keep their idle
// connections only just past their next use, and there is none.
func TestRemovedIdleMockStopsSoon(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	m0, m1 := mockSpec{id: "m0", port: freePort(t)}, mockSpec{id: "m1", port: freePort(t)}
	writeConfig(t, cfg, "limits: {drain_timeout: 30s}\n", m0, m1)
	p := startProxy(t, cfg)
	time.Sleep(1500 * time.Millisecond) // probed and scraped at least once
	writeConfig(t, cfg, "limits: {drain_timeout: 30s}\n", m0)
	p.reload(t)
	deadline := time.Now().Add(12 * time.Second)
	for listening(m1.port) {
		if time.Now().After(deadline) {
			t.Fatal("the removed idle mock still listens 12 s after the reload")
		}
		time.Sleep(100 * time.Millisecond)
	}
	writeConfig(t, cfg, "limits: {drain_timeout: 30s}\n", m0, m1)
	p.reload(t)
	if !listening(m1.port) {
		t.Fatal("the mock engine added back does not listen")
	}
}

// Changing a running mock's address by reload must not leave its backend
// pointing where nothing listens: the reload is refused and the mock keeps
// serving where it was.
func TestReloadMovingAMockKeepsItServing(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	m0 := mockSpec{id: "m0", port: freePort(t)}
	writeConfig(t, cfg, "", m0)
	p := startProxy(t, cfg)
	moved := mockSpec{id: "m0", port: freePort(t)}
	writeConfig(t, cfg, "", moved)
	resp, err := http.Post("http://"+p.addr+"/admin/reload", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	for i := 0; i < 3; i++ {
		if code, body := p.complete(t, false, 2); code != 200 {
			t.Fatalf("request %d after moving the mock by reload: %d %s", i, code, body)
		}
	}
}

// SIGHUP and POST /admin/reload at the same time: each reload starts and
// stops mocks; run with -race.
func TestConcurrentReloads(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	mocks := []mockSpec{{id: "m0", port: freePort(t)}}
	writeConfig(t, cfg, "", mocks...)
	p := startProxy(t, cfg)
	for i := 1; i <= 4; i++ {
		mocks = append(mocks, mockSpec{id: fmt.Sprintf("m%d", i), port: freePort(t)})
		writeConfig(t, cfg, "", mocks...)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post("http://"+p.addr+"/admin/reload", "application/json", nil)
			if err == nil {
				resp.Body.Close()
			}
		}()
		p.hup <- syscall.SIGHUP
		wg.Wait()
		p.reload(t) // after the SIGHUP: the loop takes one signal at a time
		if !listening(mocks[i].port) {
			t.Fatalf("the added mock %s does not listen", mocks[i].id)
		}
	}
	if code, body := p.complete(t, false, 2); code != 200 {
		t.Fatalf("after the reloads: %d %s", code, body)
	}
}

// SIGTERM waits for streams at most the drain_timeout of the configuration
// in force, the reloaded one included, ends what is left with an error event
// and [DONE], then exits 0.
func TestDrainTimeoutOfTheReloadedConfig(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	slow := mockSpec{id: "m0", port: freePort(t), speedup: 0.02}
	writeConfig(t, cfg, "limits: {drain_timeout: 60s}\n", slow)
	p := startProxy(t, cfg)
	writeConfig(t, cfg, "limits: {drain_timeout: 300ms}\n", slow)
	p.reload(t)
	started := make(chan struct{})
	ending := make(chan string, 1)
	go func() {
		body := `{"model":"m","prompt":"hello there","max_tokens":4000,"stream":true}`
		resp, err := http.Post("http://"+p.addr+"/v1/completions", "application/json", strings.NewReader(body))
		close(started)
		if err != nil {
			ending <- err.Error()
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		ending <- fmt.Sprintf("%s (read error %v)", b[max(0, len(b)-300):], err)
	}()
	<-started // headers are in: the stream is in flight
	t0 := time.Now()
	p.term <- syscall.SIGTERM
	select {
	case code := <-p.code:
		p.code <- code // for Cleanup
		if code != 0 {
			t.Fatalf("exit code %d", code)
		}
		if d := time.Since(t0); d > 5*time.Second {
			t.Fatalf("drained for %v with drain_timeout 300ms", d)
		}
		select {
		case e := <-ending:
			if !strings.Contains(e, `"code":"shutting_down"`) || !strings.Contains(e, "data: [DONE]\n\n (read error <nil>)") {
				t.Fatalf("the stream cut at the deadline ended with %q", e)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the stream in flight at the drain deadline did not end")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("still draining 10s after SIGTERM with drain_timeout 300ms")
	}
}

// Streams keep flowing, and each ends with [DONE], while reloads add and
// remove a backend under them (run with -race).
func TestReloadDuringStreams(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	m0, m1 := mockSpec{id: "m0", port: freePort(t), speedup: 20}, mockSpec{id: "m1", port: freePort(t), speedup: 20}
	writeConfig(t, cfg, drain1s, m0, m1)
	p := startProxy(t, cfg)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var bad []string
	streams := 0
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				body := `{"model":"m","prompt":"hello there, a prompt of a few words","max_tokens":24,"stream":true}`
				resp, err := http.Post("http://"+p.addr+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					mu.Lock()
					bad = append(bad, err.Error())
					mu.Unlock()
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				mu.Lock()
				streams++
				if resp.StatusCode != 200 || !strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]") || strings.Contains(string(b), `"error"`) {
					bad = append(bad, fmt.Sprintf("%d %q", resp.StatusCode, b))
				}
				mu.Unlock()
			}
		}()
	}
	for i := 0; i < 6; i++ {
		if i%2 == 0 {
			writeConfig(t, cfg, drain1s, m0)
		} else {
			p.c.waitRetired() // m1's port is free again
			writeConfig(t, cfg, drain1s, m0, m1)
		}
		p.reload(t)
		p.reload(t) // the same configuration twice
	}
	close(stop)
	wg.Wait()
	if len(bad) > 0 {
		t.Fatalf("%d of %d streams went wrong, first: %s", len(bad), streams, bad[0])
	}
	if streams == 0 {
		t.Fatal("no stream completed")
	}
	t.Logf("%d streams across 12 reloads", streams)
}

// A mock serves its model's LoRA adapters; a reload that changes them is
// refused like any other change a running mock cannot take (it was
// accepted, and the mock went on serving the old list: found by the
// eleventh session's review).
func TestMockServesTheModelsAdapters(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	port, port1 := freePort(t), freePort(t)
	write := func(adapters string) {
		t.Helper()
		body := fmt.Sprintf("listen: 127.0.0.1:0\nlog_level: warn\nmodels:\n  - {name: m, adapters: [%s], tokenizer: cl100k_base, template: chatml}\n"+
			"backends:\n  - {id: m0, url: \"http://127.0.0.1:%d\", model: m, kind: mock, mock: {speedup: 1000}}\n"+
			"  - {id: m1, url: \"http://127.0.0.1:%d\", model: m, kind: mock, mock: {speedup: 1000}}\n", adapters, port, port1)
		if err := os.WriteFile(cfg, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a-lora")
	p := startProxy(t, cfg)
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/v1/models", port))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"id":"a-lora"`) {
		t.Fatalf("the mock's models: %s", b)
	}
	write("a-lora, b-lora")
	// Both engines are named: the reload named the first only.
	if msg := p.reloadRejected(t); !strings.Contains(msg, "cannot change on reload") || !strings.Contains(msg, "backends m0, m1:") {
		t.Fatalf("changing a mock's adapters: %s", msg)
	}
}

// A simulated engine of a model with tokenizer "engine" tokenizes with its
// default tokenizer, which kvproxy then asks for through /tokenize: it was
// refused at start as an unknown tokenizer (the twenty-sixth session's docs
// review). A repeated prompt is cached, so both sides hash the same ids.
func TestMockOfAnEngineTokenizedModel(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	body := fmt.Sprintf("listen: 127.0.0.1:0\nlog_level: warn\nmodels: [{name: m, tokenizer: engine, block_size: 16}]\n"+
		"backends:\n  - {id: m0, url: \"http://127.0.0.1:%d\", model: m, kind: mock, mock: {speedup: 1000}}\n", freePort(t))
	if err := os.WriteFile(cfg, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg)
	req := `{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"` + strings.Repeat("tokenized by the engine ", 20) + `"}]}`
	var cached float64
	for range 2 {
		resp, err := http.Post("http://"+p.addr+"/v1/chat/completions", "application/json", strings.NewReader(req))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		var out struct {
			Usage struct {
				Details struct {
					Cached float64 `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		json.Unmarshal(b, &out)
		cached = out.Usage.Details.Cached
	}
	if cached < 96 {
		t.Fatalf("the repeated prompt had %v cached tokens", cached)
	}
}
