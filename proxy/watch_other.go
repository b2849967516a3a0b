//go:build !linux

package proxy

import "net"

// hangupWatcher is Linux-only; elsewhere a departed client is noticed on the
// next write.
type hangupWatcher struct{}

func newHangupWatcher() *hangupWatcher { return &hangupWatcher{} }

func (w *hangupWatcher) Watch(c net.Conn, fn func()) (stop func()) { return func() {} }

func (w *hangupWatcher) Closed(c net.Conn) {}
