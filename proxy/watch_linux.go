//go:build linux

package proxy

import (
	"net"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// hangupWatcher notices a client closing its connection while the proxy is
// not writing to it (a long prefill sends nothing for seconds). fasthttp has
// no signal for this, so one goroutine waits on an epoll set for EPOLLRDHUP
// on the connections of in-flight requests. The runtime's own poller keeps
// the fd; epoll allows an fd in several sets.
type hangupWatcher struct {
	epfd int
	mu   sync.Mutex
	gen  uint32
	cbs  map[int32]watchEntry
}

type watchEntry struct {
	gen uint32
	fn  func()
}

func newHangupWatcher() *hangupWatcher {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return &hangupWatcher{epfd: -1}
	}
	w := &hangupWatcher{epfd: fd, cbs: map[int32]watchEntry{}}
	go w.loop()
	return w
}

func (w *hangupWatcher) loop() {
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
			w.mu.Lock()
			e, ok := w.cbs[fd]
			if ok && e.gen == gen {
				delete(w.cbs, fd)
				unix.EpollCtl(w.epfd, unix.EPOLL_CTL_DEL, int(fd), nil)
			} else {
				ok = false
			}
			w.mu.Unlock()
			if ok {
				e.fn()
			}
		}
	}
}

// Watch calls fn once if the peer of c hangs up before stop is called.
// stop must be called before c is closed (the fd could be reused).
func (w *hangupWatcher) Watch(c net.Conn, fn func()) (stop func()) {
	if w.epfd < 0 {
		return func() {}
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return func() {}
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return func() {}
	}
	var fd int32 = -1
	var gen uint32
	rc.Control(func(f uintptr) {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.gen++
		gen = w.gen
		ev := unix.EpollEvent{Events: unix.EPOLLRDHUP | unix.EPOLLONESHOT, Fd: int32(f), Pad: int32(gen)}
		if unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, int(f), &ev) == nil {
			fd = int32(f)
			w.cbs[fd] = watchEntry{gen: gen, fn: fn}
		}
	})
	if fd < 0 {
		return func() {}
	}
	return func() {
		w.mu.Lock()
		if e, ok := w.cbs[fd]; ok && e.gen == gen {
			delete(w.cbs, fd)
			unix.EpollCtl(w.epfd, unix.EPOLL_CTL_DEL, int(fd), nil)
		}
		w.mu.Unlock()
	}
}
