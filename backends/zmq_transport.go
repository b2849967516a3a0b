package backends

import (
	"bufio"
	"context"
	"net"
	"strings"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// zmq4 reads each frame's header and body straight from the socket: three
// or more read syscalls per frame, which dominated the subscriber's CPU.
// Subscribers therefore dial through "kvtcp", a tcp transport whose
// connections read through a 64 KiB buffer. The wire is plain ZMTP over TCP:
// any publisher (vLLM's pyzmq, zmq4) is unaware of it.
const bufferedTCP = "kvtcp"

func init() {
	// An error means the name is taken (a second registration in the same
	// binary); dialEndpoint then keeps plain tcp.
	if zmq4.RegisterTransport(bufferedTCP, bufTransport{}) != nil {
		registeredBufTCP = false
	}
}

var registeredBufTCP = true

// dialEndpoint is the endpoint a subscriber dials for ep: tcp goes through
// the buffered transport, other transports are unchanged.
func dialEndpoint(ep string) string {
	if registeredBufTCP && strings.HasPrefix(ep, "tcp://") {
		return bufferedTCP + "://" + ep[len("tcp://"):]
	}
	return ep
}

type bufTransport struct{}

func (bufTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	return &bufConn{Conn: c, r: bufio.NewReaderSize(c, 64<<10)}, nil
}

func (bufTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	var lc net.ListenConfig
	return lc.Listen(ctx, "tcp", addr)
}

func (bufTransport) Addr(ep string) (string, error) {
	return transport.New("tcp").Addr(ep)
}

// bufConn reads through a buffer; writes, deadlines and Close go to the
// connection.
type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufConn) Read(p []byte) (int, error) { return c.r.Read(p) }
