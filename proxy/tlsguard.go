package proxy

import (
	"errors"
	"net"
	"strconv"
	"syscall"
)

// plainHTTPGuard answers plain HTTP sent to the TLS listener with a 400
// that says so, as Go's net/http does, instead of a handshake failure the
// client sees as an empty reply. It sits under the TLS listener: the first
// bytes a TLS client sends are a handshake record (0x16); an HTTP request
// starts with a method's capital letter.
type plainHTTPGuard struct{ net.Listener }

func (l plainHTTPGuard) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &guardedConn{Conn: c}, nil
}

type guardedConn struct {
	net.Conn
	checked bool
}

var errPlainHTTP = errors.New("plain HTTP on the TLS listener")

var plainHTTPAnswer = func() []byte {
	body := errorJSON("this port speaks HTTPS: the client sent plain HTTP (use https://)", "invalid_request_error", "", "https_required")
	return []byte("HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + string(body))
}()

func (c *guardedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if !c.checked && n > 0 {
		c.checked = true
		if p[0] >= 'A' && p[0] <= 'Z' {
			c.Conn.Write(plainHTTPAnswer)
			return 0, errPlainHTTP
		}
	}
	return n, err
}

// SyscallConn lets the hang-up watcher reach the socket.
func (c *guardedConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}
