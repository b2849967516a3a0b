package backends

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
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
	// TLS, when set, makes every connection TLS (an https engine); the
	// handshake is part of the dial: DialTimeout bounds both together.
	TLS     *tls.Config
	MaxIdle int // idle connections kept, default 512
	// MaxIdleTime closes a connection idle for that long (default
	// DefaultMaxIdleTime): after a burst the pool would otherwise keep
	// every connection it made, with its file descriptor and 32 KiB of
	// buffers, for good, and engines close theirs anyway.
	MaxIdleTime time.Duration
	// ReadTimeout bounds each wait for upstream bytes (headers or the next
	// stream chunk): an idle timer, not a whole-response limit.
	ReadTimeout time.Duration // default 5m
	// MaxBodySize bounds an answer read whole (not streamed); a larger one
	// is an error. Default 64 MiB.
	MaxBodySize int
	// Budget, when set, bounds the memory of the answers DoWhole reads,
	// with those of every Upstream sharing it.
	Budget *Budget

	mu     sync.Mutex
	idle   []*upConn   // the most recently released last
	sweep  *time.Timer // closes the connections idle too long, while any is pooled
	closed bool        // Close was called: released connections are closed, not pooled

	Dials atomic.Int64 // connections opened, for tests and metrics
	// Unsolicited counts the connections dropped because the engine sent
	// bytes no request asked for: past an answer (release), or while the
	// connection was pooled (idlePeek).
	Unsolicited atomic.Int64
}

// TLSError is a failed TLS handshake with an https engine: a certificate
// it does not trust, a name that does not match, or a peer that does not
// speak TLS. The engine never got the request.
type TLSError struct {
	Addr string
	Err  error
}

func (e *TLSError) Error() string { return "tls handshake with " + e.Addr + ": " + e.Err.Error() }
func (e *TLSError) Unwrap() error { return e.Err }

// DefaultMaxIdleTime is Upstream.MaxIdleTime's default: under the 5 s
// after which uvicorn (vLLM, SGLang) closes an idle keep-alive connection,
// so a pooled connection is seldom one the engine is closing.
const DefaultMaxIdleTime = 4 * time.Second

type upConn struct {
	c  net.Conn
	rd peerReader // what br reads through
	br *bufio.Reader
	bw *bufio.Writer
	// readBy is the read deadline set on c. Each exchange needs one at least
	// ReadTimeout away; moving it costs a timer update, so it is moved only
	// when it is closer than that (by more than deadlineSlack).
	readBy time.Time
	idleAt time.Time // when it was pooled
	peek   *idlePeek // what the engine sent while it was pooled
}

// peerReader reads the engine's connection for br, counting the bytes that
// arrived and noting when the engine closed its side.
type peerReader struct {
	c      net.Conn
	n      int64 // bytes read from the engine
	closed bool  // a read returned io.EOF: the engine sends nothing more
}

func (r *peerReader) Read(p []byte) (int, error) {
	n, err := r.c.Read(p)
	r.n += int64(n)
	if err == io.EOF {
		r.closed = true
	}
	return n, err
}

// deadlineSlack is how much later than ReadTimeout a silent engine may be
// noticed, in exchange for not moving the deadline on every exchange.
const deadlineSlack = time.Second

// armRead makes sure the next read waits at least d.
func (uc *upConn) armRead(now time.Time, d time.Duration) {
	if uc.readBy.Sub(now) < d {
		uc.readBy = now.Add(d + deadlineSlack)
		uc.c.SetReadDeadline(uc.readBy)
	}
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

// detach forgets the connection, so a later Abort cannot close it, and
// reports whether Abort was called before (and may have closed it).
func (a *Abort) detach() (aborted bool) {
	a.mu.Lock()
	a.conn = nil
	aborted = a.aborted
	a.mu.Unlock()
	return aborted
}

// done ends uc's exchange: back to the pool if reuse and ab (optional) did
// not fire, closed otherwise. An Abort may close the connection at any time
// until it is detached, even after the answer was read in full.
func (u *Upstream) done(uc *upConn, reuse bool, ab *Abort) {
	if ab != nil && ab.detach() {
		reuse = false
	}
	u.release(uc, reuse)
}

// ErrTruncated is returned when the engine closed the connection inside a
// chunked body, before its last chunk. It is not io.EOF (the body is
// incomplete, and its connection is not reused); errors.Is matches it with
// io.ErrUnexpectedEOF. A caller that already has what it needed (an SSE
// stream's [DONE]) may take it as the end.
var ErrTruncated error = truncatedError{}

type truncatedError struct{}

func (truncatedError) Error() string        { return "engine closed the connection inside a chunked body" }
func (truncatedError) Is(target error) bool { return target == io.ErrUnexpectedEOF }

// ErrAborted is returned when the exchange was aborted by the caller.
var ErrAborted = errors.New("upstream exchange aborted")

// ConnectError means the engine never received the request: it is always
// safe to retry elsewhere.
type ConnectError struct{ Err error }

// OutOfFiles reports whether err is kvproxy's own want of file
// descriptors (EMFILE: the open files limit; ENFILE: the system's), which
// says nothing of the engine it tried to reach.
func OutOfFiles(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}

func (e *ConnectError) Error() string { return "connect: " + e.Err.Error() }
func (e *ConnectError) Unwrap() error { return e.Err }

// Body is a streamed response body. Read it to EOF, then Close; Close returns
// the connection for reuse only when the body ended cleanly.
type Body struct {
	u    *Upstream
	uc   *upConn
	resp *fasthttp.Response
	r    io.Reader
	ab   *Abort
	eof  bool
	err  error
	// ending: EndBy was called, and the read deadline is its.
	ending bool
}

// Read reads the next bytes of the body, each wait bounded by ReadTimeout
// (or by EndBy's deadline).
func (b *Body) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	if b.r == nil { // a bodiless answer (204, 304): fasthttp gives no stream
		b.eof = true
		return 0, io.EOF
	}
	if !b.ending {
		b.uc.armRead(time.Now(), b.u.readTimeout())
	}
	n, err := b.r.Read(p)
	if err == io.EOF && b.uc.rd.closed && b.resp.Header.ContentLength() == -1 {
		// fasthttp reports a chunked body whose connection closed between
		// two chunks, before the terminating one, as a plain EOF: the
		// engine died mid-answer, which must not pass for a complete one.
		err = ErrTruncated
	}
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

// EndBy bounds the next read to d from now, in place of ReadTimeout: the
// answer's own end has come (an SSE stream's [DONE]), and what is left, the
// body's framing, comes at once from an engine that is well. Reading past
// it is a timeout. Called before each read, it leaves out the time spent
// between reads (a slow client taking the last events).
func (b *Body) EndBy(d time.Duration) {
	if b.uc == nil {
		return
	}
	b.ending = true
	b.uc.readBy = time.Now().Add(d) // the next exchange's armRead moves it
	b.uc.c.SetReadDeadline(b.uc.readBy)
}

// Buffered is how many bytes of the answer have arrived and not been read
// yet: a Read now returns without waiting for the engine (unless only part
// of a chunk's framing is here).
func (b *Body) Buffered() int {
	if b.uc == nil {
		return 0
	}
	return b.uc.br.Buffered()
}

// Close releases the body and its connection.
func (b *Body) Close() {
	if b.uc == nil {
		return
	}
	b.resp.CloseBodyStream()
	// A body that ends with the connection (no length, not chunked) leaves
	// nothing to reuse; a bodiless answer (204, 304) leaves it clean.
	b.u.done(b.uc, b.eof && !b.resp.ConnectionClose() && (b.r == nil || b.resp.Header.ContentLength() != -2), b.ab)
	b.uc = nil
}

func (u *Upstream) maxBodySize() int {
	if u.MaxBodySize > 0 {
		return u.MaxBodySize
	}
	return 64 << 20
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
	return u.do(req, resp, stream, ab, nil)
}

// DoWhole is Do for an answer read whole within u.Budget: ErrOverBudget
// when others hold the room, ErrBeyondBudget when it and own (what the
// caller's request holds already, its body) are more than the whole
// budget. held is what its body took of the budget, which the caller
// gives back (Budget.Give) once it lets the body go.
func (u *Upstream) DoWhole(req *fasthttp.Request, resp *fasthttp.Response, ab *Abort, own int64) (held int64, err error) {
	w := &whole{own: own}
	_, err = u.do(req, resp, false, ab, w)
	return w.held, err
}

// whole is a DoWhole's share of the budget: what its request held before
// it, and what its answer took.
type whole struct{ own, held int64 }

func (u *Upstream) do(req *fasthttp.Request, resp *fasthttp.Response, stream bool, ab *Abort, w *whole) (*Body, error) {
	for attempt := 0; ; attempt++ {
		// A retry after a stale pooled connection dials: after an engine
		// restart every pooled connection is as dead as the first one was.
		uc, reused, err := u.get(attempt > 0)
		if err != nil {
			return nil, &ConnectError{Err: err}
		}
		if ab != nil && !ab.attach(uc.c) {
			uc.c.Close()
			return nil, ErrAborted
		}
		sent, start := uc.rd.n, time.Now()
		body, err := u.exchange(uc, req, resp, stream, ab, w)
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
		// A pooled connection the engine closed while idle fails at once,
		// before any response byte: the engine never saw the request, so
		// try a fresh one. Once a byte of an answer arrived, or the engine
		// held the request a while before it closed (it took it, and died
		// or dropped it: a second delivery would run it twice, a request
		// that crashes engines twice), the failure is the answer.
		if reused && attempt == 0 && uc.rd.n == sent && isStaleConn(err) && time.Since(start) < staleWithin {
			continue
		}
		return nil, err
	}
}

// staleWithin is how soon after its request a pooled connection must fail
// to be taken for one the engine had closed while idle: its close (or the
// reset a write to it draws) comes within a round trip.
const staleWithin = 250 * time.Millisecond

// IsTimeout reports whether err is a deadline expiring: a net.Error or
// fasthttp's ErrTimeout (which has Timeout but not the rest of net.Error).
func IsTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout()
}

func isStaleConn(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, io.ErrUnexpectedEOF)
}

func (u *Upstream) exchange(uc *upConn, req *fasthttp.Request, resp *fasthttp.Response, stream bool, ab *Abort, w *whole) (*Body, error) {
	// A request fits the socket buffer of a live engine: the write waits
	// only on a dead peer, which the read deadline then catches. Large
	// bodies get a write deadline of their own.
	now := time.Now()
	if len(req.Body()) > 16<<10 {
		uc.c.SetWriteDeadline(now.Add(30 * time.Second))
		defer uc.c.SetWriteDeadline(time.Time{})
	}
	if err := req.Write(uc.bw); err != nil {
		return nil, err
	}
	if err := uc.bw.Flush(); err != nil {
		return nil, err
	}
	uc.armRead(time.Now(), u.readTimeout())
	if w != nil {
		return nil, u.readWhole(uc, resp, ab, w)
	}
	resp.StreamBody = stream
	// The bound matters beyond memory: fasthttp allocates a Content-Length
	// body up front, and an absurd length would panic the process.
	if err := resp.ReadLimitBody(uc.br, u.maxBodySize()); err != nil {
		return nil, err
	}
	if !stream {
		u.done(uc, !resp.ConnectionClose(), ab)
		return nil, nil
	}
	return &Body{u: u, uc: uc, resp: resp, r: resp.BodyStream(), ab: ab}, nil
}

// readWhole reads an answer whole, as fasthttp's ReadLimitBody does, in
// its steps: the body's size is known before the body is read, so a large
// one takes its room in u.Budget first, and one of no declared length
// (chunked, or ending with the connection) takes it as it grows. On error
// what it took is given back.
func (u *Upstream) readWhole(uc *upConn, resp *fasthttp.Response, ab *Abort, w *whole) (err error) {
	defer func() {
		if err != nil {
			u.Budget.Give(w.held)
			w.held = 0
		}
	}()
	resp.ResetBody()
	resp.StreamBody = false
	if err := resp.Header.Read(uc.br); err != nil {
		return err
	}
	for n := 0; interim(resp.StatusCode()); n++ {
		if n == maxInterim {
			return errTooManyInterim
		}
		if err := resp.Header.Read(uc.br); err != nil {
			return err
		}
	}
	limit := u.maxBodySize()
	switch size := resp.Header.ContentLength(); {
	case bodiless(resp.StatusCode()):
	case size > limit:
		return fasthttp.ErrBodyTooLarge
	case size >= 0:
		if size > Untracked {
			if err := u.Budget.Reserve(int64(size), w.own+int64(size)); err != nil {
				return err
			}
			w.held = int64(size)
		}
		if err := resp.ReadBody(uc.br, limit); err != nil {
			return err
		}
	default:
		resp.StreamBody = true
		if err := resp.ReadBody(uc.br, limit); err != nil {
			return err
		}
		body := &Body{u: u, uc: uc, resp: resp, r: resp.BodyStream(), ab: ab}
		buf, err := u.Budget.ReadGrowing(body, nil, limit, w.own, &w.held)
		if err != nil {
			resp.CloseBodyStream()
			return err
		}
		body.Close() // the connection goes back, or is closed, as for a stream
		resp.StreamBody = false
		resp.SetBodyRaw(buf)
		if size == -2 {
			resp.Header.SetContentLength(len(buf)) // as ReadLimitBody leaves it
		}
		return nil
	}
	u.done(uc, !resp.ConnectionClose(), ab)
	return nil
}

// interim is an informational status (1xx) whose answer follows, as
// fasthttp reads them: 101 switches protocols and is the answer.
func interim(code int) bool {
	return code >= 100 && code < 200 && code != fasthttp.StatusSwitchingProtocols
}

// bodiless is a status whose answer has no body (RFC 9110, 6.4.1).
func bodiless(code int) bool {
	return code >= 100 && code < 200 || code == fasthttp.StatusNoContent || code == fasthttp.StatusNotModified
}

// maxInterim bounds the informational answers before the answer, as
// fasthttp does.
const maxInterim = 100

var errTooManyInterim = errors.New("too many informational answers (1xx) before the answer")

// tlsHolds reports whether a TLS connection holds bytes past the answer
// that br has not seen: crypto/tls reads whatever the socket has and
// returns one record a read, so a second answer sent at once stays in it,
// not in br or on the socket (the review: over https the next client still
// read it). A read with the deadline passed looks without waiting; a
// timeout leaves crypto/tls as it was. The next exchange arms the deadline
// again.
func (uc *upConn) tlsHolds() bool {
	tc, ok := uc.c.(*tls.Conn)
	if !ok {
		return false
	}
	uc.readBy = time.Time{}
	n, err := readOne(tc, time.Unix(1, 0))
	return n > 0 || !IsTimeout(err)
}

// readOne reads a byte of tc by deadline.
func readOne(tc *tls.Conn, deadline time.Time) (int, error) {
	tc.SetReadDeadline(deadline)
	var b [1]byte
	return tc.Read(b[:])
}

// unasked reports whether the bytes a pooled connection received while
// idle (idlePeek) are data: over TLS they may be the engine's close_notify
// as it closes an idle connection, which is no answer.
func (uc *upConn) unasked() bool {
	tc, ok := uc.c.(*tls.Conn)
	if !ok {
		return true
	}
	n, _ := readOne(tc, time.Now().Add(5*time.Millisecond)) // the record is there, or nearly
	return n > 0
}

func (u *Upstream) get(dial bool) (*upConn, bool, error) {
	for !dial {
		u.mu.Lock()
		n := len(u.idle)
		if n == 0 {
			u.mu.Unlock()
			break
		}
		uc := u.idle[n-1]
		u.idle[n-1] = nil
		u.idle = u.idle[:n-1]
		if time.Since(uc.idleAt) >= u.maxIdleTime() {
			// Idle too long, and so is every connection pooled before it.
			old := u.idle
			u.idle = nil
			u.mu.Unlock()
			uc.c.Close()
			for _, o := range old {
				o.c.Close()
			}
			break
		}
		u.mu.Unlock()
		if sent, closed := uc.peek.check(); sent || closed {
			if sent && uc.unasked() {
				u.Unsolicited.Add(1)
			}
			uc.c.Close()
			continue
		}
		return uc, true, nil
	}
	d := u.DialTimeout
	if d <= 0 {
		d = 3 * time.Second
	}
	deadline := time.Now().Add(d) // the connection and its TLS handshake together
	c, err := dialTCP("tcp", u.Addr, d)
	if err != nil && OutOfFiles(err) {
		// Out of descriptors: the connections the pools keep idle go
		// first (traffic moving from one engine to another left the
		// first's idle for seconds, and the second's dials failed within
		// the connection cap: the review). Dialled again even when this
		// shed found none: another dial's, at the same moment, may have
		// freed them.
		ShedIdle()
		c, err = dialTCP("tcp", u.Addr, d)
	}
	if err != nil {
		return nil, false, err
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if u.TLS != nil {
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		tc := tls.Client(c, u.TLS)
		err := tc.HandshakeContext(ctx)
		cancel()
		if err != nil {
			c.Close()
			if errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("no handshake within the dial timeout (%v)", d)
			}
			return nil, false, &TLSError{Addr: u.Addr, Err: err}
		}
		c = tc
	}
	u.Dials.Add(1)
	uc := &upConn{c: c, rd: peerReader{c: c}, bw: bufio.NewWriterSize(c, 16<<10), peek: newIdlePeek(c)}
	uc.br = bufio.NewReaderSize(&uc.rd, 16<<10)
	return uc, false, nil
}

func (u *Upstream) release(uc *upConn, reuse bool) {
	if !reuse {
		uc.c.Close()
		return
	}
	if uc.br.Buffered() > 0 || uc.tlsHolds() {
		// Bytes past the answer's end (an engine, or a box before it,
		// that sent more than it framed) would be read as the next
		// request's answer, perhaps another tenant's: the connection goes.
		u.Unsolicited.Add(1)
		uc.c.Close()
		return
	}
	max := u.MaxIdle
	if max <= 0 {
		max = 512
	}
	u.mu.Lock()
	if len(u.idle) < max && !u.closed {
		uc.idleAt = time.Now()
		u.idle = append(u.idle, uc)
		if u.sweep == nil {
			u.sweep = time.AfterFunc(u.maxIdleTime(), u.closeIdleTooLong)
			pooled.Store(u, struct{}{})
		}
		u.mu.Unlock()
		return
	}
	u.mu.Unlock()
	uc.c.Close()
}

func (u *Upstream) maxIdleTime() time.Duration {
	if u.MaxIdleTime > 0 {
		return u.MaxIdleTime
	}
	return DefaultMaxIdleTime
}

// closeIdleTooLong closes the pooled connections idle for MaxIdleTime, and
// comes back when the oldest left will be, while any is pooled.
func (u *Upstream) closeIdleTooLong() {
	limit := u.maxIdleTime()
	u.mu.Lock()
	now := time.Now()
	k := 0 // the pool is oldest first: the first k are idle too long
	for k < len(u.idle) && now.Sub(u.idle[k].idleAt) >= limit {
		k++
	}
	old := slices.Clone(u.idle[:k])
	u.idle = slices.Delete(u.idle, 0, k)
	if len(u.idle) > 0 && !u.closed {
		u.sweep.Reset(limit - now.Sub(u.idle[0].idleAt))
	} else {
		u.sweep = nil
		pooled.Delete(u)
	}
	u.mu.Unlock()
	for _, uc := range old {
		uc.c.Close()
	}
}

// Close retires the upstream: it closes every pooled connection, and each
// connection still in an exchange is closed when released instead of
// pooled (nothing would close it later). Exchanges still work, on
// connections of their own.
func (u *Upstream) Close() {
	u.mu.Lock()
	idle := u.idle
	u.idle = nil
	u.closed = true
	if u.sweep != nil {
		u.sweep.Stop()
		u.sweep = nil
	}
	pooled.Delete(u)
	u.mu.Unlock()
	for _, uc := range idle {
		uc.c.Close()
	}
}

// dialTCP opens engine connections: net.DialTimeout, or a test's
// (SetDialForTests).
func dialTCP(network, addr string, timeout time.Duration) (net.Conn, error) {
	if f := testDial.Load(); f != nil {
		return (*f)(network, addr, timeout)
	}
	return net.DialTimeout(network, addr, timeout)
}

// DialFunc opens a connection, as net.DialTimeout does.
type DialFunc func(network, addr string, timeout time.Duration) (net.Conn, error)

var testDial atomic.Pointer[DialFunc]

// SetDialForTests makes f open every engine connection until restore is
// called: other packages' tests make dials fail as they would (a process
// out of file descriptors) without exhausting their own.
func SetDialForTests(f DialFunc) (restore func()) {
	testDial.Store(&f)
	return func() { testDial.Store(nil) }
}

// pooled holds the upstreams that may have connections pooled (their sweep
// is armed), which ShedIdle closes.
var pooled sync.Map // *Upstream → struct{}

// shedding is held while ShedIdle closes connections: a second dial out of
// descriptors waits for the first's shed to have freed them before it dials
// again. Without it, it found the pools already emptied, the connections
// not yet closed, and its second dial failed too (a CI run: one of 18
// requests moving to another engine got 503 out_of_file_descriptors).
var shedding sync.Mutex

// ShedIdle closes the connections every upstream keeps idle, and reports
// how many it closed: what kvproxy gives up first when it runs out of file
// descriptors.
func ShedIdle() int {
	shedding.Lock()
	defer shedding.Unlock()
	n := 0
	pooled.Range(func(k, _ any) bool {
		u := k.(*Upstream)
		u.mu.Lock()
		idle := u.idle
		u.idle = nil
		u.mu.Unlock()
		for _, uc := range idle {
			if tc, ok := uc.c.(*tls.Conn); ok {
				tc.NetConn().Close() // no close_notify, which may wait 5 s on a stuck engine
			} else {
				uc.c.Close()
			}
		}
		n += len(idle)
		return true
	})
	return n
}
