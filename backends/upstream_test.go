package backends

import (
	"bufio"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// rawEngine accepts connections on loopback and hands each to serve.
func rawEngine(t *testing.T, serve func(c net.Conn, br *bufio.Reader)) string {
	return rawEngineTLS(t, false, serve)
}

// rawEngineTLS is rawEngine, over TLS with a test certificate when https.
func rawEngineTLS(t *testing.T, https bool, serve func(c net.Conn, br *bufio.Reader)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if https {
		srv := httptest.NewUnstartedServer(nil)
		srv.StartTLS() // for its certificate
		ln = tls.NewListener(ln, &tls.Config{Certificates: srv.TLS.Certificates})
		srv.Close()
	}
	acceptEach(t, ln, func(c net.Conn) { serve(c, bufio.NewReader(c)) })
	return ln.Addr().String()
}

// acceptEach serves each connection of ln with serve, which closes it when
// done, until the test ends.
func acceptEach(t *testing.T, ln net.Listener, serve func(c net.Conn)) {
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				serve(c)
			}()
		}
	}()
}

// countedEngine answers "ok" to every request, after wait, and counts its
// open connections in open.
func countedEngine(t *testing.T, open *atomic.Int64, wait time.Duration) string {
	return rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		open.Add(1)
		defer open.Add(-1)
		for readRequest(br) == nil {
			time.Sleep(wait)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
}

// readRequest consumes one request (headers and Content-Length body).
func readRequest(br *bufio.Reader) error {
	var req fasthttp.Request
	return req.Read(br)
}

func newRequest(addr, body string) *fasthttp.Request {
	req := fasthttp.AcquireRequest()
	req.Header.SetMethod(fasthttp.MethodPost)
	req.SetRequestURI("/v1/completions")
	req.Header.SetHost(addr)
	req.SetBodyString(body)
	return req
}

func TestKeepAliveConnectionIsReused(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	if d := dialsFor(t, addr, 3); d != 1 {
		t.Fatalf("%d dials for 3 sequential requests, want 1", d)
	}
}

// dialsFor sends n requests one after another, each to be answered "ok",
// and returns how many connections they took.
func dialsFor(t *testing.T, addr string, n int) int64 {
	t.Helper()
	u := &Upstream{Addr: addr}
	for i := 0; i < n; i++ {
		req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
		if _, err := u.Do(req, resp, false, nil); err != nil {
			t.Fatal(err)
		}
		if string(resp.Body()) != "ok" {
			t.Fatalf("request %d read %q", i, resp.Body())
		}
	}
	return u.Dials.Load()
}

// An engine that sends more than its answer (here a second, unasked one
// in the same write) loses its connection: pooled, the extra bytes were
// read as the next request's answer, which may be another tenant's (the
// security review).
func TestBytesPastTheAnswerAreNotReadByTheNext(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled")
		}
	})
	if d := dialsFor(t, addr, 3); d != 3 {
		t.Fatalf("%d dials for 3 requests, want one each", d)
	}
}

// An answer no request asked for, sent while the connection is pooled,
// loses the engine that connection: the next request was sent on it and
// read that answer as its own, and the one after got the next request's
// (the twenty-sixth session's security review: tenants read each other's
// answers through an engine that answered twice). Over TLS too (its
// review). A connection the engine closed while pooled is dropped before a
// request goes on it.
func TestAnswerSentWhilePooledIsNotReadByTheNext(t *testing.T) {
	t.Run("http", func(t *testing.T) { answerSentWhilePooled(t, false) })
	t.Run("https", func(t *testing.T) { answerSentWhilePooled(t, true) })
}

func answerSentWhilePooled(t *testing.T, https bool) {
	var answered atomic.Int32
	addr := rawEngineTLS(t, https, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			if answered.Add(1) == 1 {
				time.Sleep(20 * time.Millisecond)
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled")
			}
		}
	})
	u := &Upstream{Addr: addr}
	if https {
		u.TLS = &tls.Config{InsecureSkipVerify: true}
	}
	okInTurn(t, u, 3, 50*time.Millisecond) // the unasked answer comes in a pause
	if d, n := u.Dials.Load(), u.Unsolicited.Load(); d != 2 || n != 1 {
		t.Fatalf("%d dials and %d connections dropped for unasked bytes, want 2 and 1", d, n)
	}
}

// A chunked stream read to its end leaves nothing buffered: its connection
// is reused (the check for bytes past an answer must not close every
// stream's connection), with or without trailers.
func TestStreamedConnectionIsReused(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for i := 0; readRequest(br) == nil; i++ {
			trailer := ""
			if i%2 == 1 {
				trailer = "X-Trailer: 1\r\n"
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"+
				"f\r\ndata: {\"a\":1}\n\n\r\n0\r\n"+trailer+"\r\n")
		}
	})
	u := &Upstream{Addr: addr}
	for i := 0; i < 4; i++ {
		req, resp := newRequest(addr, `{"stream":true}`), fasthttp.AcquireResponse()
		body, err := u.Do(req, resp, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := io.ReadAll(body); err != nil || string(got) != "data: {\"a\":1}\n\n" {
			t.Fatalf("stream %d: %q %v", i, got, err)
		}
		body.Close()
	}
	if d := u.Dials.Load(); d != 1 {
		t.Fatalf("%d dials for 4 sequential streams, want 1", d)
	}
}

// A pooled connection the engine closed while idle (uvicorn closes them
// after 5 s) fails at once: the request goes again on a fresh one, and the
// engine sees it once.
func TestIdleClosedConnectionIsResent(t *testing.T) {
	var seen atomic.Int32
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		if readRequest(br) == nil {
			seen.Add(1)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			time.Sleep(20 * time.Millisecond) // then closes it, idle
		}
	})
	u := &Upstream{Addr: addr}
	for i := 0; i < 2; i++ {
		req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
		if i == 1 {
			time.Sleep(100 * time.Millisecond)
		}
		if _, err := u.Do(req, resp, false, nil); err != nil || string(resp.Body()) != "ok" {
			t.Fatalf("request %d: %v %q", i, err, resp.Body())
		}
	}
	if n, d := seen.Load(), u.Dials.Load(); n != 2 || d != 2 {
		t.Fatalf("the engine saw %d requests over %d connections, want 2 and 2", n, d)
	}
}

// An engine that held a request a while and then dropped its connection
// took it: the request is not sent again (it was, silently, on a pooled
// connection whatever the engine had done with it: the AI SDK trial).
func TestRequestHeldThenDroppedIsNotResent(t *testing.T) {
	var seen atomic.Int32
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for i := 0; readRequest(br) == nil; i++ {
			seen.Add(1)
			if i == 1 {
				time.Sleep(2 * staleWithin) // works on it, then dies
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	u := &Upstream{Addr: addr}
	req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
	if _, err := u.Do(req, resp, false, nil); err != nil {
		t.Fatal(err)
	}
	req, resp = newRequest(addr, `{}`), fasthttp.AcquireResponse()
	if _, err := u.Do(req, resp, false, nil); err == nil {
		t.Fatalf("a dropped request answered %q", resp.Body())
	}
	if n, d := seen.Load(), u.Dials.Load(); n != 2 || d != 1 {
		t.Fatalf("the engine saw %d requests over %d connections, want 2 over 1", n, d)
	}
}

// A stream whose engine goes silent ends with a timeout after about
// ReadTimeout (plus the deadline's slack), not never.
func TestSilentStreamTimesOut(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		readRequest(br)
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		io.WriteString(c, "f\r\ndata: {\"a\":1}\n\n\r\n")
		time.Sleep(10 * time.Second) // silent, connection open
	})
	u := &Upstream{Addr: addr, ReadTimeout: 200 * time.Millisecond}
	req, resp := newRequest(addr, `{"stream":true}`), fasthttp.AcquireResponse()
	body, err := u.Do(req, resp, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer body.Close()
	start := time.Now()
	got, err := io.ReadAll(body)
	if !IsTimeout(err) {
		t.Fatalf("read ended with %v, want a timeout", err)
	}
	if !strings.Contains(string(got), `data: {"a":1}`) {
		t.Fatalf("lost the event before the silence: %q", got)
	}
	if took := time.Since(start); took > 200*time.Millisecond+deadlineSlack+2*time.Second {
		t.Fatalf("timeout noticed after %v", took)
	}
}

// An engine that never answers the headers times out too, also on a
// connection reused from the pool whose earlier deadline had been pushed out.
func TestSilentEngineTimesOutOnReusedConnection(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		readRequest(br)
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		readRequest(br)
		time.Sleep(10 * time.Second)
	})
	u := &Upstream{Addr: addr, ReadTimeout: 200 * time.Millisecond}
	if _, err := u.Do(newRequest(addr, `{}`), fasthttp.AcquireResponse(), false, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the first deadline is now in the past
	start := time.Now()
	_, err := u.Do(newRequest(addr, `{}`), fasthttp.AcquireResponse(), false, nil)
	if !IsTimeout(err) {
		t.Fatalf("got %v, want a timeout", err)
	}
	if took := time.Since(start); took < 150*time.Millisecond {
		t.Fatalf("timed out after %v: a stale deadline fired instead of a fresh one", took)
	}
	if u.Dials.Load() != 1 {
		t.Fatalf("%d dials, want the pooled connection reused", u.Dials.Load())
	}
}

// Abort during a silent prefill closes the engine connection at once.
func TestAbortClosesTheEngineConnection(t *testing.T) {
	closed := make(chan struct{})
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		readRequest(br)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := br.ReadByte(); err != nil {
			close(closed)
		}
	})
	u := &Upstream{Addr: addr}
	ab := &Abort{}
	errc := make(chan error, 1)
	go func() {
		_, err := u.Do(newRequest(addr, `{}`), fasthttp.AcquireResponse(), true, ab)
		errc <- err
	}()
	time.Sleep(50 * time.Millisecond)
	ab.Abort()
	if err := <-errc; !errors.Is(err, ErrAborted) {
		t.Fatalf("Do returned %v, want ErrAborted", err)
	}
	select {
	case <-closed:
	case <-time.After(3 * time.Second):
		t.Fatal("the engine did not see its connection close")
	}
}

// An Abort that fires after the whole answer was read, before the exchange
// let go of its connection, has closed that connection: it must not go back
// to the pool, or the next, unrelated request fails on it.
func TestConnectionClosedByLateAbortIsNotPooled(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	u := &Upstream{Addr: addr}
	uc, _, err := u.get(false)
	if err != nil {
		t.Fatal(err)
	}
	ab := &Abort{}
	if !ab.attach(uc.c) {
		t.Fatal("attach refused")
	}
	ab.Abort() // the client hung up just as the answer came in
	u.done(uc, true, ab)
	if n := len(u.idle); n != 0 {
		t.Fatalf("%d pooled connections, want the aborted one closed", n)
	}
	resp := fasthttp.AcquireResponse()
	if _, err := u.Do(newRequest(addr, `{}`), resp, false, nil); err != nil || string(resp.Body()) != "ok" {
		t.Fatalf("next request: %v %q", err, resp.Body())
	}

	// Not aborted: the connection is reused.
	uc, _, _ = u.get(false)
	u.done(uc, true, &Abort{})
	if n := len(u.idle); n != 1 {
		t.Fatalf("%d pooled connections, want 1", n)
	}
}

// A bodiless answer (204, 304) to a streamed exchange reads as an empty
// body, and its connection is reused: fasthttp gives such an answer no body
// stream, and reading it dereferenced nil, which no handler recovers.
func TestBodilessStreamedAnswer(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 204 No Content\r\n\r\n")
		}
	})
	u := &Upstream{Addr: addr}
	for i := 0; i < 2; i++ {
		req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
		body, err := u.Do(req, resp, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(body)
		body.Close()
		if err != nil || len(got) != 0 || resp.StatusCode() != 204 {
			t.Fatalf("%d %q %v", resp.StatusCode(), got, err)
		}
	}
	if d := u.Dials.Load(); d != 1 {
		t.Fatalf("%d dials for 2 sequential requests, want 1", d)
	}
}

// EndBy bounds the read that follows it, not the time since the first
// call: a caller that took longer than d between reads (a proxy writing
// the last events to a slow client) still reads the body's end, already
// arrived, and the connection goes back to the pool. It timed out, and a
// healthy engine's connection was closed.
func TestEndByCountsFromTheNextRead(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
			io.WriteString(c, "e\r\ndata: [DONE]\n\n\r\n")
			time.Sleep(50 * time.Millisecond)
			io.WriteString(c, "0\r\n\r\n")
		}
	})
	u := &Upstream{Addr: addr, ReadTimeout: 10 * time.Second}
	for i := 0; i < 2; i++ {
		req, resp := newRequest(addr, `{"stream":true}`), fasthttp.AcquireResponse()
		body, err := u.Do(req, resp, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 64)
		n, err := body.Read(buf)
		if err != nil || !strings.Contains(string(buf[:n]), "[DONE]") {
			t.Fatalf("first read: %q %v", buf[:n], err)
		}
		body.EndBy(200 * time.Millisecond)
		time.Sleep(400 * time.Millisecond) // a slow client takes the [DONE]
		body.EndBy(200 * time.Millisecond)
		if rest, err := io.ReadAll(body); err != nil || len(rest) != 0 {
			t.Fatalf("request %d: the body's end read as %q %v, want its end", i, rest, err)
		}
		body.Close()
	}
	if d := u.Dials.Load(); d != 1 {
		t.Fatalf("%d dials for 2 sequential streams, want 1: the first stream's connection was not reused", d)
	}
}

// A pooled connection idle for MaxIdleTime is closed, with no request to
// come (after a burst the pool kept every connection it had made, for
// good: the memory audit found 527 of them, and their file descriptors,
// minutes later), and one found idle too long is not used.
func TestIdleConnectionsAreClosed(t *testing.T) {
	var open atomic.Int64
	addr := countedEngine(t, &open, 20*time.Millisecond) // so that the burst needs several connections
	u := &Upstream{Addr: addr, MaxIdleTime: 150 * time.Millisecond}
	defer u.Close()
	do := func() {
		req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
		defer fasthttp.ReleaseRequest(req)
		defer fasthttp.ReleaseResponse(resp)
		if _, err := u.Do(req, resp, false, nil); err != nil || string(resp.Body()) != "ok" {
			t.Errorf("%v %q", err, resp.Body())
		}
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); do() }()
	}
	wg.Wait()
	u.mu.Lock()
	pooled := len(u.idle)
	u.mu.Unlock()
	if pooled < 2 || open.Load() != int64(pooled) {
		t.Fatalf("after the burst: %d pooled, %d open at the engine", pooled, open.Load())
	}
	deadline := time.Now().Add(5 * time.Second)
	for open.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	u.mu.Lock()
	pooled = len(u.idle)
	u.mu.Unlock()
	if open.Load() != 0 || pooled != 0 {
		t.Fatalf("idle past MaxIdleTime: %d still open at the engine, %d pooled", open.Load(), pooled)
	}
	dials := u.Dials.Load()
	do()
	do() // on the connection the one before pooled
	if got := u.Dials.Load() - dials; got != 1 {
		t.Fatalf("%d dials for two requests after the pool emptied, want 1", got)
	}
	// One pooled, then idle too long before a request takes it (the sweep
	// held back): a new connection.
	u.mu.Lock()
	u.sweep.Stop()
	u.mu.Unlock()
	time.Sleep(200 * time.Millisecond)
	dials = u.Dials.Load()
	do()
	if got := u.Dials.Load() - dials; got != 1 {
		t.Fatalf("a connection idle past MaxIdleTime was used (%d dials)", got)
	}
}

// ShedIdle closes every pool's idle connections (kvproxy out of file
// descriptors), and an upstream leaves its list once it has none pooled
// or is closed: a fleet's churn would otherwise keep every upstream.
func TestShedIdle(t *testing.T) {
	var open atomic.Int64
	addr := countedEngine(t, &open, 0)
	listed := func(u *Upstream) bool { _, ok := pooled.Load(u); return ok }
	var us [2]*Upstream
	for i := range us {
		us[i] = &Upstream{Addr: addr, MaxIdleTime: 200 * time.Millisecond}
		req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
		if _, err := us[i].Do(req, resp, false, nil); err != nil {
			t.Fatal(err)
		}
		if !listed(us[i]) {
			t.Fatalf("upstream %d pools a connection and is not listed", i)
		}
	}
	if n := ShedIdle(); n < 2 {
		t.Fatalf("shed %d connections, want the 2 pooled", n)
	}
	deadline := time.Now().Add(5 * time.Second)
	for open.Load() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	idle := func(u *Upstream) int { u.mu.Lock(); defer u.mu.Unlock(); return len(u.idle) }
	if open.Load() != 0 || idle(us[0]) != 0 || idle(us[1]) != 0 {
		t.Fatalf("after the shed: %d open at the engine", open.Load())
	}
	us[0].Close()
	if listed(us[0]) {
		t.Fatal("a closed upstream is still listed")
	}
	for listed(us[1]) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if listed(us[1]) {
		t.Fatal("an upstream with nothing pooled stays listed past its sweep")
	}
}

// Dials that run out of descriptors at the same moment all dial again
// after a shed: only the first found idle connections to close, and the
// others, finding none, gave up though it had freed descriptors for them
// (the review).
func TestDialsOutOfDescriptorsAllRetry(t *testing.T) {
	addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	const k = 5
	var failed atomic.Int64
	all := make(chan struct{}) // every one of the k first dials has failed
	defer SetDialForTests(func(network, a string, d time.Duration) (net.Conn, error) {
		if n := failed.Add(1); n <= k {
			if n == k {
				close(all)
			}
			<-all
			return nil, &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("socket", syscall.EMFILE)}
		}
		return net.DialTimeout(network, a, d)
	})()
	u := &Upstream{Addr: addr}
	defer u.Close()
	var wg sync.WaitGroup
	var fails atomic.Int64
	for range k {
		wg.Go(func() {
			req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
			if _, err := u.Do(req, resp, false, nil); err != nil {
				fails.Add(1)
				t.Log(err)
			}
		})
	}
	wg.Wait()
	if fails.Load() != 0 {
		t.Fatalf("%d of %d requests failed", fails.Load(), k)
	}
}

// A dial out of descriptors while another's shed is still closing the
// pooled connections waits for those to be closed before it dials again:
// it found the pools emptied and dialled at once, and failed again (a CI
// run, 18 requests moving from one engine to another).
func TestDialWaitsForAShedUnderway(t *testing.T) {
	var open atomic.Int64
	addr := countedEngine(t, &open, 0)
	closing, letClose := make(chan struct{}), make(chan struct{})
	var pooledOpen atomic.Int64 // the connection pooled, until its Close is done
	var dials atomic.Int64
	defer SetDialForTests(func(network, a string, d time.Duration) (net.Conn, error) {
		if dials.Add(1) == 1 {
			c, err := net.DialTimeout(network, a, d)
			if err != nil {
				return nil, err
			}
			pooledOpen.Store(1)
			return &slowClose{Conn: c, closing: closing, letClose: letClose, open: &pooledOpen}, nil
		}
		if pooledOpen.Load() != 0 { // its descriptor is not free yet
			return nil, &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("socket", syscall.EMFILE)}
		}
		return net.DialTimeout(network, a, d)
	})()
	pooler, u := &Upstream{Addr: addr}, &Upstream{Addr: addr}
	defer pooler.Close()
	defer u.Close()
	req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
	if _, err := pooler.Do(req, resp, false, nil); err != nil {
		t.Fatal(err)
	}
	go ShedIdle()
	<-closing // the first shed is closing the pooled connection
	done := make(chan error, 1)
	go func() {
		req, resp := newRequest(addr, `{}`), fasthttp.AcquireResponse()
		_, err := u.Do(req, resp, false, nil)
		done <- err
	}()
	for dials.Load() < 2 { // its first dial failed
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // time to dial again, were it not to wait
	close(letClose)
	if err := <-done; err != nil {
		t.Fatalf("a dial during another's shed: %v (%d dials)", err, dials.Load())
	}
}

// slowClose is a connection whose Close says it began (closing), then
// waits for letClose.
type slowClose struct {
	net.Conn
	closing, letClose chan struct{}
	open              *atomic.Int64
}

func (c *slowClose) Close() error {
	close(c.closing)
	<-c.letClose
	err := c.Conn.Close()
	c.open.Store(0)
	return err
}

// okInTurn sends n requests through u one after another, pause apart, each
// to be answered "ok".
func okInTurn(t *testing.T, u *Upstream, n int, pause time.Duration) {
	t.Helper()
	for i := range n {
		req, resp := newRequest(u.Addr, `{}`), fasthttp.AcquireResponse()
		if _, err := u.Do(req, resp, false, nil); err != nil || string(resp.Body()) != "ok" {
			t.Fatalf("request %d: %v %q", i, err, resp.Body())
		}
		time.Sleep(pause)
	}
}

// A pooled connection the engine reset is dropped before a request goes on
// it, as one it closed is: the peek's ECONNRESET read as "nothing came"
// (the review), and the write then failed and was retried.
func TestResetWhilePooledIsDropped(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			time.Sleep(30 * time.Millisecond)
			c.(*net.TCPConn).SetLinger(0) // closing sends a reset
			c.Close()
		}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p := newIdlePeek(c)
	if sent, closed := p.check(); sent || closed {
		t.Fatalf("before the reset: sent %v closed %v", sent, closed)
	}
	time.Sleep(100 * time.Millisecond)
	if sent, closed := p.check(); sent || !closed {
		t.Fatalf("after the reset: sent %v closed %v (%v)", sent, closed, p.err)
	}
}

// onceConn sends what TLS writes for the engine's first answer in one
// write, as one TCP segment would bring two records.
type onceConn struct {
	net.Conn
	mu   sync.Mutex
	held []byte
	hold bool
}

func (c *onceConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.hold {
		c.held = append(c.held, p...)
		return len(p), nil
	}
	return c.Conn.Write(p)
}

// An https engine answering twice at once: crypto/tls reads both records
// from the socket and returns one, so the second was in neither br nor the
// socket, and the next request read it (the second review). Counted.
func TestAnswersSentTogetherOverTLS(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	srv := httptest.NewUnstartedServer(nil)
	srv.StartTLS() // for its certificate
	certs := srv.TLS.Certificates
	srv.Close()
	var answered atomic.Int32
	go func() {
		for {
			raw, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer raw.Close()
				oc := &onceConn{Conn: raw}
				c := tls.Server(oc, &tls.Config{Certificates: certs})
				br := bufio.NewReader(c)
				for readRequest(br) == nil {
					if answered.Add(1) > 1 {
						io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
						continue
					}
					oc.mu.Lock()
					oc.hold = true
					oc.mu.Unlock()
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled")
					oc.mu.Lock()
					raw.Write(oc.held)
					oc.held, oc.hold = nil, false
					oc.mu.Unlock()
				}
			}()
		}
	}()
	addr := ln.Addr().String()
	u := &Upstream{Addr: addr, TLS: &tls.Config{InsecureSkipVerify: true}}
	defer u.Close()
	okInTurn(t, u, 3, 0)
	if n := u.Unsolicited.Load(); n != 1 {
		t.Fatalf("%d connections dropped for unasked answers, want 1", n)
	}
}

// An https engine closing an idle connection sends close_notify: no
// unasked answer, though bytes came (the second review: every idle close
// was counted), and the request after it is served on a new connection.
func TestIdleCloseOverTLSIsNoAnswer(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "ok")
	}))
	srv.Config.IdleTimeout = 100 * time.Millisecond
	srv.StartTLS()
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "https://")
	u := &Upstream{Addr: addr, TLS: &tls.Config{InsecureSkipVerify: true}}
	defer u.Close()
	okInTurn(t, u, 3, 300*time.Millisecond) // the engine closes it in a pause
	if d, n := u.Dials.Load(), u.Unsolicited.Load(); d != 3 || n != 0 {
		t.Fatalf("%d dials, %d unasked answers; want 3 and 0", d, n)
	}
}
