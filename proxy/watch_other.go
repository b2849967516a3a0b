//go:build !linux

package proxy

import "net"

// hangupWatcher is Linux-only; elsewhere a departed client is noticed on the
// next write.
type hangupWatcher struct{}

func newHangupWatcher() *hangupWatcher { return &hangupWatcher{} }

// hangupHandler is told that a watched request's client hung up.
type hangupHandler interface{ hungUp() }

type connWatch struct{}

func (w *hangupWatcher) Watch(c net.Conn, h hangupHandler) *connWatch { return nil }

func (w *hangupWatcher) Unwatch(cw *connWatch) {}

func (w *hangupWatcher) Closed(c net.Conn) {}

func (w *hangupWatcher) Close() {}
