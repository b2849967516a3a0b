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

// A server that refuses this replica (authorization): nats.go gives up for
// good, which is said as an error once, not as a publish warning at every
// interval (nor as "retrying").
func TestRefusedConnectionIsAnError(t *testing.T) {
	ns := startNATSWith(t, &server.Options{Port: -1, Authorization: "secret"})
	a, logs := startLogged(t, Config{URL: ns.ClientURL(), ID: "a", Interval: 10 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	select {
	case <-a.closed:
	case <-time.After(10 * time.Second):
		t.Fatalf("nats.go never gave up: %s", logs.String())
	}
	for i := 0; i < 20; i++ {
		a.Publish()
	}
	l := logs.String()
	if !strings.Contains(l, `"level":"error"`) || !strings.Contains(l, "Authorization Violation") || strings.Contains(l, "replicas: publish") {
		t.Fatalf("log: %s", l)
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
