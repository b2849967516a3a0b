package main

import (
	"bufio"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestMain lets a test run this test binary as kvproxy itself (a real
// process with real signals): KVPROXY_TEST_MAIN=1 runs main with the
// arguments after "--".
func TestMain(m *testing.M) {
	if os.Getenv("KVPROXY_TEST_MAIN") == "1" {
		for i, a := range os.Args {
			if a == "--" {
				os.Args = append([]string{"kvproxy"}, os.Args[i+1:]...)
				break
			}
		}
		main()
	}
	os.Exit(m.Run())
}

// child is kvproxy as a process of its own.
type child struct {
	t      *testing.T
	cmd    *exec.Cmd
	lines  chan string
	exited chan error
	mu     sync.Mutex
	log    []string
}

func (c *child) output() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Join(c.log, "\n")
}

const childConfig = "listen: 127.0.0.1:0\nlog_level: info\nmodels:\n  - {name: m, tokenizer: o200k_base}\nbackends:\n  - {id: a, url: \"http://127.0.0.1:1\", model: m}\n"

// startChild runs kvproxy with the config file cfg and the environment
// variables env (NAME=value) added to this process's.
func startChild(t *testing.T, cfg string, env ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$", "--", "-config", cfg)
	cmd.Env = append(append(os.Environ(), "KVPROXY_TEST_MAIN=1"), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{t: t, cmd: cmd, lines: make(chan string, 1024), exited: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			c.mu.Lock()
			c.log = append(c.log, sc.Text())
			c.mu.Unlock()
			c.lines <- sc.Text()
		}
		close(c.lines)
		c.exited <- cmd.Wait()
	}()
	t.Cleanup(func() { cmd.Process.Kill() })
	return c
}

// waitLine waits for a log line containing what, calling each (if set)
// every 2 ms meanwhile, and returns it.
func (c *child) waitLine(what string, each func()) string {
	c.t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		if each != nil {
			each()
		}
		select {
		case l, ok := <-c.lines:
			if !ok {
				c.t.Fatalf("kvproxy exited before %q: %v", what, <-c.exited)
			}
			if strings.Contains(l, what) {
				return l
			}
		case <-time.After(2 * time.Millisecond):
		case <-deadline:
			c.t.Fatalf("no %q", what)
		}
	}
}

// waitServing waits until kvproxy answers HTTP, calling each meanwhile.
// (A SIGTERM before that races proxy.Server's Serve with its Shutdown.)
func (c *child) waitServing(each func()) {
	c.t.Helper()
	l := c.waitLine("kvproxy serving", each)
	var v struct{ Listen string }
	if err := json.Unmarshal([]byte(l), &v); err != nil {
		c.t.Fatal(err)
	}
	for {
		if each != nil {
			each()
		}
		resp, err := http.Get("http://" + v.Listen + "/health")
		if err == nil {
			resp.Body.Close()
			return
		}
	}
}

// waitExit expects the process to exit with status 0 within 20 s.
func (c *child) waitExit(what string) {
	c.t.Helper()
	go func() {
		for range c.lines {
		}
	}()
	select {
	case err := <-c.exited:
		if err != nil {
			c.t.Fatalf("%s: %v\n%s", what, err, c.output())
		}
	case <-time.After(20 * time.Second):
		c.cmd.Process.Kill()
		c.t.Fatalf("%s: kvproxy did not exit within 20 s of SIGTERM\n%s", what, c.output())
	}
}

// A SIGHUP while kvproxy is still starting (loading tokenizers, starting
// engines) must not end the process, whose default action for SIGHUP is to
// exit: config tooling sends SIGHUP right after a deploy.
func TestSIGHUPDuringStartup(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte(childConfig), 0o644)
	c := startChild(t, cfg)
	c.waitLine("kvproxy starting", nil)
	hups := 0
	c.waitServing(func() { c.cmd.Process.Signal(syscall.SIGHUP); hups++ })
	c.cmd.Process.Signal(syscall.SIGTERM)
	c.waitExit("SIGTERM after SIGHUPs during startup")
	t.Logf("%d SIGHUPs during startup", hups)
}

// A SIGTERM sent while a reload runs and another SIGHUP waits is not lost
// (signal delivery drops what the channel has no room for).
func TestSIGTERMWhileReloading(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte(childConfig), 0o644)
	c := startChild(t, cfg)
	c.waitServing(nil)
	// The reload loads a tokenizer for a new model: it takes a while.
	os.WriteFile(cfg, []byte(strings.Replace(childConfig, "models:\n", "models:\n  - {name: m2, tokenizer: cl100k_base}\n", 1)), 0o644)
	c.cmd.Process.Signal(syscall.SIGHUP)
	time.Sleep(20 * time.Millisecond) // that reload is under way; no hook in another process
	c.cmd.Process.Signal(syscall.SIGHUP)
	c.cmd.Process.Signal(syscall.SIGTERM)
	c.waitExit("SIGTERM during a reload")
}
