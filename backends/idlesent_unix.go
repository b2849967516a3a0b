//go:build unix

package backends

import (
	"crypto/tls"
	"net"
	"syscall"
)

// idlePeek looks at a pooled connection's socket for what the engine sent
// while it was idle (check).
type idlePeek struct {
	rc  syscall.RawConn // nil: not looked at
	b   [1]byte
	n   int
	err error
	fn  func(fd uintptr) // bound once: Control's closure would be allocated per call
}

// newIdlePeek prepares c's peek. A TLS connection's socket is looked at:
// any record arriving while it is idle is unasked (a server sends its
// session tickets as the handshake ends, before the first answer; the
// review found https engines left out).
func newIdlePeek(c net.Conn) *idlePeek {
	p := &idlePeek{}
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	if sc, ok := c.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			p.rc = rc
			p.fn = func(fd uintptr) {
				p.n, _, p.err = syscall.Recvfrom(int(fd), p.b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
			}
		}
	}
	return p
}

// check reports whether the engine sent bytes on the pooled connection
// (sent), or closed it (closed), while it was idle: either way it must not
// carry another request. Bytes of an answer no request asked for (an
// engine, or a box before it, answering twice; a load balancer's late 408)
// would be read as the next exchange's answer, perhaps another tenant's
// (the twenty-sixth session's security review); release sees only those
// that came with the answer. A peek, without the poller: the connection's
// read deadline may have passed while it was idle.
func (p *idlePeek) check() (sent, closed bool) {
	if p.rc == nil {
		return false, false
	}
	if p.rc.Control(p.fn) != nil {
		return false, false
	}
	switch {
	case p.err == nil:
		return p.n > 0, p.n == 0
	case p.err == syscall.EAGAIN || p.err == syscall.EWOULDBLOCK: // nothing came
		return false, false
	}
	return false, true // reset by the engine, or otherwise broken
}
