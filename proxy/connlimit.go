package proxy

import (
	"bytes"
	"crypto/tls"
	"errors"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// capListener caps the client connections open at once
// (limits.max_connections, read at each accept: a reload changes it). A
// connection over the cap takes the place of the client connection idle
// the longest, as nginx reuses its keep-alive connections when it runs
// out: one that has had its answer and has waited at least idleEvictAfter
// for its next request, with no byte of one come. Without one, it is
// answered a 503 and closed at once, before fasthttp gives it a goroutine
// and buffers: without a cap, idle connections took every file descriptor
// the process had, and then the engine connections, probes and event
// feeds had none either (found by the security review); without the
// eviction, anyone could hold every connection with one request each for
// idle_timeout (the next one).
//
// Past the cap, spareConns more are taken for an operator's one request
// each (probePath: /live, /health, /metrics, /admin/*), which must come
// within spareReadTime; any other request on one is answered the same
// 503. An address holds sparesPerIP of them at most, and with every spare
// taken a new connection takes the place of a spare still waiting for its
// request after spareMinAge, from the address holding the most, the
// oldest (closeWaitingSpare). Clients holding every
// connection (slow headers, a flood) made /live answer 503, and a
// liveness probe then restarted kvproxy, its index lost (the chaos trial).
//
// The operators' own listener (admin_listen) is capped the same way, at
// adminMaxConns, with no spares: every request there is an operator's.
type capListener struct {
	net.Listener
	admin   bool // admin_listen's: its connections say so (countedConn.admin)
	max     func() int
	open    *atomic.Int64
	spares  *atomic.Int64 // spare connections open; nil: none taken
	refusal [][]byte      // one of them written to a connection over the cap; nil under TLS
	refused func()
	evicted func()
	conns   connSet
}

func (l *capListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ok := l.take()
		if !ok && l.conns.closeIdlest(idleEvictAfter) {
			l.evicted()
			ok = l.take()
		}
		if ok {
			cc := &countedConn{Conn: c, open: l.open, set: &l.conns, admin: l.admin}
			l.conns.add(cc)
			return cc, nil
		}
		if l.spares != nil {
			if cc := l.takeSpare(c); cc != nil {
				return cc, nil
			}
		}
		if l.refusal != nil {
			// A new socket's send buffer is empty: this never waits, but
			// the accept loop must not, whatever the kernel does.
			c.SetWriteDeadline(time.Now().Add(10 * time.Millisecond))
			c.Write(l.refusal[rand.IntN(len(l.refusal))])
		}
		l.refused() // counted before the client sees the close (a test read the metric at once)
		c.Close()
	}
}

// take counts a connection open if the cap has room for it.
func (l *capListener) take() bool {
	if l.open.Add(1) <= int64(l.max()) {
		return true
	}
	l.open.Add(-1)
	return false
}

// spareConns is how many connections past the cap are taken for an
// operator's request, sparesPerIP how many of them one address may hold,
// spareReadTime how long one has to send its request, and spareMinAge how
// long it is safe from a newer one (its TLS handshake and request come
// within it).
const (
	spareConns    = 8
	sparesPerIP   = 2
	spareReadTime = 2 * time.Second
	spareMinAge   = 250 * time.Millisecond
)

// takeSpare takes c as a spare connection, if there is room for it (see
// capListener), or nil. Only the accept loop calls it.
func (l *capListener) takeSpare(c net.Conn) *countedConn {
	ip := ipOf(c.RemoteAddr())
	for try := 0; ; try++ {
		own := l.conns.sparesOf(ip)
		if own < sparesPerIP {
			if l.spares.Add(1) <= spareConns {
				now := time.Now()
				cc := &countedConn{Conn: c, open: l.spares, set: &l.conns, spareIP: ip, spareUntil: now.Add(spareReadTime)}
				cc.Conn.SetReadDeadline(cc.spareUntil)
				l.conns.add(cc)
				return cc
			}
			l.spares.Add(-1)
		}
		if try > 0 || !l.conns.closeWaitingSpare(time.Now(), ip, own >= sparesPerIP) {
			return nil
		}
	}
}

// ipOf is the IP of a connection's remote address, "" if none.
func ipOf(a net.Addr) string {
	if ta, ok := a.(*net.TCPAddr); ok {
		return ta.IP.String()
	}
	return ""
}

// probePath reports whether a spare connection may serve a request for
// path: a probe's, a scrape's, an operator's.
func probePath(path []byte) bool {
	switch string(path) {
	case "/metrics", "/health", "/healthz", "/live", "/livez":
		return true
	}
	return bytes.HasPrefix(path, adminPrefix)
}

// idleEvictAfter is how long a client connection must have waited for its
// next request before a new connection over the cap may take its place.
var idleEvictAfter = time.Second

// connSet is the open client connections, and how many of them are idle.
type connSet struct {
	mu       sync.Mutex
	m        map[*countedConn]struct{}
	spares   map[*countedConn]struct{} // those of m taken past the cap
	spareIPs map[string]int            // how many of them each address holds
	idle     atomic.Int64
}

func (s *connSet) add(c *countedConn) {
	s.mu.Lock()
	if s.m == nil {
		s.m, s.spares, s.spareIPs = map[*countedConn]struct{}{}, map[*countedConn]struct{}{}, map[string]int{}
	}
	s.m[c] = struct{}{}
	if c.spare() {
		s.spares[c] = struct{}{}
		s.spareIPs[c.spareIP]++
	}
	s.mu.Unlock()
}

func (s *connSet) remove(c *countedConn) {
	s.mu.Lock()
	delete(s.m, c)
	if _, ok := s.spares[c]; ok {
		delete(s.spares, c)
		if s.spareIPs[c.spareIP]--; s.spareIPs[c.spareIP] <= 0 {
			delete(s.spareIPs, c.spareIP)
		}
	}
	s.mu.Unlock()
}

// sparesOf is how many spare connections ip holds.
func (s *connSet) sparesOf(ip string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.spareIPs[ip]
}

// closeWaitingSpare closes a spare connection still waiting for its
// request at least spareMinAge after it came (of ip's own when only its
// are, for an address at sparesPerIP): of the address holding the most,
// the oldest. It reports whether there was one. Clients holding the
// spares with requests they never finish (slow headers, reopened every
// spareReadTime) shut probes out again (the review); taking the oldest
// alone, a few connections reopened at once made a probe the oldest
// within milliseconds, before its TLS handshake or request was through
// (the verifying trial).
func (s *connSet) closeWaitingSpare(now time.Time, ip string, onlyIP bool) bool {
	s.mu.Lock()
	var victim *countedConn
	for c := range s.spares {
		if c.handled.Load() || now.Sub(c.spareUntil.Add(-spareReadTime)) < spareMinAge || onlyIP && c.spareIP != ip {
			continue
		}
		if n, v := s.spareIPs[c.spareIP], 0; victim != nil {
			v = s.spareIPs[victim.spareIP]
			if n < v || n == v && !c.spareUntil.Before(victim.spareUntil) {
				continue
			}
		}
		victim = c
	}
	s.mu.Unlock()
	if victim == nil {
		return false
	}
	victim.Close()
	return true
}

// closeIdlest closes the connection idle the longest, at least min, and
// reports whether there was one. With none idle it looks at none: a flood
// of connections at the cap costs no scan each.
func (s *connSet) closeIdlest(min time.Duration) bool {
	if s.idle.Load() == 0 {
		return false
	}
	s.mu.Lock()
	var idlest *countedConn
	oldest := coarseNow() - int64(min)
	for c := range s.m {
		if since := c.idleSince.Load(); since > 0 && since <= oldest {
			idlest, oldest = c, since
		}
	}
	s.mu.Unlock()
	// Claimed only if it is still idle since then: a request that began
	// meanwhile keeps it.
	if idlest == nil || !idlest.idleSince.CompareAndSwap(oldest, evicting) {
		return false
	}
	s.idle.Add(-1)
	idlest.Close() // its reader ends, and fasthttp with it
	return true
}

// countedConn is a client connection counted open until its first Close.
type countedConn struct {
	net.Conn
	open   *atomic.Int64
	set    *connSet
	closed atomic.Bool
	// idleSince is when the connection went idle (its answer written,
	// waiting for its next request; coarseNow), 0 while it is not, and
	// evicting once closeIdlest has claimed it.
	idleSince atomic.Int64
	// linger is how long the first Close lingers (lingerClose), in ns: the
	// client may still be sending a body kvproxy did not read (finishBody);
	// 0 for none.
	linger atomic.Int64
	// spareUntil is set for a connection taken past the cap (spareConns):
	// its request must have come by then. handled: it has.
	spareUntil time.Time
	spareIP    string
	handled    atomic.Bool
	// admin: accepted on admin_listen.
	admin bool
}

// spare reports whether the connection was taken past the cap.
func (c *countedConn) spare() bool { return !c.spareUntil.IsZero() }

// SetReadDeadline keeps a spare connection's deadline: fasthttp sets its
// own for each request.
func (c *countedConn) SetReadDeadline(t time.Time) error {
	if c.spare() && (t.IsZero() || t.After(c.spareUntil)) {
		t = c.spareUntil
	}
	return c.Conn.SetReadDeadline(t)
}

func (c *countedConn) SetDeadline(t time.Time) error {
	if err := c.Conn.SetWriteDeadline(t); err != nil {
		return err
	}
	return c.SetReadDeadline(t)
}

// How long a lingering close waits for the client to end its body: in all
// (limits.body_timeout when shorter), and for each next byte.
const (
	lingerTime  = 10 * time.Second
	lingerQuiet = 2 * time.Second
)

// lingerClose closes a connection whose client may still be sending a body
// kvproxy did not read, as nginx's lingering close does: the answer is out,
// so it sends its FIN, then reads and drops what still comes until the
// client ends or closes, goes quiet for lingerQuiet, or d has passed.
// Closed at once on unread bytes, the kernel resets the connection and
// drops the answer the client has not read yet: a client that sends its
// whole body before it reads (Go's net/http, Python's urllib) got
// "connection reset by peer" for a body over the limit.
func (c *countedConn) lingerClose(tc *net.TCPConn, d time.Duration) {
	defer c.Close()
	if tc.CloseWrite() != nil {
		return
	}
	buf := drainBufs.Get().(*[16 << 10]byte)
	defer drainBufs.Put(buf)
	end := time.Now().Add(d)
	for {
		by := time.Now().Add(lingerQuiet)
		if by.After(end) {
			by = end
		}
		tc.SetReadDeadline(by)
		if _, err := tc.Read(buf[:]); err != nil {
			return
		}
	}
}

const evicting = -1

// idle marks the connection idle (fasthttp's StateIdle). A spare one is
// never: it closes after its request, and its eviction would make no room
// under the cap.
func (c *countedConn) idle() {
	if !c.spare() && c.idleSince.CompareAndSwap(0, coarseNow()) {
		c.set.idle.Add(1)
	}
}

// busy marks it not idle: a request's bytes came, or fasthttp took it
// (StateActive, StateHijacked).
func (c *countedConn) busy() {
	if v := c.idleSince.Load(); v > 0 && c.idleSince.CompareAndSwap(v, 0) {
		c.set.idle.Add(-1)
	}
}

func (c *countedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.idleSince.Load() > 0 {
		c.busy()
	}
	return n, err
}

func (c *countedConn) Close() error {
	if d := c.linger.Swap(0); d > 0 {
		if tc, ok := c.Conn.(*net.TCPConn); ok {
			go c.lingerClose(tc, time.Duration(d)) // counted open until it has closed
			return nil
		}
	}
	if c.closed.CompareAndSwap(false, true) {
		c.open.Add(-1)
		if c.idleSince.Swap(evicting) > 0 {
			c.set.idle.Add(-1)
		}
		c.set.remove(c)
	}
	return c.Conn.Close()
}

// SyscallConn lets the hang-up watcher reach the socket.
func (c *countedConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

// countedOf is the countedConn under c, a connection as fasthttp has it
// (under the write deadline's wrapper, and TLS), or nil.
func countedOf(c net.Conn) *countedConn { return countedUnder(c, true) }

// plainCountedOf is the countedConn under c when no TLS is between them
// (a lingering close would cut TLS short of its closing alert); nil
// otherwise.
func plainCountedOf(c net.Conn) *countedConn { return countedUnder(c, false) }

func countedUnder(c net.Conn, throughTLS bool) *countedConn {
	for {
		switch v := c.(type) {
		case *countedConn:
			return v
		case *writeIdleConn:
			c = v.Conn
		case *guardedConn:
			c = v.Conn
		case *tls.Conn:
			if !throughTLS {
				return nil
			}
			c = v.NetConn()
		default:
			return nil
		}
	}
}

const tooManyConnsMsg = "kvproxy has as many client connections open as limits.max_connections allows; try again"

// tooManyConnsAnswers are the answers to a connection over the cap, their
// Retry-After-Ms spread from 0.5 to 1.5 s as retryAfterASecond's, so the
// SDKs, which wait exactly that long, do not come back all at once.
var tooManyConnsAnswers = refusalAnswers(tooManyConnsMsg)

func refusalAnswers(msg string) [][]byte {
	body := errorJSON(msg, "service_unavailable", "", "too_many_connections")
	var out [][]byte
	for ms := 500; ms <= 1500; ms += 125 {
		out = append(out, []byte("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nRetry-After-Ms: "+
			strconv.Itoa(ms)+"\r\nConnection: close\r\nContent-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+string(body)))
	}
	return out
}

// defaultMaxConns bounds the derived cap: an idle keep-alive connection
// holds ~20 KB (its goroutine and read buffer: 3,000 took 64 MB of RSS), so
// 10,000 stay near 200 MB, far more clients than a fleet of engines serves
// at once (vLLM runs 256 sequences an engine by default).
const defaultMaxConns = 10000

// connsFor is how many client connections an open files limit has room
// for beside a fleet of backends: each may hold an engine connection too
// (its request in flight). A reserve stays for the listener, the
// tokenizers' files, logs and the event feeds' replays (8 at a time), and
// 4 descriptors for each backend: its probe and scrape connections, its
// event feed (256 backends held 779 descriptors at rest: the scale trial)
// and the engine connection its pool keeps idle after its requests
// (requests spread over more backends than clients held one each: the
// review).
func connsFor(nofile uint64, backends int) uint64 {
	reserve := min(nofile/4, 64) + 4*uint64(backends)
	if reserve >= nofile {
		return 0
	}
	return (nofile - reserve) / 2
}

// autoMaxConns is the cap when limits.max_connections is 0: what the open
// files limit has room for, at most defaultMaxConns (nofile 0: unknown) and
// at least a quarter of the limit up to 64: a fleet too large for the limit
// is warned of (logWarnings), and running out of descriptors costs a 503
// each, where a cap of 1 refused every client but one.
func autoMaxConns(nofile uint64, backends int) int {
	if nofile == 0 {
		return defaultMaxConns
	}
	least := max(1, min(64, nofile/4))
	return int(max(least, min(defaultMaxConns, connsFor(nofile, backends))))
}

// MaxConnections is the cap on client connections in force
// (limits.max_connections, or the one derived from the open files limit).
func (s *Server) MaxConnections() int { return s.maxConns() }

// maxConns is the cap on client connections in force.
func (s *Server) maxConns() int {
	st := s.st.Load()
	if n := st.cfg.Limits.MaxConnections; n > 0 {
		return n
	}
	return st.autoConns
}

// refuseLog counts the connections a listener's cap refused and says how
// many, in a line every refuseLogEvery at most: at once if no line was
// written in the last refuseLogEvery, else in a line due when that time is
// up, with every refusal since (it waited for the next refusal after it,
// and an operator reading the log after a burst saw 1).
type refuseLog struct {
	counted prometheus.Counter
	say     func(refused int)
	mu      sync.Mutex
	last    time.Time
	refused int  // since the last line
	pending bool // a line is due at last + refuseLogEvery
}

// refuseLogEvery is how often at most the refusals are logged.
var refuseLogEvery = 10 * time.Second

// add counts a connection refused.
func (l *refuseLog) add() {
	l.counted.Inc()
	l.mu.Lock()
	l.refused++
	if wait := refuseLogEvery - time.Since(l.last); wait > 0 {
		if !l.pending {
			l.pending = true
			time.AfterFunc(wait, l.flush)
		}
		l.mu.Unlock()
		return
	}
	l.mu.Unlock()
	l.flush()
}

func (l *refuseLog) flush() {
	l.mu.Lock()
	n := l.refused
	l.refused, l.last, l.pending = 0, time.Now(), false
	l.mu.Unlock()
	if n > 0 {
		l.say(n)
	}
}

// connRefused counts a client connection refused over the cap, and logs it.
func (s *Server) connRefused() { s.refuseLog.add() }
