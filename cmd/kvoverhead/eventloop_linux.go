package main

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strconv"
	"syscall"
	"unsafe"
)

// serveEventLoop runs the floor of a Go proxy that does not use Go's
// netpoller: nginx's I/O model written in Go. One loop per core
// (GOMAXPROCS), each with its own epoll instance and its own SO_REUSEPORT
// listener; sockets are non-blocking and edge-triggered; a read shorter
// than the buffer is taken to have drained the socket (as nginx does), so
// no read ends in EAGAIN unless the kernel had nothing; no goroutine per
// connection, no hand-off between threads. Each client connection gets its
// own keep-alive upstream connection on its first request. Requests are
// forwarded as they came (a head and a Content-Length body); answers are
// relayed read by read, framed by Content-Length or chunked encoding so the
// client connection can carry the next request. It does no more HTTP than
// that, and nothing else: it measures what Go costs with nginx's event
// model, not a proxy anyone should run.
func serveEventLoop(listen, upstream string) error {
	lsa, err := inet4(listen)
	if err != nil {
		return err
	}
	usa, err := inet4(upstream)
	if err != nil {
		return err
	}
	n := runtime.GOMAXPROCS(0)
	errc := make(chan error, n)
	for range n {
		l, err := newLoop(lsa, usa)
		if err != nil {
			return err
		}
		go func() { errc <- l.run() }()
	}
	fmt.Printf("listening on http://%s\n", listen)
	return <-errc
}

func inet4(hostport string) (*syscall.SockaddrInet4, error) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, err
	}
	ip := net.ParseIP(host).To4()
	p, perr := strconv.Atoi(port)
	if ip == nil || perr != nil {
		return nil, fmt.Errorf("%q: want an IPv4 address and port", hostport)
	}
	sa := &syscall.SockaddrInet4{Port: p}
	copy(sa.Addr[:], ip)
	return sa, nil
}

// elConn is one socket of the loop: a client connection or its upstream.
type elConn struct {
	fd       int
	peer     *elConn // client ↔ its upstream; nil until the first request
	upstream bool
	in       []byte // client: received bytes not yet forwarded
	out      []byte // bytes the socket would not take yet
	// connecting: the upstream's connect has not completed.
	connecting bool
	// busy: a client's request is upstream and its answer not all relayed.
	busy bool
	// paused: an upstream not read because its client's out is not empty.
	paused bool
	resp   responseFramer // upstream: where the answer in flight ends
}

type loop struct {
	ep, lfd int
	up      *syscall.SockaddrInet4
	conns   []*elConn // by fd
	buf     []byte
	events  [128]syscall.EpollEvent
}

// elEvents: every readiness, edge-triggered (EPOLLET is 1<<31; syscall
// spells it as a negative int).
const elEvents uint32 = syscall.EPOLLIN | syscall.EPOLLOUT | syscall.EPOLLRDHUP | 1<<31

const soReusePort = 0xf // SO_REUSEPORT on Linux, which syscall does not name

func newLoop(listen, up *syscall.SockaddrInet4) (*loop, error) {
	lfd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			syscall.Close(lfd)
		}
	}()
	for _, opt := range []int{syscall.SO_REUSEADDR, soReusePort} {
		if err := syscall.SetsockoptInt(lfd, syscall.SOL_SOCKET, opt, 1); err != nil {
			return nil, err
		}
	}
	if err := syscall.Bind(lfd, listen); err != nil {
		return nil, err
	}
	if err := syscall.Listen(lfd, 4096); err != nil {
		return nil, err
	}
	ep, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := syscall.EpollCtl(ep, syscall.EPOLL_CTL_ADD, lfd, &syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(lfd)}); err != nil {
		syscall.Close(ep)
		return nil, err
	}
	ok = true
	return &loop{ep: ep, lfd: lfd, up: up, buf: make([]byte, 64<<10)}, nil
}

func (l *loop) run() error {
	for {
		n, err := l.wait()
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		for _, ev := range l.events[:n] {
			fd := int(ev.Fd)
			if fd == l.lfd {
				l.accept()
				continue
			}
			c := l.conn(fd)
			if c == nil {
				continue
			}
			if ev.Events&(syscall.EPOLLOUT|syscall.EPOLLERR) != 0 {
				l.writable(c)
			}
			if l.conn(fd) == c && ev.Events&(syscall.EPOLLIN|syscall.EPOLLRDHUP|syscall.EPOLLHUP|syscall.EPOLLERR) != 0 {
				l.readable(c)
			}
		}
	}
}

// wait is epoll_wait as a raw system call: the runtime is not told the
// loop blocks, so it keeps the loop's P. Told (syscall.EpollWait), its
// monitor thread takes the P back from a wait of more than 20 µs and the
// runtime hands it over and back with futex calls: measured on one stream
// at a time, 3.7 futex and 2.9 nanosleep calls per relayed event, more
// CPU than the relaying. Unaware, the runtime only interrupts the wait
// every 10 ms to preempt the loop (EINTR, which run retries), and the
// loop's calls give it the safe points a collection needs.
func (l *loop) wait() (int, error) {
	n, _, e := syscall.RawSyscall6(syscall.SYS_EPOLL_PWAIT, uintptr(l.ep), uintptr(unsafe.Pointer(&l.events[0])), uintptr(len(l.events)), ^uintptr(0), 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

func (l *loop) conn(fd int) *elConn {
	if fd < len(l.conns) {
		return l.conns[fd]
	}
	return nil
}

func (l *loop) add(c *elConn) error {
	if err := syscall.SetsockoptInt(c.fd, syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1); err != nil {
		return err
	}
	if err := syscall.EpollCtl(l.ep, syscall.EPOLL_CTL_ADD, c.fd, &syscall.EpollEvent{Events: elEvents, Fd: int32(c.fd)}); err != nil {
		return err
	}
	for c.fd >= len(l.conns) {
		l.conns = append(l.conns, nil)
	}
	l.conns[c.fd] = c
	return nil
}

func (l *loop) accept() {
	for {
		fd, _, err := syscall.Accept4(l.lfd, syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC)
		if err != nil {
			return // EAGAIN: accepted all; anything else: try on the next event
		}
		if l.add(&elConn{fd: fd}) != nil {
			syscall.Close(fd)
		}
	}
}

// close closes c and its peer: either side gone ends the exchange.
func (l *loop) close(c *elConn) {
	for _, x := range []*elConn{c, c.peer} {
		if x != nil && l.conn(x.fd) == x {
			l.conns[x.fd] = nil
			syscall.Close(x.fd)
		}
	}
}

// read reads what c's socket holds into l.buf: n > 0 with more possibly
// waiting (a full buffer), n > 0 drained, 0 with eof (peer closed or
// failed) or 0 with nothing (EAGAIN).
func (l *loop) read(c *elConn) (n int, more, eof bool) {
	for {
		n, err := syscall.Read(c.fd, l.buf)
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			return 0, false, false
		case err != nil || n == 0:
			return 0, false, true
		}
		return n, n == len(l.buf), false
	}
}

func (l *loop) readable(c *elConn) {
	if c.upstream {
		l.relay(c)
		return
	}
	for {
		n, more, eof := l.read(c)
		if eof {
			l.close(c)
			return
		}
		c.in = append(c.in, l.buf[:n]...)
		if !more {
			break
		}
	}
	l.forward(c)
}

// forward sends the client's next complete request upstream, if it has one
// and none is in flight.
func (l *loop) forward(c *elConn) {
	if c.busy {
		return
	}
	end := requestEnd(c.in)
	if end == 0 {
		if len(c.in) > 1<<20 {
			l.close(c)
		}
		return
	}
	if end < 0 {
		l.write(c, []byte("HTTP/1.1 411 Length Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"))
		l.close(c)
		return
	}
	if c.peer == nil {
		u, err := l.dial()
		if err != nil {
			l.write(c, []byte("HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"))
			l.close(c)
			return
		}
		c.peer, u.peer = u, c
	}
	c.busy = true
	c.peer.resp = responseFramer{noBody: bytes.HasPrefix(c.in, []byte("HEAD "))}
	l.write(c.peer, c.in[:end])
	c.in = c.in[:copy(c.in, c.in[end:])]
}

func (l *loop) dial() (*elConn, error) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	u := &elConn{fd: fd, upstream: true}
	if err := syscall.Connect(fd, l.up); err != nil && err != syscall.EINPROGRESS {
		syscall.Close(fd)
		return nil, err
	} else if err != nil {
		u.connecting = true
	}
	if err := l.add(u); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	return u, nil
}

// write writes p to x, keeping what the socket does not take in x.out.
func (l *loop) write(x *elConn, p []byte) {
	if len(x.out) > 0 || x.connecting {
		x.out = append(x.out, p...)
		return
	}
	for len(p) > 0 {
		n, err := syscall.Write(x.fd, p)
		if err == syscall.EINTR {
			continue
		}
		if err == syscall.EAGAIN {
			break
		}
		if err != nil {
			l.close(x)
			return
		}
		p = p[n:]
	}
	x.out = append(x.out, p...)
}

func (l *loop) writable(x *elConn) {
	if x.connecting {
		if e, err := syscall.GetsockoptInt(x.fd, syscall.SOL_SOCKET, syscall.SO_ERROR); err != nil || e != 0 {
			l.close(x)
			return
		}
		x.connecting = false
	}
	if len(x.out) == 0 {
		return
	}
	p := x.out
	x.out = x.out[:0]
	l.write(x, p) // appends to x.out, which p's bytes may share: write copies forward only
	if len(x.out) == 0 && !x.upstream && x.peer != nil && x.peer.paused {
		x.peer.paused = false
		l.relay(x.peer)
	}
}

// relay moves what the upstream u has sent to its client, until the socket
// is drained or the client stops taking it.
func (l *loop) relay(u *elConn) {
	c := u.peer
	for {
		if len(c.out) > 0 {
			u.paused = true
			return
		}
		n, more, eof := l.read(u)
		if eof && !c.busy {
			// The engine closed an idle keep-alive connection: the
			// client's next request dials again.
			c.peer = nil
			l.conns[u.fd] = nil
			syscall.Close(u.fd)
			return
		}
		if eof {
			l.close(u)
			return
		}
		p := l.buf[:n]
		done, err := u.resp.feed(p)
		if err != nil {
			l.close(u)
			return
		}
		l.write(c, p)
		if l.conn(c.fd) != c {
			return
		}
		if done {
			c.busy = false
			l.forward(c)
		}
		if !more {
			return
		}
	}
}

var crlf2 = []byte("\r\n\r\n")

// requestEnd is the length of the first request in b: 0 while incomplete,
// -1 for a body without a Content-Length (chunked requests are not relayed).
func requestEnd(b []byte) int {
	head := bytes.Index(b, crlf2)
	if head < 0 {
		return 0
	}
	head += 4
	cl, chunked, err := bodyHeaders(b[:head])
	if err != nil || chunked {
		return -1
	}
	if cl < 0 {
		cl = 0
	}
	if len(b) < head+int(cl) {
		return 0
	}
	return head + int(cl)
}

// bodyHeaders reads Content-Length (-1 when absent) and whether
// Transfer-Encoding is chunked from a message head.
func bodyHeaders(head []byte) (contentLength int64, chunked bool, err error) {
	contentLength = -1
	for line := range bytes.SplitSeq(head, []byte("\r\n")) {
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		value = bytes.TrimSpace(value)
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			if contentLength, err = strconv.ParseInt(string(value), 10, 64); err != nil || contentLength < 0 {
				return 0, false, errors.New("bad Content-Length")
			}
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			chunked = bytes.EqualFold(value, []byte("chunked"))
		}
	}
	return contentLength, chunked, nil
}

// responseFramer follows an answer as it passes, to tell where it ends.
type responseFramer struct {
	noBody  bool // the answer to a HEAD request
	state   int
	head    []byte // the head so far, while it spans reads
	remain  int64  // body or chunk bytes still to pass
	size    int64  // the chunk size being read
	lineLen int    // characters of the trailer line so far
}

const (
	frameHead = iota
	frameLength
	frameUntilClose
	frameChunkSize
	frameChunkExt
	frameChunkData
	frameChunkCRLF
	frameTrailer
)

// feed passes p through the framer and reports whether the answer ended in
// it (bytes after the end are an upstream's error: not expected).
func (f *responseFramer) feed(p []byte) (bool, error) {
	for len(p) > 0 {
		switch f.state {
		case frameHead:
			var head []byte
			if len(f.head) == 0 {
				if i := bytes.Index(p, crlf2); i >= 0 {
					head, p = p[:i+4], p[i+4:]
				}
			}
			if head == nil {
				f.head = append(f.head, p...)
				i := bytes.Index(f.head, crlf2)
				if i < 0 {
					if len(f.head) > 64<<10 {
						return false, errors.New("answer head too large")
					}
					return false, nil
				}
				head, p = f.head[:i+4], f.head[i+4:]
			}
			if len(head) < 12 {
				return false, errors.New("bad status line")
			}
			cl, chunked, err := bodyHeaders(head)
			if err != nil {
				return false, err
			}
			f.head = f.head[:0] // p may still point into it: read on before the next head
			switch status := string(head[9:12]); {
			case f.noBody || status == "204" || status == "304" || cl == 0:
				return true, nil
			case chunked:
				f.state = frameChunkSize
			case cl > 0:
				f.state, f.remain = frameLength, cl
			default:
				f.state = frameUntilClose
			}
		case frameUntilClose:
			return false, nil
		case frameLength, frameChunkData:
			k := min(f.remain, int64(len(p)))
			f.remain -= k
			p = p[k:]
			if f.remain > 0 {
				return false, nil
			}
			if f.state == frameLength {
				return true, nil
			}
			f.state, f.remain = frameChunkCRLF, 2
		case frameChunkCRLF:
			k := min(f.remain, int64(len(p)))
			f.remain -= k
			p = p[k:]
			if f.remain == 0 {
				f.state = frameChunkSize
			}
		case frameChunkSize, frameChunkExt:
			b := p[0]
			p = p[1:]
			switch {
			case b == '\n':
				if f.size == 0 {
					f.state, f.lineLen = frameTrailer, 0
				} else {
					f.state, f.remain, f.size = frameChunkData, f.size, 0
				}
			case f.state == frameChunkExt || b == '\r':
			case b == ';' || b == ' ':
				f.state = frameChunkExt
			default:
				d, ok := hexDigit(b)
				if !ok || f.size > 1<<40 {
					return false, errors.New("bad chunk size")
				}
				f.size = f.size<<4 | d
			}
		case frameTrailer:
			b := p[0]
			p = p[1:]
			switch b {
			case '\n':
				if f.lineLen == 0 {
					return true, nil
				}
				f.lineLen = 0
			case '\r':
			default:
				f.lineLen++
			}
		}
	}
	return false, nil
}

func hexDigit(b byte) (int64, bool) {
	switch {
	case '0' <= b && b <= '9':
		return int64(b - '0'), true
	case 'a' <= b && b <= 'f':
		return int64(b-'a') + 10, true
	case 'A' <= b && b <= 'F':
		return int64(b-'A') + 10, true
	}
	return 0, false
}
