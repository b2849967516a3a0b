package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// opsConfig is a config of one mock backend at log_level level.
func opsConfig(t *testing.T, path, level, extra string, m mockSpec) {
	t.Helper()
	y := fmt.Sprintf("listen: 127.0.0.1:0\nlog_level: %s\nmodels:\n  - {name: m, tokenizer: cl100k_base, template: chatml}\n"+
		"backends:\n  - {id: %s, url: \"http://127.0.0.1:%d\", model: m, kind: mock, mock: {speedup: %g}}\n%s", level, m.id, m.port, m.speedup, extra)
	if err := os.WriteFile(path, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
}

// startStream starts a stream of maxTokens and returns once its headers
// are in; done closes when it has ended.
func startStream(t *testing.T, p *proxyRun, maxTokens int) (done chan struct{}) {
	t.Helper()
	started, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		body := fmt.Sprintf(`{"model":"m","prompt":"hello there","max_tokens":%d,"stream":true}`, maxTokens)
		resp, err := http.Post("http://"+p.addr+"/v1/completions", "application/json", strings.NewReader(body))
		close(started)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	<-started
	return done
}

// exitCode waits at most within for the proxy to exit, and gives its code
// back to the channel for the test's cleanup.
func exitCode(t *testing.T, p *proxyRun, within time.Duration) int {
	t.Helper()
	select {
	case code := <-p.code:
		p.code <- code
		return code
	case <-time.After(within):
		t.Fatalf("still running %v later", within)
		return 0
	}
}

// A second SIGTERM during the drain exits at once, and says so, with the
// requests it drops; every exit writes a last line. The drain says how many
// requests it waits for, and a SIGHUP during it is logged as ignored (it
// went unread, without a word).
func TestSecondSignalExitsAtOnce(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	opsConfig(t, cfg, "info", "limits: {drain_timeout: 60s}\n", mockSpec{id: "m0", port: freePort(t), speedup: 0.02})
	p := startProxy(t, cfg)
	startStream(t, p, 4000)
	p.term <- syscall.SIGTERM
	for !strings.Contains(p.logs.String(), `"message":"draining"`) {
		time.Sleep(5 * time.Millisecond)
	}
	p.hup <- syscall.SIGHUP
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(p.logs.String(), `"message":"SIGHUP ignored: shutting down, the configuration is not reloaded"`); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no word of the SIGHUP during the drain:\n%s", p.logs.String())
		}
	}
	t0 := time.Now()
	p.term <- syscall.SIGINT
	if code := exitCode(t, p, 10*time.Second); code != 1 || time.Since(t0) > 2*time.Second {
		t.Fatalf("exit code %d after %v", code, time.Since(t0))
	}
	logs := p.logs.String()
	for _, want := range []string{`"drain_timeout":"1m0s","requests_in_flight":1,`, `"signal":"hangup","requests_in_flight":1,`,
		`"signal":"interrupt","requests_dropped":1,`, `"message":"second signal: exiting without waiting for the requests in flight"`, `{"level":"error","code":1,`, `"message":"kvproxy exited"`} {
		if !strings.Contains(logs, want) {
			t.Errorf("no %s in:\n%s", want, logs)
		}
	}
}

// A drain cut by drain_timeout still ends with the exit line.
func TestDrainTimeoutLogsExit(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	opsConfig(t, cfg, "info", "limits: {drain_timeout: 200ms}\n", mockSpec{id: "m0", port: freePort(t), speedup: 0.02})
	p := startProxy(t, cfg)
	startStream(t, p, 4000)
	p.term <- syscall.SIGTERM
	exitCode(t, p, 10*time.Second) // drain_timeout is 200ms
	logs := p.logs.String()
	if !strings.Contains(logs, "drain timeout: cutting") || !strings.HasSuffix(strings.TrimSpace(logs), `"message":"kvproxy exited"}`) {
		t.Errorf("the log does not end with the exit line:\n%s", logs)
	}
}

// log_level changed in the file applies at the reload, before the reload's
// summary line, which a reload from warn to info lost; a reload rejected
// keeps the level in force.
func TestReloadAppliesLogLevel(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	m := mockSpec{id: "m0", port: freePort(t), speedup: 1000}
	opsConfig(t, cfg, "warn", "", m)
	p := startProxy(t, cfg)
	p.complete(t, false, 4)
	if strings.Contains(p.logs.String(), `"message":"request"`) {
		t.Fatalf("an info line at log_level warn:\n%s", p.logs.String())
	}
	opsConfig(t, cfg, "info", "", m)
	p.reload(t)
	p.complete(t, false, 4)
	logs := p.logs.String()
	if !strings.Contains(logs, `"log_level":"info","was":"warn",`) || !strings.Contains(logs, `"message":"log level changed"`) || !strings.Contains(logs, `"message":"request"`) {
		t.Fatalf("log_level info not applied by the reload:\n%s", logs)
	}
	if !regexp.MustCompile(`"log_level_changed":true,"backends":1,"models":1,"time":"[^"]+","message":"configuration reloaded"`).MatchString(logs) {
		t.Fatalf("no summary line of the reload to info:\n%s", logs)
	}
	opsConfig(t, cfg, "error", "  - {id: other, url: \"http://127.0.0.1:1\", model: m2}\n", m)
	bad := filepath.Join(filepath.Dir(cfg), "tokenizer.json") // not one: the proxy refuses the reload
	os.WriteFile(bad, []byte("{"), 0o644)
	os.WriteFile(cfg, []byte(strings.Replace(mustRead(t, cfg), "models:\n", "models:\n  - {name: m2, tokenizer: "+bad+", template: chatml}\n", 1)), 0o644)
	if why := p.reloadRejected(t); !strings.Contains(why, "model m2") { // the proxy's refusal, not the file's
		t.Fatalf("rejected for %s", why)
	}
	n := strings.Count(p.logs.String(), `"message":"request"`)
	p.complete(t, false, 4)
	if got := strings.Count(p.logs.String(), `"message":"request"`); got != n+1 {
		t.Fatalf("a rejected reload applied its log_level error:\n%s", p.logs.String())
	}
	opsConfig(t, cfg, "error", "", m)
	p.reload(t)
	n = strings.Count(p.logs.String(), `"message":"request"`)
	p.complete(t, false, 4)
	if got := strings.Count(p.logs.String(), `"message":"request"`); got != n {
		t.Fatalf("an info line at log_level error:\n%s", p.logs.String())
	}
}

func mustRead(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// A reload whose file does not load counts as rejected, as one the proxy
// refuses does.
func TestUnloadableReloadIsCounted(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	m := mockSpec{id: "m0", port: freePort(t), speedup: 1000}
	opsConfig(t, cfg, "warn", "", m)
	p := startProxy(t, cfg)
	os.WriteFile(cfg, []byte("models: [\n"), 0o644)
	p.reloadRejected(t)
	opsConfig(t, cfg, "warn", "", m)
	p.reload(t)
	resp, err := http.Get("http://" + p.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`kvproxy_config_reloads_total{result="rejected"} 1`, `kvproxy_config_reloads_total{result="ok"} 1`, "kvproxy_config_last_reload_successful 1"} {
		if !strings.Contains(string(b), want+"\n") {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// The signal that began the shutdown, come again at once, is taken as
// sent twice (coreutils' timeout signals kvproxy and its process group),
// not as a second: kvproxy dropped its requests in flight on two SIGTERMs
// a millisecond apart (the twenty-ninth session's trial). Later, it is a
// second signal.
func TestSignalSentTwiceDrains(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	opsConfig(t, cfg, "info", "limits: {drain_timeout: 60s}\n", mockSpec{id: "m0", port: freePort(t), speedup: 0.02})
	p := startProxy(t, cfg)
	p.c.repeatWindow = time.Second // wide: a loaded machine may take long between the two reads
	startStream(t, p, 4000)
	p.term <- syscall.SIGTERM
	p.term <- syscall.SIGTERM // read once the first is: within the window
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(p.logs.String(), `"message":"the same signal again at once: taken as the first, sent twice"`); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no word of the repeated signal:\n%s", p.logs.String())
		}
	}
	select {
	case code := <-p.code:
		p.code <- code
		t.Fatalf("exited (%d) on the signal sent twice:\n%s", code, p.logs.String())
	case <-time.After(1200 * time.Millisecond):
	}
	p.term <- syscall.SIGTERM
	if code := exitCode(t, p, 10*time.Second); code != 1 || !strings.Contains(p.logs.String(), `"message":"second signal: exiting without waiting for the requests in flight"`) {
		t.Fatalf("exit code %d:\n%s", code, p.logs.String())
	}
}
