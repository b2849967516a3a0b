//go:build linux

package proxy

import (
	"net"
	"runtime"
	"strings"
	"testing"
)

// watcherLoops counts the goroutines running a hang-up watcher's loop.
func watcherLoops() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), "(*hangupWatcher).loop")
		}
		buf = make([]byte, 2*len(buf))
	}
}

type hangupFlag chan struct{}

func (f hangupFlag) hungUp() { close(f) }

// A server's hang-up watcher is stopped with the server: its goroutine,
// blocked in epoll_wait on a thread of its own, and its epoll fd stayed
// for the life of the process, one of each for every Server built (the
// proxy tests held hundreds).
func TestShutdownStopsTheHangupWatcher(t *testing.T) {
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", headersThen(t, "", true))
	w := p.s.watcher
	if w.epfd < 0 {
		t.Skip("no epoll here")
	}
	before := watcherLoops()
	p.s.Shutdown()
	waitFor(t, "the watcher's goroutine to end", func() bool { return watcherLoops() < before })
}

// A watcher still tells of hang-ups until it is closed, and watches
// nothing after.
func TestHangupWatcherClose(t *testing.T) {
	w := newHangupWatcher()
	if w.epfd < 0 {
		t.Skip("no epoll here")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dial := func() (client, server net.Conn) {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(); s.Close() })
		return c, s
	}
	c, s := dial()
	gone := make(hangupFlag)
	if w.Watch(s, gone) == nil {
		t.Fatal("not watched")
	}
	c.Close()
	<-gone
	before := watcherLoops()
	w.Close()
	w.Close() // twice is harmless
	waitFor(t, "the watcher's goroutine to end", func() bool { return watcherLoops() < before })
	_, s2 := dial()
	if cw := w.Watch(s2, make(hangupFlag)); cw != nil {
		t.Fatal("a closed watcher watched a connection")
	}
}
