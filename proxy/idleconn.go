package proxy

import (
	"errors"
	"net"
	"sync/atomic"
	"syscall"
	"time"
)

// writeIdleListener gives each client connection a write deadline that
// moves as bytes go out: a client that takes none for stream_idle_timeout
// loses its connection, and with it its stream and every slot the stream
// held. Without one, a client that stops reading but keeps its connection
// open held its router, backend and tenant slots and an engine connection
// for as long as it liked (found by the eighth session's review); a
// deadline for the whole response (fasthttp's WriteTimeout) would cut long
// streams instead.
type writeIdleListener struct {
	net.Listener
	idle func() time.Duration // read at each move: a reload changes it
}

func (l writeIdleListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &writeIdleConn{Conn: c, idle: l.idle}, nil
}

// writeIdleConn moves its write deadline only when less than half the idle
// time is left, so a stream pays a clock read per write and a deadline
// change once in a while. A deadline its user sets (TLS bounding its
// closing alert) is left as it is until cleared.
type writeIdleConn struct {
	net.Conn
	idle     func() time.Duration
	deadline atomic.Int64 // the write deadline set, Unix ns; 0: none
	fixed    atomic.Bool  // the user's own deadline
}

// idleWriteChunk bounds what one deadline covers: a whole answer goes out
// in one Write, which a slow but steady reader may take longer than the
// idle time to take.
const idleWriteChunk = 32 << 10

func (c *writeIdleConn) Write(p []byte) (int, error) {
	if c.fixed.Load() {
		return c.Conn.Write(p)
	}
	written := 0
	for {
		chunk := p[written:]
		if len(chunk) > idleWriteChunk {
			chunk = chunk[:idleWriteChunk]
		}
		now := time.Now()
		if idle := c.idle(); c.deadline.Load()-now.UnixNano() < int64(idle/2) {
			next := now.Add(idle)
			c.deadline.Store(next.UnixNano())
			c.Conn.SetWriteDeadline(next)
		}
		n, err := c.Conn.Write(chunk)
		written += n
		if err != nil || written == len(p) {
			return written, err
		}
	}
}

func (c *writeIdleConn) SetWriteDeadline(t time.Time) error {
	c.own(t)
	return c.Conn.SetWriteDeadline(t)
}

func (c *writeIdleConn) SetDeadline(t time.Time) error {
	c.own(t)
	return c.Conn.SetDeadline(t)
}

func (c *writeIdleConn) own(t time.Time) {
	c.fixed.Store(!t.IsZero())
	if t.IsZero() {
		c.deadline.Store(0)
	} else {
		c.deadline.Store(t.UnixNano())
	}
}

// SyscallConn lets the hang-up watcher reach the socket.
func (c *writeIdleConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}
