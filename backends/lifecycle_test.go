package backends

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// restartableEngine answers every request on keep-alive connections; restart
// closes every open connection (as an engine process that restarts on the
// same port does) and returns once they are closed.
type restartableEngine struct {
	addr  string
	mu    sync.Mutex
	conns map[net.Conn]bool
	// hold, while non-nil, makes answers wait until it is closed, so
	// concurrent requests each need a connection of their own.
	hold chan struct{}
}

func newRestartableEngine(t *testing.T) *restartableEngine {
	e := &restartableEngine{conns: map[net.Conn]bool{}}
	e.addr = rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		e.mu.Lock()
		e.conns[c] = true
		e.mu.Unlock()
		for readRequest(br) == nil {
			e.mu.Lock()
			hold := e.hold
			e.mu.Unlock()
			if hold != nil {
				<-hold
			}
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
				return
			}
		}
	})
	return e
}

func (e *restartableEngine) restart() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for c := range e.conns {
		c.Close()
		delete(e.conns, c)
	}
}

// After an engine restart every pooled connection is dead. A request must
// still succeed: it may meet a stale connection once, but its retry must
// not take another stale one from the pool (which the engine never answers
// either, and the proxy would report as a 502).
func TestEngineRestartWithSeveralPooledConnections(t *testing.T) {
	e := newRestartableEngine(t)
	u := &Upstream{Addr: e.addr}
	const n = 4
	hold := make(chan struct{})
	e.mu.Lock()
	e.hold = hold
	e.mu.Unlock()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, resp := newRequest(e.addr, `{}`), fasthttp.AcquireResponse()
			_, err := u.Do(req, resp, false, nil)
			errs <- err
		}()
	}
	// Every request holds a connection of its own before any is answered.
	for {
		e.mu.Lock()
		open := len(e.conns)
		e.mu.Unlock()
		if open == n {
			break
		}
		runtimeGosched()
	}
	e.mu.Lock()
	e.hold = nil
	e.mu.Unlock()
	close(hold)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := len(u.idle); got != n {
		t.Fatalf("%d pooled connections, want %d", got, n)
	}
	e.restart()
	for i := 0; i < n; i++ {
		req, resp := newRequest(e.addr, `{}`), fasthttp.AcquireResponse()
		if _, err := u.Do(req, resp, false, nil); err != nil {
			t.Fatalf("request %d after the engine restarted: %v", i, err)
		}
		if string(resp.Body()) != "ok" {
			t.Fatalf("body %q", resp.Body())
		}
	}
}

// A streamed body cut short by the engine (the connection closes inside a
// chunked body or before Content-Length bytes) must end in an error, never
// a clean EOF: a clean EOF tells the proxy the answer was complete and puts
// a dead connection back in the pool.
func TestTruncatedStreamIsAnError(t *testing.T) {
	for name, answer := range map[string]string{
		"chunked mid-chunk":     "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\ndata: {\"a\"",
		"chunked between":       "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
		"content-length":        "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly a part",
		"chunked bad size line": "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
				readRequest(br)
				io.WriteString(c, answer)
			})
			u := &Upstream{Addr: addr}
			req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
			body, err := u.Do(req, resp, true, nil)
			if err != nil {
				return // refused at the headers: fine
			}
			_, err = io.ReadAll(body)
			body.Close()
			if err == nil {
				t.Fatal("truncated body read to a clean EOF")
			}
			if name != "chunked bad size line" && !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("truncated body ended with %v", err)
			}
			if len(u.idle) != 0 {
				t.Fatal("connection of a truncated answer was pooled")
			}
		})
	}
}

func runtimeGosched() { runtime.Gosched() }

// An engine that took a request on a pooled connection and died after
// sending part of its answer must not get the request again: it was not a
// stale connection (the engine saw the request), and a completion is not
// idempotent.
func TestPartialAnswerOnPooledConnectionIsNotResent(t *testing.T) {
	for name, partial := range map[string]string{
		"headers only": "HTTP/1.1 200 OK\r\n",
		"part of body": "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly a part",
	} {
		t.Run(name, func(t *testing.T) {
			var mu sync.Mutex
			received := 0
			addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
				for readRequest(br) == nil {
					mu.Lock()
					received++
					n := received
					mu.Unlock()
					if n == 1 {
						io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
						continue
					}
					io.WriteString(c, partial)
					return // the engine dies
				}
			})
			u := &Upstream{Addr: addr}
			for i := 0; i < 2; i++ {
				req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
				_, err := u.Do(req, resp, false, nil)
				if i == 0 && err != nil {
					t.Fatal(err)
				}
				if i == 1 && err == nil {
					t.Fatal("a partial answer passed for a whole one")
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if received != 2 {
				t.Fatalf("the engine received %d requests, want 2: a request it had begun answering was sent again", received)
			}
		})
	}
}

// An engine announcing an absurd Content-Length (a bug, a proxy in between,
// garbage) must cost an error, not an allocation of that size: fasthttp
// allocates a fixed-size body up front, and a failed allocation takes the
// whole process down.
func TestHugeContentLengthIsRefused(t *testing.T) {
	for _, stream := range []bool{false, true} {
		addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
			readRequest(br)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1125899906842624\r\n\r\n{\"id\":")
		})
		u := &Upstream{Addr: addr}
		req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
		body, err := u.Do(req, resp, stream, nil)
		if body != nil {
			_, err = io.ReadAll(body)
			body.Close()
		}
		if err == nil {
			t.Fatalf("stream=%v: a 1 PiB answer was accepted", stream)
		}
	}
}

// An answer read whole stops at MaxBodySize, whatever its framing.
func TestWholeAnswerIsBounded(t *testing.T) {
	for name, answer := range map[string]string{
		"content-length": "HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n" + strings.Repeat("x", 4096),
		"chunked":        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + strings.Repeat("400\r\n"+strings.Repeat("x", 1024)+"\r\n", 4) + "0\r\n\r\n",
		"until close":    "HTTP/1.1 200 OK\r\n\r\n" + strings.Repeat("x", 4096),
	} {
		t.Run(name, func(t *testing.T) {
			addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
				readRequest(br)
				io.WriteString(c, answer)
			})
			u := &Upstream{Addr: addr, MaxBodySize: 1024}
			req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
			if _, err := u.Do(req, resp, false, nil); !errors.Is(err, fasthttp.ErrBodyTooLarge) {
				t.Fatalf("a 4 KiB answer with MaxBodySize 1 KiB: err %v, body %d bytes", err, len(resp.Body()))
			}
		})
	}
}

// A health endpoint answering with an absurd Content-Length is a failed
// probe, not a panic of the prober's goroutine (which ends the process).
func TestProbeOfHugeAnswerFails(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 1125899906842624\r\n\r\nok")
		}
	})
	p := NewProber(ProbeConfig{Interval: time.Hour, Timeout: time.Second, Fall: 1})
	changed := make(chan bool, 4)
	p.Add("a", ProbeURL{URL: "http://" + addr + "/health"}, func(ok bool, _ string) { changed <- ok })
	p.Start()
	defer p.Stop()
	select {
	case ok := <-changed:
		if ok {
			t.Fatal("probe passed")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no probe result")
	}
}

// With rise: 3, an engine that was failing its probes is readmitted after
// three good probes in a row, not after the first.
func TestProbeRiseNeedsConsecutiveSuccesses(t *testing.T) {
	var mu sync.Mutex
	probes := 0
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			mu.Lock()
			probes++
			n := probes
			mu.Unlock()
			status := "200 OK"
			if n == 2 || n == 3 {
				status = "503 Service Unavailable"
			}
			io.WriteString(c, "HTTP/1.1 "+status+"\r\nContent-Length: 0\r\n\r\n")
		}
	})
	const rise = 3
	p := NewProber(ProbeConfig{Interval: 5 * time.Millisecond, Timeout: time.Second, Rise: rise, Fall: 2})
	type change struct {
		healthy bool
		probe   int
	}
	changes := make(chan change, 16)
	p.Add("a", ProbeURL{URL: "http://" + addr + "/health"}, func(ok bool, _ string) {
		mu.Lock()
		n := probes
		mu.Unlock()
		changes <- change{ok, n}
	})
	p.Start()
	defer p.Stop()
	next := func() change {
		select {
		case c := <-changes:
			return c
		case <-time.After(10 * time.Second):
			t.Fatal("no health change")
		}
		return change{}
	}
	if c := next(); !c.healthy || c.probe != 1 { // every good probe is told while up
		t.Fatalf("first report %+v, want healthy at probe 1", c)
	}
	if c := next(); c.healthy || c.probe != 3 {
		t.Fatalf("then %+v, want unhealthy at probe 3 (fall 2)", c)
	}
	if c := next(); !c.healthy || c.probe != 3+rise {
		t.Fatalf("readmitted at probe %d, want %d (rise %d after 2 failures)", c.probe, 3+rise, rise)
	}
}

// An engine that has never answered a probe is not trusted past its first
// failure (at start, or a backend a reload adds): fall is for engines that
// have. Re-adding the same engine (a reload that rebuilds its backend)
// keeps what its probes have found, and says at once that it is down.
func TestProbeStateOfANewAndAReaddedEngine(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
		}
	})
	p := NewProber(ProbeConfig{Interval: time.Hour, Timeout: time.Second, Rise: 1, Fall: 3})
	changes := make(chan bool, 4)
	u := ProbeURL{URL: "http://" + addr + "/health"}
	p.Add("a", u, func(ok bool, _ string) { changes <- ok })
	p.Start()
	defer p.Stop()
	select {
	case ok := <-changes:
		if ok {
			t.Fatal("a failing first probe reported healthy")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a failing first probe left the engine up (fall 3 was applied to an engine never seen up)")
	}
	again := make(chan string, 4)
	p.Add("a", u, func(ok bool, why string) { again <- fmt.Sprint(ok, " ", why) })
	if got := <-again; got != "false status 503" {
		t.Fatalf("re-added: %q, want it down at once with the last probe's error", got)
	}
	other := make(chan bool, 4)
	p.Add("a", ProbeURL{URL: "http://" + addr + "/v1/models"}, func(ok bool, _ string) { other <- ok })
	select {
	case ok := <-other: // its first probe, an hour before the next
		if ok {
			t.Fatal("another URL's first probe reported healthy")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a new URL was not probed")
	}
}

// A SIGTERM right at start-up stops the prober while it is being started,
// possibly twice (run with -race: Start's goroutines were added to the
// wait group Stop was already waiting on, and two Stops could both close).
func TestProberStopRacingStart(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
		}
	})
	for i := 0; i < 20; i++ {
		p := NewProber(ProbeConfig{Interval: time.Millisecond})
		p.Add("a", ProbeURL{URL: "http://" + addr + "/health"}, func(bool, string) {})
		var wg sync.WaitGroup
		wg.Add(3)
		go func() { defer wg.Done(); p.Start() }()
		go func() { defer wg.Done(); p.Stop() }()
		go func() { defer wg.Done(); p.Stop() }()
		wg.Wait()
		// Once stopped, nothing starts again.
		p.Start()
		p.Add("b", ProbeURL{URL: "http://" + addr + "/health"}, func(bool, string) {})
		p.mu.Lock()
		running := p.running && !p.stopped
		p.mu.Unlock()
		if running {
			t.Fatal("a stopped prober runs again")
		}
		p.Stop()
	}
}

// A retired backend's pool is closed while some of its streams may still
// run (the drain timeout passed): those connections, released after, must
// be closed too, not pooled where nothing will ever close them.
func TestConnectionReleasedAfterCloseIsClosed(t *testing.T) {
	engineSawClose := make(chan struct{})
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
		close(engineSawClose)
	})
	u := &Upstream{Addr: addr}
	req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
	body, err := u.Do(req, resp, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	u.Close() // the backend is retired while the stream runs
	if _, err := io.ReadAll(body); err != nil {
		t.Fatal(err)
	}
	body.Close()
	if n := len(u.idle); n != 0 {
		t.Fatalf("%d connections pooled after the pool was closed", n)
	}
	select {
	case <-engineSawClose:
	case <-time.After(10 * time.Second):
		t.Fatal("the engine's connection was never closed")
	}
}
