//go:build !unix

package backends

import "net"

// idlePeek is not looked at on this system (idlesent_unix.go).
type idlePeek struct{}

func newIdlePeek(net.Conn) *idlePeek         { return nil }
func (*idlePeek) check() (sent, closed bool) { return false, false }
