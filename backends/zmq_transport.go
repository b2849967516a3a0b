package backends

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// zmq4 reads each frame's header and body straight from the socket: three
// or more read syscalls per frame, which dominated the subscriber's CPU.
// Subscribers therefore dial through "kvtcp", a tcp transport whose
// connections read through a 64 KiB buffer. The wire is plain ZMTP over TCP:
// any publisher (vLLM's pyzmq, zmq4) is unaware of it. "kvipc" is the same
// over a unix socket (ipc://): its frames are bounded as tcp's are (the
// fuzzing trial: a frame announcing 2^50 bytes over ipc ended the process).
const (
	bufferedTCP = "kvtcp"
	bufferedIPC = "kvipc"
)

func init() {
	// An error means the name is taken (a second registration in the same
	// binary); dialEndpoint then keeps zmq4's own transport.
	registeredBuf = zmq4.RegisterTransport(bufferedTCP, bufTransport{network: "tcp"}) == nil &&
		zmq4.RegisterTransport(bufferedIPC, bufTransport{network: "unix"}) == nil
}

var registeredBuf bool

// dialEndpoint is the endpoint a subscriber dials for ep: tcp and ipc go
// through the buffered transports, others are unchanged.
func dialEndpoint(ep string) string {
	switch {
	case registeredBuf && strings.HasPrefix(ep, "tcp://"):
		return bufferedTCP + "://" + ep[len("tcp://"):]
	case registeredBuf && strings.HasPrefix(ep, "ipc://"):
		return bufferedIPC + "://" + ep[len("ipc://"):]
	}
	return ep
}

// buffered reports whether a dialled endpoint goes through a buffered
// transport (and its connections are tracked).
func buffered(dialed string) bool {
	return strings.HasPrefix(dialed, bufferedTCP+"://") || strings.HasPrefix(dialed, bufferedIPC+"://")
}

type bufTransport struct{ network string }

// handshakeTimeout bounds the ZMTP handshake (greeting and READY) after a
// connection is made: zmq4 reads them with no deadline, and a peer that
// accepts TCP but never speaks ZMTP held the subscriber there for good
// (no redial, and Close waiting on it forever).
var handshakeTimeout = 5 * time.Second

func (b bufTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	tr, _ := ctx.Value(connTrackerKey{}).(*connTracker)
	c, err := tr.dial(ctx, d, b.network, addr)
	if err != nil {
		return nil, err
	}
	// ctx is the socket's: closing the socket (or its owner's context
	// ending, through tr) also ends a handshake in progress.
	context.AfterFunc(ctx, func() { c.Close() })
	if !tr.add(c) {
		c.Close()
		return nil, net.ErrClosed
	}
	c.SetReadDeadline(time.Now().Add(handshakeTimeout))
	return &bufConn{Conn: c, r: bufio.NewReaderSize(c, 64<<10), skip: zmtpGreeting, shaking: true}, nil
}

// socket is a zmq4 socket (SUB, DEALER) that ends without leaving its
// reader goroutine behind. zmq4 reads each connection in a goroutine that
// hands every message to a queue of 10 and watches the socket's context
// only between messages: closed (or cancelled) while that queue is full and
// no longer read, it blocks on the queue for good. So over kvtcp and kvipc
// the socket lives on a context of its own, and when its owner's context
// ends (or it is shut) its connections are closed instead: the reader then
// reports the read error through the queue and exits, and Recv returns that
// error after what was queued before it.
//
// Other transports (inproc) keep zmq4's way: the socket is closed with its
// owner's context, and a reader stopped while its queue is full stays
// blocked.
type socket struct {
	zmq4.Socket
	conns   *connTracker // nil: not over kvtcp or kvipc
	unwatch func() bool  // stops closing the connections when the owner's context ends
	reading bool         // a reader goroutine is running: Dial succeeded and Recv has not failed
}

func newSocket(ctx context.Context, endpoint string, open func(context.Context, ...zmq4.Option) zmq4.Socket, opts ...zmq4.Option) *socket {
	if !buffered(dialEndpoint(endpoint)) {
		return &socket{Socket: open(ctx, opts...), unwatch: func() bool { return false }}
	}
	tr := &connTracker{owner: ctx}
	sctx := context.WithValue(context.WithoutCancel(ctx), connTrackerKey{}, tr)
	return &socket{Socket: open(sctx, opts...), conns: tr, unwatch: context.AfterFunc(ctx, tr.closeAll)}
}

func (s *socket) Dial(endpoint string) (err error) {
	defer func() {
		// zmq4 panics on some handshakes it cannot read, in this goroutine
		// (a READY whose metadata is cut short, a socket type it does not
		// know: the fuzzing trial ended the process with a peer at the
		// events endpoint): the peer costs the connection (the caller
		// shuts the socket), not the process.
		if p := recover(); p != nil {
			err, s.reading = fmt.Errorf("zmq4: malformed ZMTP handshake: %v", p), false
		}
	}()
	err = s.Socket.Dial(dialEndpoint(endpoint))
	s.reading = err == nil
	return err
}

func (s *socket) Recv() (zmq4.Msg, error) {
	msg, err := s.Socket.Recv()
	if err != nil {
		s.reading = false
	}
	return msg, err
}

// shut closes the socket once its reader goroutine has ended.
func (s *socket) shut() {
	s.unwatch()
	if s.conns != nil {
		s.conns.closeAll()
		for s.reading {
			s.Recv()
		}
	}
	s.Close()
}

type connTrackerKey struct{}

// connTracker holds the connections of one socket over kvtcp or kvipc, so they
// can be closed without closing the socket.
type connTracker struct {
	owner  context.Context // a dial in progress gives up when it ends
	mu     sync.Mutex
	conns  []net.Conn
	closed bool
}

func (t *connTracker) dial(ctx context.Context, d transport.Dialer, network, addr string) (net.Conn, error) {
	if t != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(ctx)
		defer cancel()
		defer context.AfterFunc(t.owner, cancel)()
	}
	return d.DialContext(ctx, network, addr)
}

// add tracks c; false means the connections are closed already.
func (t *connTracker) add(c net.Conn) bool {
	if t == nil {
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.conns = append(t.conns, c)
	return true
}

func (t *connTracker) closeAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	for _, c := range t.conns {
		c.Close()
	}
	t.conns = nil
}

func (b bufTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	var lc net.ListenConfig
	return lc.Listen(ctx, b.network, addr)
}

func (b bufTransport) Addr(ep string) (string, error) {
	return transport.New(b.network).Addr(ep)
}

// MaxZMQFrame bounds one ZMTP frame a subscriber accepts. zmq4 allocates a
// frame's announced size before reading it, and a failed allocation (an
// absurd size from a broken peer or garbage on the wire) panics in its
// reader goroutine, ending the process; a larger frame ends the connection
// instead, and the subscriber reconnects. vLLM's event batches are far
// smaller.
const MaxZMQFrame = 64 << 20

// zmtpGreeting is the size of the ZMTP 3 greeting that precedes the frames.
const zmtpGreeting = 64

// errFrameTooLarge is the read error of a frame over MaxZMQFrame.
var errFrameTooLarge = errors.New("zmq frame larger than " + strconv.Itoa(MaxZMQFrame>>20) + " MiB")

// bufConn reads through a buffer; writes, deadlines and Close go to the
// connection. It follows the ZMTP framing of what it reads (a greeting,
// then frames: a flags byte, a size of 1 byte or, with flag 0x02, 8 bytes,
// the body) to refuse frames over MaxZMQFrame before zmq4 sees their size.
type bufConn struct {
	net.Conn
	r *bufio.Reader

	skip int64   // bytes of the greeting or of a frame body still to pass
	hdr  [9]byte // the frame header being read
	hdrN int
	err  error
	// shaking: the handshake deadline is armed until the first frame after
	// the greeting (the peer's READY) has been read.
	shaking bool
	frames  int
}

func (c *bufConn) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.r.Read(p)
	if ferr := c.follow(p[:n]); ferr != nil {
		// The bytes before the header may go; the header may not.
		c.err = ferr
		return 0, ferr
	}
	return n, err
}

// follow advances the framing over b and checks each frame's size.
func (c *bufConn) follow(b []byte) error {
	for len(b) > 0 {
		if c.skip > 0 {
			k := int64(len(b))
			if k > c.skip {
				k = c.skip
			}
			c.skip -= k
			b = b[k:]
			if c.skip == 0 {
				c.passed()
			}
			continue
		}
		c.hdr[c.hdrN] = b[0]
		c.hdrN++
		b = b[1:]
		need := 2
		if c.hdr[0]&0x02 != 0 {
			need = 9
		}
		if c.hdrN < need {
			continue
		}
		size := uint64(c.hdr[1])
		if need == 9 {
			size = binary.BigEndian.Uint64(c.hdr[1:9])
		}
		if size > MaxZMQFrame {
			return errFrameTooLarge
		}
		c.skip, c.hdrN = int64(size), 0
		c.frames++
		if size == 0 {
			c.passed()
		}
	}
	return nil
}

// passed is called when the greeting or a frame has been read whole: after
// the first frame (the peer's READY) the handshake is over.
func (c *bufConn) passed() {
	if c.shaking && c.frames > 0 {
		c.shaking = false
		c.Conn.SetReadDeadline(time.Time{})
	}
}
