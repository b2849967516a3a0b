//go:build linux

package proxy

import (
	"crypto/tls"
	"net"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// hangupWatcher notices a client closing its connection while the proxy is
// not writing to it (a long prefill sends nothing for seconds). fasthttp has
// no signal for this, so one goroutine waits on an epoll set for EPOLLRDHUP.
// The runtime's own poller keeps the fd; epoll allows an fd in several sets.
//
// A connection is registered once, on its first watched request, edge
// triggered, and stays registered until fasthttp reports it closed (closing
// the fd removes it from the set): requests on a keep-alive connection only
// swap the callback, with no system call.
type hangupWatcher struct {
	epfd   int
	wake   int // an eventfd in the set: Close's signal to the loop
	mu     sync.Mutex
	closed bool
	gen    uint32
	byConn map[net.Conn]*connWatch
	byFD   map[int32]*connWatch
	done   chan struct{} // closed when the loop has ended
}

// hangupHandler is told that a watched request's client hung up.
type hangupHandler interface{ hungUp() }

type connWatch struct {
	fd     int32
	gen    uint32
	h      hangupHandler // the in-flight request's, nil between requests
	hungUp bool
}

func newHangupWatcher() *hangupWatcher {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return &hangupWatcher{epfd: -1}
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err == nil {
		ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wake)}
		if err = unix.EpollCtl(fd, unix.EPOLL_CTL_ADD, wake, &ev); err != nil {
			unix.Close(wake)
		}
	}
	if err != nil {
		unix.Close(fd)
		return &hangupWatcher{epfd: -1}
	}
	w := &hangupWatcher{epfd: fd, wake: wake, byConn: map[net.Conn]*connWatch{}, byFD: map[int32]*connWatch{}, done: make(chan struct{})}
	go w.loop()
	return w
}

// Close stops the watcher: its goroutine, blocked in epoll_wait on a
// thread of its own, and its two fds. Closing the epoll fd alone would
// not wake the wait; hence the eventfd. No hang-up is told after it
// (Shutdown closes it once no request is left), and no connection is
// registered.
func (w *hangupWatcher) Close() {
	if w.epfd < 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		w.closed = true
		unix.Write(w.wake, []byte{1, 0, 0, 0, 0, 0, 0, 0})
	}
}

func (w *hangupWatcher) loop() {
	defer close(w.done)
	events := make([]unix.EpollEvent, 128)
	for {
		n, err := unix.EpollWait(w.epfd, events, -1)
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			return
		}
		for i := 0; i < n; i++ {
			fd, gen := events[i].Fd, uint32(events[i].Pad)
			if fd == int32(w.wake) {
				// Closed: register, under the lock, adds no fd now, so
				// the numbers are not closed under one being added.
				w.mu.Lock()
				unix.Close(w.epfd)
				unix.Close(w.wake)
				w.mu.Unlock()
				return
			}
			w.mu.Lock()
			cw := w.byFD[fd]
			var h hangupHandler
			if cw != nil && cw.gen == gen {
				cw.hungUp = true
				h, cw.h = cw.h, nil
			}
			w.mu.Unlock()
			if h != nil {
				h.hungUp()
			}
		}
	}
}

// Watch calls h.hungUp once if the peer of c hangs up before Unwatch is
// called with the watch it returns (nil: nothing to unwatch). A call
// already under way when Unwatch returns may still finish after it.
func (w *hangupWatcher) Watch(c net.Conn, h hangupHandler) *connWatch {
	if w.epfd < 0 {
		return nil
	}
	w.mu.Lock()
	cw := w.byConn[c]
	if cw == nil {
		w.mu.Unlock()
		cw = w.register(c)
		if cw == nil {
			return nil
		}
		w.mu.Lock()
	}
	if cw.hungUp {
		w.mu.Unlock()
		h.hungUp()
		return nil
	}
	cw.h = h
	w.mu.Unlock()
	return cw
}

// Unwatch ends a watch Watch returned; nil is ignored.
func (w *hangupWatcher) Unwatch(cw *connWatch) {
	if cw == nil {
		return
	}
	w.mu.Lock()
	cw.h = nil
	w.mu.Unlock()
}

func (w *hangupWatcher) register(c net.Conn) *connWatch {
	raw := c
	if tc, ok := c.(*tls.Conn); ok { // a TLS client's socket hangs up as a plain one does
		raw = tc.NetConn()
	}
	sc, ok := raw.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	var cw *connWatch
	rc.Control(func(f uintptr) {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.closed {
			return
		}
		w.gen++
		ev := unix.EpollEvent{Events: unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(f), Pad: int32(w.gen)}
		if unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, int(f), &ev) != nil {
			return
		}
		cw = &connWatch{fd: int32(f), gen: w.gen}
		w.byConn[c] = cw
		w.byFD[cw.fd] = cw
	})
	return cw
}

// Closed forgets a connection fasthttp has closed (its fd already left the
// epoll set with the close).
func (w *hangupWatcher) Closed(c net.Conn) {
	if w.epfd < 0 {
		return
	}
	w.mu.Lock()
	if cw := w.byConn[c]; cw != nil {
		delete(w.byConn, c)
		if w.byFD[cw.fd] == cw {
			delete(w.byFD, cw.fd)
		}
	}
	w.mu.Unlock()
}
