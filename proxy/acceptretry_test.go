package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// emfileListener fails its first accepts as a process out of descriptors
// does, then accepts; closed, it says so as the real one does.
type emfileListener struct {
	net.Listener
	fails  atomic.Int32
	closed atomic.Bool
	mu     sync.Mutex
	tries  []time.Time
}

func (l *emfileListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	l.tries = append(l.tries, time.Now())
	l.mu.Unlock()
	if !l.closed.Load() && l.fails.Add(-1) >= 0 {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.Addr(), Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

func (l *emfileListener) Close() error {
	l.closed.Store(true)
	return l.Listener.Close()
}

// An accept that fails for want of descriptors (EMFILE) does not stop the
// server: it retries with a growing wait, logs a line a second at most,
// counts each error in kvproxy_accept_errors_total and serves the waiting
// connection as soon as it can. fasthttp's Serve returned on the first one
// and kvproxy exited. A Shutdown while the retries wait ends them at once.
func TestServeSurvivesAcceptErrors(t *testing.T) {
	e := startFake(t, "e0", nil)
	s, logs := newTestServer(t, fmt.Sprintf("models: [{name: m, tokenizer: cl100k_base, template: chatml}]\nbackends: [{id: e0, url: 'http://%s', model: m}]\n", e.addr), true)
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := &emfileListener{Listener: inner}
	ln.fails.Store(5)
	served := make(chan error, 1)
	go func() { served <- s.Serve(ln) }()
	t.Cleanup(func() { s.Shutdown() })

	url := "http://" + inner.Addr().String()
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get(url + "/health")
	if err != nil {
		select {
		case err := <-served:
			t.Fatalf("Serve returned on an accept error: %v", err)
		default:
		}
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/health: %d", resp.StatusCode)
	}
	ln.mu.Lock()
	tries := ln.tries
	ln.mu.Unlock()
	if len(tries) < 6 {
		t.Fatalf("%d accept tries, want 5 failed and one more", len(tries))
	}
	// 5 + 10 + 20 + 40 + 80 ms between the six tries, not a busy loop.
	if d := tries[5].Sub(tries[0]); d < 150*time.Millisecond {
		t.Errorf("5 accept errors retried within %v: no backoff", d)
	}
	if n := strings.Count(logs.String(), "accepting a connection failed"); n != 1 {
		t.Errorf("%d warning lines for 5 errors within a second, want 1:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "accepting connections again") || !strings.Contains(logs.String(), `"hint":"out of file descriptors`) {
		t.Errorf("log:\n%s", logs.String())
	}
	p := &testProxy{s: s, url: url, logs: logs}
	if m := p.metrics(t); !strings.Contains(m, "kvproxy_accept_errors_total 5\n") {
		t.Errorf("/metrics lacks kvproxy_accept_errors_total 5")
	}

	// Failing for good: Shutdown ends the wait between retries at once.
	ln.fails.Store(1 << 30)
	// The accept loop waits for its next connection: one comes, and the
	// accepts after it fail.
	c, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	time.Sleep(1200 * time.Millisecond) // the wait has grown to 1 s
	start := time.Now()
	s.Shutdown()
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("Serve after Shutdown: %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Serve did not return after Shutdown")
	}
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Errorf("Shutdown took %v while accepts were being retried", d)
	}
}

// Which accept errors pass: those of a process out of descriptors or
// memory and those net calls temporary; a closed listener's does not.
func TestTemporaryAcceptError(t *testing.T) {
	op := func(err error) error {
		return &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", err)}
	}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{op(syscall.EMFILE), true},
		{op(syscall.ENFILE), true},
		{op(syscall.ENOBUFS), true},
		{op(syscall.ENOMEM), true},
		{op(syscall.ECONNABORTED), true},
		{&net.OpError{Op: "accept", Net: "tcp", Err: os.ErrDeadlineExceeded}, true},
		{&net.OpError{Op: "accept", Net: "tcp", Err: net.ErrClosed}, false},
		{op(syscall.EINVAL), false},
		{errors.New("something else"), false},
	} {
		if got := temporaryAcceptError(c.err); got != c.want {
			t.Errorf("%v: temporary %v, want %v", c.err, got, c.want)
		}
	}
}
