package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// row is one budget's measurement.
type row struct {
	budget  string // as given
	setting int    // body_memory_mb in force, as kvproxy's serving line says
	peakRSS int64  // bytes
	codes   map[string]int
}

// statuses is "24 × 200, 8 × 503 body_memory_full", the most frequent first.
func (r row) statuses() string {
	keys := make([]string, 0, len(r.codes))
	for k := range r.codes {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		if r.codes[a] != r.codes[b] {
			return r.codes[b] - r.codes[a]
		}
		return strings.Compare(a, b)
	})
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%d × %s", r.codes[k], k)
	}
	return strings.Join(parts, ", ")
}

// budgetLine is the limits line of kvproxy's config for budget b.
func budgetLine(b string) (string, error) {
	if b == "default" {
		return "", nil
	}
	mb, err := strconv.Atoi(b)
	if err != nil || mb < 1 {
		return "", fmt.Errorf("-budgets: %q is neither a positive number of MiB nor default", b)
	}
	return fmt.Sprintf("limits: {body_memory_mb: %d}\n", mb), nil
}

// measure starts kvproxy with budget b in front of the engine at engine,
// sends the rounds, and reads its peak RSS.
func measure(ctx context.Context, bin, engine, b string, o options) (row, error) {
	r := row{budget: b, codes: map[string]int{}}
	limits, err := budgetLine(b)
	if err != nil {
		return r, err
	}
	port, err := freePort()
	if err != nil {
		return r, err
	}
	dir, err := os.MkdirTemp("", "kvmemory")
	if err != nil {
		return r, err
	}
	defer os.RemoveAll(dir)
	cfg := filepath.Join(dir, "kvproxy.yaml")
	listen := "127.0.0.1:" + strconv.Itoa(port)
	yaml := "listen: " + listen + "\nlog_level: info\nmodels: [{name: m}]\n" +
		"backends: [{id: e0, url: 'http://" + engine + "', model: m}]\n" + limits
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		return r, err
	}
	cmd := exec.CommandContext(ctx, bin, "-config", cfg)
	cmd.Env = os.Environ()
	if o.gomemlimit != "" {
		cmd.Env = append(cmd.Env, "GOMEMLIMIT="+o.gomemlimit)
	}
	var logs syncBuffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		return r, err
	}
	defer func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	}()
	url := "http://" + listen
	if err := waitHealthy(ctx, url); err != nil {
		return r, fmt.Errorf("%w:\n%s", err, logs.String())
	}
	r.setting = servingBudget(logs.String())
	client := &http.Client{Timeout: 2 * time.Minute}
	for range o.rounds {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for range o.clients {
			wg.Go(func() {
				code := ask(client, url)
				mu.Lock()
				r.codes[code]++
				mu.Unlock()
			})
		}
		wg.Wait()
		if err := ctx.Err(); err != nil {
			return r, err
		}
	}
	if r.peakRSS, err = peakRSS(cmd.Process.Pid); err != nil {
		return r, err
	}
	return r, nil
}

// ask sends one completion and reads its answer whole, as a client
// would: its status, and the error code of one that is not 200.
func ask(client *http.Client, url string) string {
	resp, err := client.Post(url+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"m","prompt":"a large answer, please","max_tokens":16}`))
	if err != nil {
		return "no answer"
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		io.Copy(io.Discard, resp.Body)
		return "200"
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	code := strconv.Itoa(resp.StatusCode)
	if i := bytes.Index(b, []byte(`"code":"`)); i >= 0 {
		rest := b[i+len(`"code":"`):]
		if j := bytes.IndexByte(rest, '"'); j >= 0 {
			code += " " + string(rest[:j])
		}
	}
	return code
}

// servingBudget is body_memory_mb as kvproxy's "kvproxy serving" line
// gives it (0 if the line does not).
func servingBudget(logs string) int {
	const key = `"body_memory_mb":`
	for line := range strings.SplitSeq(logs, "\n") {
		if i := strings.Index(line, key); i >= 0 && strings.Contains(line, `"kvproxy serving"`) {
			digits := line[i+len(key):]
			if end := strings.IndexFunc(digits, func(r rune) bool { return r < '0' || r > '9' }); end >= 0 {
				digits = digits[:end]
			}
			n, _ := strconv.Atoi(digits)
			return n
		}
	}
	return 0
}

// peakRSS is VmHWM of process pid, in bytes.
func peakRSS(pid int) (int64, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, fmt.Errorf("peak RSS (Linux only): %w", err)
	}
	defer f.Close()
	return parseVmHWM(f)
}

// parseVmHWM reads the VmHWM line of a /proc/PID/status ("VmHWM:  1024 kB").
func parseVmHWM(r io.Reader) (int64, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 3 && f[0] == "VmHWM:" && f[2] == "kB" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmHWM line in /proc/PID/status")
}

func waitHealthy(ctx context.Context, url string) error {
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if resp, err := http.Get(url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return errors.New("kvproxy did not become healthy")
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// buildKVProxy builds ./cmd/kvproxy into dir, from the repository.
func buildKVProxy(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "kvproxy")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/kvproxy")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/kvproxy (run kvmemory from the repository, or give -kvproxy): %v\n%s", err, out)
	}
	return bin, nil
}

// syncBuffer is a bytes.Buffer written by a process's two streams at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
