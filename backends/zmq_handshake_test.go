package backends

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// zmtpNullGreeting is a ZMTP 3.0 greeting with the NULL mechanism.
func zmtpNullGreeting() []byte {
	g := make([]byte, zmtpGreeting)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:32], "NULL")
	return g
}

// zmtpReady is a READY command with metadata (name, then a 4-byte length
// and the value, each), cut to its first cut bytes when cut > 0.
func zmtpReady(cut int, props ...string) []byte {
	body := []byte("\x05READY")
	for i := 0; i+1 < len(props); i += 2 {
		body = append(body, byte(len(props[i])))
		body = append(body, props[i]...)
		body = binary.BigEndian.AppendUint32(body, uint32(len(props[i+1])))
		body = append(body, props[i+1]...)
	}
	if cut > 0 {
		body = body[:cut]
	}
	return append([]byte{0x04, byte(len(body))}, body...)
}

// fakePeer serves every connection of ln with greeting, then what.
func fakePeer(t *testing.T, ln net.Listener, what []byte) {
	acceptEach(t, ln, func(c net.Conn) {
		c.Write(zmtpNullGreeting())
		c.Write(what)
		io.Copy(io.Discard, c)
	})
}

// subscribeUntil runs a subscriber of ep until its stats meet cond (10 s at
// most), and stops it.
func subscribeUntil(t *testing.T, ep string, cond func(ZMQStats) bool) {
	t.Helper()
	sub := NewZMQSubscriber(ZMQConfig{Endpoint: ep, BackoffMin: 5 * time.Millisecond, BackoffMax: 20 * time.Millisecond}, &recordSink{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if err := sub.Wait(wctx, cond); err != nil {
		t.Fatalf("%v: %+v", err, sub.Stats())
	}
}

// A peer at the events endpoint whose handshake zmq4 cannot read (a READY
// whose metadata is cut short, a socket type zmq4 does not know) costs the
// feed its connection, not the process: zmq4 panicked in the subscriber's
// goroutine, and kvproxy exited (the twenty-sixth session's fuzzing trial).
// Over tcp and over ipc.
func TestMalformedZMTPHandshakeCostsTheConnection(t *testing.T) {
	for name, ready := range map[string][]byte{
		"metadata cut short":  zmtpReady(8, "a", "b"), // a name of 1 byte, no value length
		"unknown socket type": zmtpReady(0, "Socket-Type", "SERVER"),
		"no socket type":      zmtpReady(0),
	} {
		for _, network := range []string{"tcp", "unix"} {
			t.Run(name+"/"+network, func(t *testing.T) {
				addr := "127.0.0.1:0"
				if network == "unix" {
					addr = filepath.Join(t.TempDir(), "events.ipc")
				}
				ln, err := net.Listen(network, addr)
				if err != nil {
					t.Fatal(err)
				}
				fakePeer(t, ln, ready)
				ep := "tcp://" + ln.Addr().String()
				if network == "unix" {
					ep = "ipc://" + addr
				}
				subscribeUntil(t, ep, func(s ZMQStats) bool { return strings.Contains(s.LastError, "malformed ZMTP handshake") })
			})
		}
	}
}

// Over ipc, a frame of absurd size costs the connection too: only tcp went
// through the frame follower, and zmq4's allocation of 2^50 bytes ended
// the process (the fuzzing trial).
func TestHugeZMQFrameOverIPC(t *testing.T) {
	path := filepath.Join(t.TempDir(), "events.ipc")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	var huge [9]byte
	huge[0] = 0x02
	binary.BigEndian.PutUint64(huge[1:], 1<<50)
	fakePeer(t, ln, append(zmtpReady(0, "Socket-Type", "PUB"), huge[:]...))
	subscribeUntil(t, "ipc://"+path, func(s ZMQStats) bool { return s.Reconnects >= 2 })
}
