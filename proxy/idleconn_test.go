package proxy

import (
	"io"
	"net"
	"testing"
	"time"
)

// A slow but steady reader is not cut, however large the one Write (a
// whole answer goes out at once): the idle time bounds each stretch
// without progress (found by the eighth session's second review: a 16 MB
// answer read at 2 MB/s was cut at 3.9 MB with stream_idle_timeout 2s). A
// reader that stops is cut after about the idle time.
func TestWriteIdleConn(t *testing.T) {
	// Loose enough for a reader goroutine starved on a busy machine (at 200
	// ms a race-detector run beside other work cut the steady reader).
	const idle = 600 * time.Millisecond
	pipe := func() (*writeIdleConn, net.Conn) {
		a, b := net.Pipe() // unbuffered: a Write lasts until the reader has taken it
		t.Cleanup(func() { a.Close(); b.Close() })
		return &writeIdleConn{Conn: a, idle: func() time.Duration { return idle }}, b
	}

	w, r := pipe()
	go func(r net.Conn) { // 8 KB every 20 ms: 1 MB takes 2.6 s, more than 4 idle times
		buf := make([]byte, 8<<10)
		for {
			if _, err := r.Read(buf); err != nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}(r)
	if n, err := w.Write(make([]byte, 1<<20)); err != nil || n != 1<<20 {
		t.Fatalf("a steady reader: wrote %d of 1 MB: %v", n, err)
	}

	w, r = pipe()
	go io.CopyN(io.Discard, r, 100<<10) // then stops reading
	start := time.Now()
	n, err := w.Write(make([]byte, 1<<20))
	if ne, ok := err.(net.Error); !ok || !ne.Timeout() || n < 100<<10 || time.Since(start) > 10*idle {
		t.Fatalf("a reader that stops: wrote %d after %v: %v, want a timeout after about %v", n, time.Since(start), err, idle)
	}

	// A deadline of the conn's user (TLS bounding its closing alert) is
	// kept, not moved.
	w, _ = pipe()
	w.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
	start = time.Now()
	if _, err := w.Write([]byte("x")); err == nil || time.Since(start) > idle {
		t.Fatalf("the user's own 50 ms deadline: %v after %v", err, time.Since(start))
	}
}
