package testutil

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// Relay passes TCP connections through to a target until it is frozen:
// from then on it reads what either side sends and passes nothing on, as
// a peer that hangs without closing its connections (kill -STOP) does.
type Relay struct {
	ln     net.Listener
	frozen atomic.Bool
}

// NewRelay listens on a loopback port and relays each connection to
// target; the test's cleanup closes everything.
func NewRelay(t *testing.T, target string) *Relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Relay{ln: ln}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, u)
			mu.Unlock()
			go r.pipe(c, u)
			go r.pipe(u, c)
		}
	}()
	return r
}

// Addr is the relay's address (host:port).
func (r *Relay) Addr() string { return r.ln.Addr().String() }

// Freeze stops passing bytes on, for good.
func (r *Relay) Freeze() { r.frozen.Store(true) }

func (r *Relay) pipe(from, to net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := from.Read(buf)
		if n > 0 && !r.frozen.Load() {
			if _, werr := to.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
