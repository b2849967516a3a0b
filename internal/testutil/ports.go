package testutil

import (
	"net"
	"sync"
	"testing"
)

// FreePort returns a loopback port nothing listens on (at the time asked),
// never one this process was given before (FreePort, ClaimPort): the kernel
// may hand a port just released out again before the process it was given
// to binds it, and two mocks of one configuration got the same (the flaky
// test hunt: 1 run in 400).
func FreePort(t testing.TB) int {
	t.Helper()
	for {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if ClaimPort(port) {
			return port
		}
	}
}

// ClaimPort reports whether port was never given out before, and gives it.
func ClaimPort(port int) bool {
	_, given := portsGiven.LoadOrStore(port, true)
	return !given
}

var portsGiven sync.Map
