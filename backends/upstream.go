package backends

import (
	"bufio"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"
)

// Upstream is a keep-alive HTTP/1.1 client for one engine. It is ours rather
// than fasthttp.HostClient because a proxied request must be abortable at any
// moment — while the engine is silent in a long prefill, or mid-stream — and
// the only way an engine learns its client left is its connection closing.
// fasthttp's Request/Response do the wire format.
type Upstream struct {
	Addr        string        // host:port
	DialTimeout time.Duration // default 3s
	MaxIdle     int           // idle connections kept, default 512
	// ReadTimeout bounds each wait for upstream bytes (headers or the next
	// stream chunk): an idle timer, not a whole-response limit.
	ReadTimeout time.Duration // default 5m

	mu   sync.Mutex
	idle []*upConn

	Dials atomic.Int64 // connections opened, for tests and metrics
}

type upConn struct {
	c  net.Conn
	br *bufio.Reader
	bw *bufio.Writer
}

// Abort cancels one exchange with an engine: it closes the connection the
// exchange is using, now or as soon as it gets one. Safe for concurrent use.
type Abort struct {
	mu      sync.Mutex
	conn    net.Conn
	aborted bool
}

// Abort closes the exchange's connection; later attempts fail at once.
func (a *Abort) Abort() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.aborted {
		return
	}
	a.aborted = true
	if a.conn != nil {
		a.conn.Close()
	}
}

// Aborted reports whether Abort was called.
func (a *Abort) Aborted() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.aborted
}

func (a *Abort) attach(c net.Conn) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.aborted {
		return false
	}
	a.conn = c
	return true
}

func (a *Abort) detach() {
	a.mu.Lock()
	a.conn = nil
	a.mu.Unlock()
}

// ErrAborted is returned when the exchange was aborted by the caller.
var ErrAborted = errors.New("upstream exchange aborted")

// ConnectError means the engine never received the request: it is always
// safe to retry elsewhere.
type ConnectError struct{ Err error }

func (e *ConnectError) Error() string { return "connect: " + e.Err.Error() }
func (e *ConnectError) Unwrap() error { return e.Err }

// Body is a streamed response body. Read it to EOF, then Close; Close returns
// the connection for reuse only when the body ended cleanly.
type Body struct {
	u     *Upstream
	uc    *upConn
	resp  *fasthttp.Response
	r     io.Reader
	ab    *Abort
	eof   bool
	err   error
	reset time.Time
}

// Read reads the next bytes of the body, each wait bounded by ReadTimeout.
func (b *Body) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	// Moving the deadline costs a timer update; do it at most every 100ms.
	if now := time.Now(); now.Sub(b.reset) > 100*time.Millisecond {
		b.uc.c.SetReadDeadline(now.Add(b.u.readTimeout()))
		b.reset = now
	}
	n, err := b.r.Read(p)
	if err == io.EOF {
		b.eof = true
	} else if err != nil {
		if b.ab != nil && b.ab.Aborted() {
			err = ErrAborted
		}
		b.err = err
	}
	return n, err
}

// Close releases the body and its connection.
func (b *Body) Close() {
	if b.uc == nil {
		return
	}
	b.resp.CloseBodyStream()
	reuse := b.eof && !b.resp.ConnectionClose() && b.resp.Header.ContentLength() != -2
	if b.ab != nil {
		b.ab.detach()
		if b.ab.Aborted() {
			reuse = false
		}
	}
	b.u.release(b.uc, reuse)
	b.uc = nil
}

func (u *Upstream) readTimeout() time.Duration {
	if u.ReadTimeout > 0 {
		return u.ReadTimeout
	}
	return 5 * time.Minute
}

// Do sends req and reads the response headers. With stream set, the body is
// returned as a Body to read and Close; otherwise it is read into resp and
// the returned Body is nil. ab (optional) aborts the exchange from elsewhere.
func (u *Upstream) Do(req *fasthttp.Request, resp *fasthttp.Response, stream bool, ab *Abort) (*Body, error) {
	for attempt := 0; ; attempt++ {
		uc, reused, err := u.get()
		if err != nil {
			return nil, &ConnectError{Err: err}
		}
		if ab != nil && !ab.attach(uc.c) {
			uc.c.Close()
			return nil, ErrAborted
		}
		body, err := u.exchange(uc, req, resp, stream, ab)
		if err == nil {
			return body, nil
		}
		if ab != nil {
			ab.detach()
		}
		uc.c.Close()
		if ab != nil && ab.Aborted() {
			return nil, ErrAborted
		}
		// A pooled connection the engine closed while idle fails before any
		// response byte: the engine never saw the request, so try a fresh one.
		if reused && attempt == 0 && isStaleConn(err) {
			continue
		}
		return nil, err
	}
}

func isStaleConn(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, io.ErrUnexpectedEOF)
}

func (u *Upstream) exchange(uc *upConn, req *fasthttp.Request, resp *fasthttp.Response, stream bool, ab *Abort) (*Body, error) {
	uc.c.SetWriteDeadline(time.Now().Add(30 * time.Second))
	if err := req.Write(uc.bw); err != nil {
		return nil, err
	}
	if err := uc.bw.Flush(); err != nil {
		return nil, err
	}
	uc.c.SetReadDeadline(time.Now().Add(u.readTimeout()))
	resp.StreamBody = stream
	if err := resp.ReadLimitBody(uc.br, 0); err != nil {
		return nil, err
	}
	if !stream {
		if ab != nil {
			ab.detach()
		}
		u.release(uc, !resp.ConnectionClose())
		return nil, nil
	}
	return &Body{u: u, uc: uc, resp: resp, r: resp.BodyStream(), ab: ab, reset: time.Now()}, nil
}

func (u *Upstream) get() (*upConn, bool, error) {
	u.mu.Lock()
	if n := len(u.idle); n > 0 {
		uc := u.idle[n-1]
		u.idle[n-1] = nil
		u.idle = u.idle[:n-1]
		u.mu.Unlock()
		return uc, true, nil
	}
	u.mu.Unlock()
	d := u.DialTimeout
	if d <= 0 {
		d = 3 * time.Second
	}
	c, err := net.DialTimeout("tcp", u.Addr, d)
	if err != nil {
		return nil, false, err
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	u.Dials.Add(1)
	return &upConn{c: c, br: bufio.NewReaderSize(c, 16<<10), bw: bufio.NewWriterSize(c, 16<<10)}, false, nil
}

func (u *Upstream) release(uc *upConn, reuse bool) {
	if !reuse {
		uc.c.Close()
		return
	}
	uc.c.SetDeadline(time.Time{})
	max := u.MaxIdle
	if max <= 0 {
		max = 512
	}
	u.mu.Lock()
	if len(u.idle) < max {
		u.idle = append(u.idle, uc)
		u.mu.Unlock()
		return
	}
	u.mu.Unlock()
	uc.c.Close()
}

// CloseIdle closes every pooled connection.
func (u *Upstream) CloseIdle() {
	u.mu.Lock()
	idle := u.idle
	u.idle = nil
	u.mu.Unlock()
	for _, uc := range idle {
		uc.c.Close()
	}
}
