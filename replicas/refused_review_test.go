package replicas

import (
	"fmt"
	"net"
	"os"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvproxy/kvproxy/router"
)

// A server that refuses this replica (authorization) is said as an error,
// once a minute while it lasts, not as a publish warning at every
// interval; and the replica keeps trying: nats.go gave up for good after
// two refusals, and a password changed for a moment, or credentials that
// expired and were renewed in place, turned sharing off until a restart
// (the trial).
func TestRefusedConnectionIsAnErrorAndRetried(t *testing.T) {
	ns := startNATSWith(t, &server.Options{Port: -1, Username: "kv", Password: "other"})
	port := ns.ClientURL()[strings.LastIndexByte(ns.ClientURL(), ':')+1:]
	a, logs := startLogged(t, Config{URL: "nats://kv:right@127.0.0.1:" + port, ID: "a", Interval: 10 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	time.Sleep(2 * time.Second) // four retries refused
	for i := 0; i < 20; i++ {
		a.Publish()
	}
	select {
	case <-a.closed:
		t.Fatalf("nats.go gave up: %s", logs.String())
	default:
	}
	l := logs.String()
	if !strings.Contains(l, `"level":"error"`) || strings.Count(l, "Authorization Violation") != 1 || strings.Contains(l, "replicas: publish") {
		t.Fatalf("log: %s", l)
	}
	ns.Shutdown()
	var p int
	fmt.Sscan(port, &p)
	startNATSWith(t, &server.Options{Port: p, Username: "kv", Password: "right"})
	deadline := time.Now().Add(10 * time.Second)
	for !a.Connected() {
		if time.Now().After(deadline) {
			t.Fatalf("never connected once the password was right: %s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The log never shows a password or token of replicas.nats.
func TestNATSCredentialsStayOutOfTheLog(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	a, logs := startLogged(t, Config{URL: fmt.Sprintf("nats://kv:hunter2@127.0.0.1:%d, nats://s3cr3ttoken@127.0.0.1:%d", port, port), ID: "a"},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	a.Close()
	if l := logs.String(); !strings.Contains(l, "cannot reach NATS") || strings.Contains(l, "hunter2") || strings.Contains(l, "s3cr3ttoken") {
		t.Fatalf("log: %s", l)
	}
}

// A refusal of a replica that was connected (a password changed, a JWT
// expired) is said as the error a refusal at start is: nats.go tells its
// reconnect handler only of failed dials, and the refusal went unsaid, or
// said as a NATS warning (the operator trial).
func TestRefusalAfterADisconnectIsAnError(t *testing.T) {
	ns := startNATSWith(t, &server.Options{Port: -1, Username: "kv", Password: "right"})
	port := ns.ClientURL()[strings.LastIndexByte(ns.ClientURL(), ':')+1:]
	a, logs := startLogged(t, Config{URL: "nats://kv:right@127.0.0.1:" + port, ID: "a", Interval: 10 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	if !a.Connected() {
		t.Fatal("not connected")
	}
	ns.Shutdown()
	var p int
	fmt.Sscan(port, &p)
	startNATSWith(t, &server.Options{Port: p, Username: "kv", Password: "changed"})
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logs.String(), "replicas: NATS refuses this replica") {
		if time.Now().After(deadline) {
			t.Fatalf("the refusal never said: %s", logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if l := logs.String(); strings.Count(l, "replicas: NATS refuses this replica") != 1 || strings.Contains(l, "hunter2") {
		t.Fatalf("log: %s", l)
	}
}

// Each dial closes the connection dialled before: nats.go left one whose
// handshake failed open until the garbage collector found it (a refused
// replica gained two sockets a second: the operator trial).
func TestDialerClosesTheConnectionBefore(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var d closingDialer
	first, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Dial("tcp", ln.Addr().String()); err != nil {
		t.Fatal(err)
	}
	if _, err := first.Write([]byte("x")); err == nil {
		t.Fatal("the connection dialled before is still open")
	}
}

// openSockets counts the process's open sockets (-1: unknown here).
func openSockets() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(l, "socket:") {
			n++
		}
	}
	return n
}

// A replica refused over and over keeps no socket of its failed tries
// (the garbage collector, off here, was what closed them: two a second,
// the operator trial); and Close ends its watch of why NATS is down.
func TestRefusedReplicaKeepsNoSockets(t *testing.T) {
	if openSockets() < 0 {
		t.Skip("no /proc/self/fd")
	}
	ns := startNATSWith(t, &server.Options{Port: -1, Username: "kv", Password: "right"})
	port := ns.ClientURL()[strings.LastIndexByte(ns.ClientURL(), ':')+1:]
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	before := openSockets()
	a, _ := startLogged(t, Config{URL: "nats://kv:wrong@127.0.0.1:" + port, ID: "a", Interval: 10 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	time.Sleep(2500 * time.Millisecond) // five tries refused
	if gained := openSockets() - before; gained > 2 {
		t.Fatalf("a refused replica gained %d sockets", gained)
	}
	a.Close()
	select {
	case <-a.whyDone:
	default:
		t.Fatal("Close returned before the watch of why NATS is down ended")
	}
}
