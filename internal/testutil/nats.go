package testutil

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// StartNATS runs an embedded NATS server with opts (on loopback, quiet;
// Port -1 for any free one) until the test ends.
func StartNATS(t testing.TB, opts *server.Options) *server.Server {
	t.Helper()
	opts.Host, opts.NoLog, opts.NoSigs = "127.0.0.1", true, true
	ns, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(5 * time.Second) {
		t.Fatal("NATS did not start")
	}
	t.Cleanup(ns.Shutdown)
	return ns
}
