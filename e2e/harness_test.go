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
	"sync"
	"syscall"
	"testing"
	"time"
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
	mu  sync.Mutex
	out strings.Builder
}

func (p *proc) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.Write(b)
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

func start(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(filepath.Join(binDir, name), args...)}
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
		if t.Failed() {
			t.Logf("--- %s output ---\n%s", name, tail(p.output(), 4000))
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

// fleet runs kvmock with n engines on free ports and returns their addresses.
func fleet(t *testing.T, n int, extra ...string) []string {
	t.Helper()
	p := start(t, "kvmock", append([]string{"-n", fmt.Sprint(n), "-base-port", "0"}, extra...)...)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if m := listenRe.FindAllStringSubmatch(p.output(), -1); len(m) == n {
			addrs := make([]string, n)
			for i := range m {
				addrs[i] = m[i][1]
			}
			return addrs
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("kvmock did not start %d engines:\n%s", n, p.output())
	return nil
}

func freePort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

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
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return url, p
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("kvproxy did not become healthy:\n%s", p.output())
	return "", nil
}

type backendRow struct {
	ID            string `json:"id"`
	Healthy       bool   `json:"healthy"`
	Inflight      int64  `json:"inflight"`
	PrefillTokens int64  `json:"prefill_tokens"`
	ActiveBlocks  int64  `json:"active_blocks"`
	IndexedBlocks int64  `json:"indexed_blocks"`
}

func adminBackends(t *testing.T, url string) []backendRow {
	t.Helper()
	resp, err := http.Get(url + "/admin/backends")
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
