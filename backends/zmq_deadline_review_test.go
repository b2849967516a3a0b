package backends

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"
)

// chunkConn serves data in reads of at most chunk bytes and records the read
// deadlines set on it.
type chunkConn struct {
	net.Conn
	data      []byte
	chunk     int
	deadlines []time.Time
}

func (c *chunkConn) Read(p []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := min(len(p), c.chunk, len(c.data))
	copy(p, c.data[:n])
	c.data = c.data[n:]
	return n, nil
}

func (c *chunkConn) SetReadDeadline(t time.Time) error {
	c.deadlines = append(c.deadlines, t)
	return nil
}

func zmtpFrame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		b := append([]byte{flags | 0x02}, binary.BigEndian.AppendUint64(nil, uint64(len(body)))...)
		return append(b, body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// The handshake deadline is cleared once, exactly when the peer's first
// frame after the greeting (its READY) has been read whole, however the
// bytes are split across reads and whatever zmq4 asks for at a time; a short
// READY, a long one and an empty first frame alike.
func TestHandshakeDeadlineClearedAfterFirstFrame(t *testing.T) {
	greeting := make([]byte, zmtpGreeting)
	for name, first := range map[string][]byte{
		"short READY": zmtpFrame(0x04, append([]byte{5}, "READY\x0bSocket-Type\x00\x00\x00\x03PUB"...)),
		"long READY":  zmtpFrame(0x04, append(append([]byte{5}, "READY"...), make([]byte, 1000)...)),
		"empty frame": zmtpFrame(0x00, nil),
	} {
		after := zmtpFrame(0x01, []byte("topic"))
		after = append(after, zmtpFrame(0x00, make([]byte, 300))...)
		wire := append(append(append([]byte(nil), greeting...), first...), after...)
		for _, chunk := range []int{1, 2, 3, 7, 64, 65, 1 << 16} {
			for _, ask := range []int{1, 8, 64, 4096} {
				cc := &chunkConn{data: append([]byte(nil), wire...), chunk: chunk}
				c := &bufConn{Conn: cc, r: bufio.NewReaderSize(cc, 64<<10), skip: zmtpGreeting, shaking: true}
				read, clearedAt := 0, -1
				buf := make([]byte, ask)
				for read < len(wire) {
					n, err := c.Read(buf)
					if err != nil {
						t.Fatalf("%s chunk %d ask %d: %v after %d bytes", name, chunk, ask, err, read)
					}
					read += n
					if clearedAt < 0 && len(cc.deadlines) > 0 {
						clearedAt = read
					}
				}
				want := len(greeting) + len(first)
				if len(cc.deadlines) != 1 || !cc.deadlines[0].IsZero() {
					t.Fatalf("%s chunk %d ask %d: deadlines %v, want one clear", name, chunk, ask, cc.deadlines)
				}
				// With reads of ask bytes, the clear happens in the read that
				// completes the first frame.
				if clearedAt < want || clearedAt >= want+ask {
					t.Fatalf("%s chunk %d ask %d: cleared after %d bytes, first frame ends at %d", name, chunk, ask, clearedAt, want)
				}
			}
		}
	}
}

// A real feed that is busy, then idle, then busy again, each phase longer
// than the handshake timeout, keeps its one connection; so does a replay
// after such a pause (the DEALER dials through the same transport).
func TestFeedOutlivesHandshakeTimeout(t *testing.T) {
	old := handshakeTimeout
	handshakeTimeout = 100 * time.Millisecond
	defer func() { handshakeTimeout = old }()
	eng := newTestEngine(t, 64)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()})
	f.warmUp()
	end := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(end) {
		eng.publish(0, removed(1))
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // idle: nothing to read for 3 timeouts
	eng.dropLive = true
	eng.publish(0, removed(2)) // a gap: the next live batch triggers a replay
	eng.dropLive = false
	last := eng.publish(0, removed(3))
	f.wait("the batch after the gap", func(s ZMQStats) bool { return s.LastSeq == int64(last) })
	if s := f.sub.Stats(); s.Reconnects != 0 || s.Clears != 0 || s.Replays == 0 {
		t.Fatalf("a healthy feed was dropped or cleared: %+v", s)
	}
}
