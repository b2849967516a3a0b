package main

import (
	"bytes"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// -version prints the build and exits; the start's log line and /metrics
// (kvproxy_build_info) name it too, and log times have milliseconds (the
// operator trial could not order ten requests of one second, nor tell
// which build ran).
func TestVersionAndBuildInfo(t *testing.T) {
	var out bytes.Buffer
	c := &command{stdout: &out, stderr: io.Discard}
	if code := c.run([]string{"-version", "-config", "/nonexistent"}); code != 0 {
		t.Fatalf("-version exited %d", code)
	}
	if line := out.String(); !strings.HasPrefix(line, "kvproxy ") || !strings.Contains(line, runtime.Version()) {
		t.Fatalf("-version printed %q", line)
	}

	cfg := filepath.Join(t.TempDir(), "kvproxy.yaml")
	opsConfig(t, cfg, "info", "", mockSpec{id: "m0", port: freePort(t), speedup: 100})
	p := startProxy(t, cfg)
	logs := p.logs.String()
	if !regexp.MustCompile(`"time":"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"`).MatchString(logs) {
		t.Fatalf("log times without milliseconds:\n%s", logs)
	}
	if !regexp.MustCompile(`"version":"[^"]+".*"message":"kvproxy starting"`).MatchString(logs) {
		t.Fatalf("the start does not name the build:\n%s", logs)
	}
	// Its pid: the process to send SIGHUP, which `go run` is not.
	if !strings.Contains(logs, `"pid":`+strconv.Itoa(os.Getpid())+`,`) {
		t.Fatalf("the start does not give kvproxy's pid (%d):\n%s", os.Getpid(), logs)
	}
	resp, err := http.Get("http://" + p.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !regexp.MustCompile(`kvproxy_build_info\{goversion="` + regexp.QuoteMeta(runtime.Version()) + `",revision="[^"]*",version="[^"]+"\} 1`).Match(b) {
		t.Fatalf("no kvproxy_build_info:\n%s", b)
	}
}

// -h names the tokenize subcommand beside the flags (the README audit:
// nothing said it was there), and exits 0 as flag.ExitOnError's help does.
func TestHelpNamesTheTokenizeCommand(t *testing.T) {
	var errOut bytes.Buffer
	c := &command{stdout: io.Discard, stderr: &errOut}
	if code := c.run([]string{"-h"}); code != 0 {
		t.Fatalf("-h exited %d", code)
	}
	if h := errOut.String(); !strings.Contains(h, "kvproxy tokenize") || !strings.Contains(h, "-config") {
		t.Fatalf("-h printed %q", h)
	}
}

// A configuration named without -config is refused: "kvproxy -check
// prod.yaml" checked the example configuration and said it was valid, and
// "kvproxy prod.yaml" served it (the twenty-sixth session's docs review).
func TestConfigWithoutTheFlagIsRefused(t *testing.T) {
	for _, args := range [][]string{{"prod.yaml"}, {"-check", "prod.yaml"}} {
		var out, errOut bytes.Buffer
		c := &command{stdout: &out, stderr: &errOut}
		if code := c.run(args); code != 2 || !strings.Contains(errOut.String(), `unexpected argument "prod.yaml"`) || out.Len() > 0 {
			t.Fatalf("%q: exit %d, stdout %q, stderr:\n%s", args, code, out.String(), errOut.String())
		}
	}
}
