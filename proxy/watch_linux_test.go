//go:build linux

package proxy

import (
	"net"
	"testing"
	"time"
)

// waitLoopEnd waits for w's loop to end. (Counting the goroutines in
// every loop failed once in the whole package: another server's loop
// started meanwhile.)
func waitLoopEnd(t *testing.T, w *hangupWatcher) {
	t.Helper()
	select {
	case <-w.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the watcher's goroutine did not end")
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
	p.s.Shutdown()
	waitLoopEnd(t, w)
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
	w.Close()
	w.Close() // twice is harmless
	waitLoopEnd(t, w)
	_, s2 := dial()
	if cw := w.Watch(s2, make(hangupFlag)); cw != nil {
		t.Fatal("a closed watcher watched a connection")
	}
}
