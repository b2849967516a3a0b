package main

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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

// A SIGHUP while kvproxy is still starting (loading tokenizers, starting
// engines) must not end the process, whose default action for SIGHUP is to
// exit: config tooling sends SIGHUP right after a deploy.
func TestSIGHUPDuringStartup(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nlog_level: info\nmodels:\n  - {name: m, tokenizer: o200k_base}\nbackends:\n  - {id: a, url: \"http://127.0.0.1:1\"}\n"), 0o644)
	cmd := exec.Command(os.Args[0], "-test.run=^$", "--", "-config", cfg)
	cmd.Env = append(os.Environ(), "KVPROXY_TEST_MAIN=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 64)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	waitLine := func(what string, each func()) {
		deadline := time.After(60 * time.Second)
		for {
			if each != nil {
				each()
			}
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatalf("kvproxy exited before %q: %v", what, cmd.Wait())
				}
				if strings.Contains(l, what) {
					return
				}
			case <-time.After(2 * time.Millisecond):
			case <-deadline:
				t.Fatalf("no %q", what)
			}
		}
	}
	waitLine("kvproxy starting", nil)
	hups := 0
	waitLine("kvproxy serving", func() { cmd.Process.Signal(syscall.SIGHUP); hups++ })
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("after %d SIGHUPs during startup and a SIGTERM: %v", hups, err)
	}
	t.Logf("%d SIGHUPs during startup", hups)
}
