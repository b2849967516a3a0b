package backends

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// relayTo forwards connections from a loopback listener to target (both
// ways) and hands the test each client-side connection, to inject bytes.
func relayTo(t *testing.T, target string) (addr string, clients <-chan net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	ch := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			var once sync.Once
			closeBoth := func() { c.Close(); up.Close() }
			go func() { io.Copy(up, c); once.Do(closeBoth) }()
			go func() { io.Copy(c, up); once.Do(closeBoth) }()
			ch <- c
		}
	}()
	return "tcp://" + ln.Addr().String(), ch
}

// A publisher that announces a frame of absurd size (garbage on the wire, a
// broken engine) costs the feed its connection, not the process: zmq4
// allocates a frame's announced size at once, and the panic of a failed
// allocation in its reader goroutine cannot be recovered.
func TestHugeZMQFrameDropsTheConnection(t *testing.T) {
	eng := newTestEngine(t, 16)
	addr, clients := relayTo(t, strings.TrimPrefix(eng.pubAddr, "tcp://"))
	sub := NewZMQSubscriber(ZMQConfig{Endpoint: addr, BackoffMin: 5 * time.Millisecond, BackoffMax: 20 * time.Millisecond}, &recordSink{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if err := sub.Wait(wctx, func(s ZMQStats) bool { return s.Connected }); err != nil {
		t.Fatal(err)
	}
	c := <-clients
	// Between frames (nothing is published): a long message frame of 2^50 bytes.
	var hdr [9]byte
	hdr[0] = 0x02
	binary.BigEndian.PutUint64(hdr[1:], 1<<50)
	if _, err := c.Write(hdr[:]); err != nil {
		t.Fatal(err)
	}
	if err := sub.Wait(wctx, func(s ZMQStats) bool { return s.Reconnects >= 1 && s.Connected }); err != nil {
		t.Fatal(err)
	}
	// The feed goes on over the new connection.
	for i := uint64(0); ; i++ {
		eng.publish(0, removed(i))
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		err := sub.Wait(ctx, func(s ZMQStats) bool { return s.Batches > 0 })
		cancel()
		if err == nil {
			break
		}
		if wctx.Err() != nil {
			t.Fatalf("no batch after reconnecting: %+v", sub.Stats())
		}
	}
}

// A peer that accepts TCP but never speaks ZMTP: the subscriber gives up
// the handshake after handshakeTimeout and dials again, and its Run ends as
// soon as it is cancelled (it waited for the greeting for good, and so did
// a proxy's Shutdown).
func TestSilentZMQPeer(t *testing.T) {
	old := handshakeTimeout
	handshakeTimeout = 200 * time.Millisecond
	defer func() { handshakeTimeout = old }()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c // held open, never written to
		}
	}()
	sub := NewZMQSubscriber(ZMQConfig{Endpoint: "tcp://" + ln.Addr().String(), BackoffMin: 5 * time.Millisecond, BackoffMax: 20 * time.Millisecond}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	for i := 0; i < 2; i++ { // a second connection: the first handshake was given up
		select {
		case c := <-accepted:
			defer c.Close()
		case <-time.After(5 * time.Second):
			t.Fatalf("connection %d never came", i+1)
		}
	}
	cancel()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("Run did not end when cancelled during a handshake")
	}
}
