package replicas

import (
	"fmt"
	"net"
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
