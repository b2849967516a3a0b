package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/internal/testutil"
)

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "kvproxy-e2e-")
	if err != nil {
		panic(err)
	}
	binDir = dir
	for _, cmd := range []string{"kvproxy", "kvmock"} {
		args := []string{"build", "-o", filepath.Join(dir, cmd)}
		if os.Getenv("KVPROXY_E2E_RACE") != "" {
			args = append(args, "-race")
		}
		out, err := exec.Command("go", append(args, "../cmd/"+cmd)...).CombinedOutput()
		if err != nil {
			fmt.Fprintf(os.Stderr, "building %s: %v\n%s", cmd, err, out)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// proc is a child process whose output is kept for failure reports.
type proc struct {
	cmd *exec.Cmd
	testutil.SyncBuffer
}

func start(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	return startCmd(t, name, exec.Command(filepath.Join(binDir, name), args...))
}

// startLimited starts a program of binDir with at most nofile open files
// (soft and hard: Go raises the soft limit to the hard one at start).
func startLimited(t *testing.T, nofile int, name string, args ...string) *proc {
	t.Helper()
	sh := fmt.Sprintf(`ulimit -n %d && exec "$0" "$@"`, nofile)
	return startCmd(t, name, exec.Command("bash", append([]string{"-c", sh, filepath.Join(binDir, name)}, args...)...))
}

func startCmd(t *testing.T, name string, cmd *exec.Cmd) *proc {
	t.Helper()
	p := &proc{cmd: cmd}
	p.cmd.Stdout, p.cmd.Stderr = p, p
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-done
		}
		if strings.Contains(p.String(), "DATA RACE") {
			t.Errorf("%s reported a data race (built with KVPROXY_E2E_RACE)", name)
		}
		if t.Failed() {
			t.Logf("--- %s output ---\n%s", name, tail(p.String(), 4000))
		}
	})
	return p
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

var listenRe = regexp.MustCompile(`listening on http://([0-9.:]+)`)
var eventsRe = regexp.MustCompile(`kv events (tcp://[0-9.:]+) replay (tcp://[0-9.:]+)`)

// engine is one simulated engine of a kvmock fleet.
type engine struct {
	addr, pub, replay string
}

// fleetWithEvents runs kvmock with KV events on and returns each engine's
// HTTP, publisher and replay addresses, and the process.
func fleetWithEvents(t *testing.T, n int, extra ...string) ([]engine, *proc) {
	t.Helper()
	args := append([]string{"-n", fmt.Sprint(n), "-kv-events"}, extra...)
	if !strings.Contains(strings.Join(extra, " "), "-base-port") {
		args = append(args, "-base-port", "0", "-kv-events-base-port", "0")
	}
	p := start(t, "kvmock", args...)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		out := p.String()
		if m := listenRe.FindAllStringSubmatch(out, -1); len(m) == n {
			ev := eventsRe.FindAllStringSubmatch(out, -1)
			if len(ev) != n {
				t.Fatalf("kvmock did not report its event endpoints:\n%s", out)
			}
			es := make([]engine, n)
			for i := range m {
				es[i] = engine{addr: m[i][1], pub: ev[i][1], replay: ev[i][2]}
			}
			return es, p
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("kvmock did not start %d engines:\n%s", n, p.String())
	return nil, nil
}

// startProxyConfig writes body (everything but listen) as kvproxy's config,
// starts it and waits until it is healthy. It returns the URL, the process
// and the config path (rewrite it and send SIGHUP to reload).
func startProxyConfig(t *testing.T, body string) (string, *proc, string) {
	t.Helper()
	listen := freePort(t)
	path := filepath.Join(t.TempDir(), "kvproxy.yaml")
	if err := os.WriteFile(path, []byte("listen: "+listen+"\n"+body), 0o600); err != nil {
		t.Fatal(err)
	}
	p := start(t, "kvproxy", "-config", path)
	url := "http://" + listen
	waitHealthy(t, url, p)
	return url, p, path
}

func waitHealthy(t *testing.T, url string, p *proc) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("kvproxy did not become healthy:\n%s", p.String())
}

// rewriteConfig replaces kvproxy's config (keeping its listen line) and
// sends SIGHUP.
func rewriteConfig(t *testing.T, p *proc, path, body string) {
	t.Helper()
	old, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	listen := strings.SplitN(string(old), "\n", 2)[0]
	if err := os.WriteFile(path, []byte(listen+"\n"+body), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fleet runs kvmock with n engines on free ports and returns their addresses.
func fleet(t *testing.T, n int, extra ...string) []string {
	t.Helper()
	p := start(t, "kvmock", append([]string{"-n", fmt.Sprint(n), "-base-port", "0"}, extra...)...)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if m := listenRe.FindAllStringSubmatch(p.String(), -1); len(m) == n {
			addrs := make([]string, n)
			for i := range m {
				addrs[i] = m[i][1]
			}
			return addrs
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("kvmock did not start %d engines:\n%s", n, p.String())
	return nil
}

// freePortPair finds a port p such that p and p+1 are both free (kvmock's
// event publisher and replay socket).
func freePortPair(t *testing.T) int {
	t.Helper()
	for i := 0; i < 50; i++ {
		a, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p := a.Addr().(*net.TCPAddr).Port
		b, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+1))
		a.Close()
		if err == nil {
			b.Close()
			if testutil.ClaimPort(p) && testutil.ClaimPort(p+1) {
				return p
			}
		}
	}
	t.Fatal("no pair of free ports")
	return 0
}

// freePort returns a loopback address nothing listens on, never given
// before (testutil.FreePort).
func freePort(t *testing.T) string { return fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t)) }

// kvproxyURL starts kvproxy in front of engines and waits until it answers.
func kvproxy(t *testing.T, engines []string, policy string) (string, *proc) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "listen: %s\nlog_level: info\n", freePort(t))
	b.WriteString("models:\n  - name: mock-model\n    aliases: [default]\n    tokenizer: cl100k_base\n    template: chatml\n    block_size: 16\n")
	b.WriteString("backends:\n")
	for i, a := range engines {
		fmt.Fprintf(&b, "  - {id: mock-%d, url: 'http://%s', model: mock-model, kind: vllm}\n", i, a)
	}
	fmt.Fprintf(&b, "router: {policy: %s}\n", policy)
	path := filepath.Join(t.TempDir(), "kvproxy.yaml")
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	p := start(t, "kvproxy", "-config", path)
	listen := strings.TrimPrefix(strings.SplitN(b.String(), "\n", 2)[0], "listen: ")
	url := "http://" + listen
	waitHealthy(t, url, p)
	return url, p
}

type backendRow struct {
	ID       string `json:"id"`
	KVEvents struct {
		Mode    string           `json:"mode"`
		Events  uint64           `json:"events_received"`
		Clears  uint64           `json:"clears"`
		PerTier map[string]int64 `json:"blocks_per_tier"`
	} `json:"kv_events"`
	Healthy       bool  `json:"healthy"`
	Inflight      int64 `json:"inflight"`
	PrefillTokens int64 `json:"prefill_tokens"`
	ActiveBlocks  int64 `json:"active_blocks"`
	IndexedBlocks int64 `json:"indexed_blocks"`
	// The LoRA adapters the engine lists (nil while unknown).
	Adapters *[]string `json:"adapters"`
	// The engine's metrics as last scraped: its batch's adapters.
	Scrape struct {
		LoRA *struct {
			Running []string `json:"running"`
		} `json:"lora"`
	} `json:"engine_metrics"`
	// The engine's KV capacity as the router holds it (from the engine's
	// vllm:cache_config_info, in the router's blocks).
	CacheBlocks float64 `json:"cache_blocks_estimated"`
	// The load other kvproxy replicas report on the backend.
	Remote struct {
		Inflight int64 `json:"inflight"`
	} `json:"remote"`
}

func adminBackends(t *testing.T, url string) []backendRow {
	t.Helper()
	req, _ := http.NewRequest("GET", url+"/admin/backends", nil)
	req.Header.Set("Authorization", "Bearer admin-key-0005") // ignored without auth
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []backendRow
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatal(err)
	}
	return rows
}

// assertIdle waits until every load counter of every backend is zero.
func assertIdle(t *testing.T, url string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		busy := false
		rows := adminBackends(t, url)
		for _, r := range rows {
			if r.Inflight != 0 || r.PrefillTokens != 0 || r.ActiveBlocks != 0 {
				busy = true
			}
		}
		if !busy {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("load counters not back to zero: %+v", rows)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// engineMetric reads one vLLM metric from a simulated engine.
func engineMetric(t *testing.T, addr, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, name+"{") || strings.HasPrefix(l, name+" ") {
			var v float64
			fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v)
			return v
		}
	}
	t.Fatalf("engine %s has no metric %s", addr, name)
	return 0
}

func readAll(r io.Reader) string {
	b, _ := io.ReadAll(r)
	return string(b)
}
