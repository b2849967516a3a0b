package proxy

import (
	"bytes"
	"net"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
)

// feedGoroutines counts the goroutines running a ZMQ subscriber.
func feedGoroutines() int {
	var b bytes.Buffer
	pprof.Lookup("goroutine").WriteTo(&b, 2)
	return bytes.Count(b.Bytes(), []byte("backends.(*ZMQSubscriber).Run("))
}

// A New that fails at the replicas' start (after the backends' event
// feeds started) stops those feeds, and leaves no metrics registered: a
// proxy that never came up holds nothing.
func TestNewFailingAtReplicasLeavesNothing(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	endpoint := "tcp://" + ln.Addr().String()
	ln.Close() // nothing publishes there: the feed keeps retrying
	cfg, err := config.Parse([]byte("models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
		"backends:\n  - {id: e0, url: 'http://127.0.0.1:1', model: m, kv_events: {mode: zmq, endpoint: '" + endpoint + "'}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	before := feedGoroutines()
	cfg.Replicas.NATS = "nats://[::1" // unparsable: only a config that skipped validation gets here
	reg := prometheus.NewRegistry()
	if _, err := New(cfg, Options{Logger: zerolog.Nop(), DisableHealthChecks: true, Registry: reg}); err == nil {
		t.Fatal("New started with an unparsable NATS URL")
	}
	for deadline := time.Now().Add(5 * time.Second); feedGoroutines() > before; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d event feeds still run after New failed (%d before)", feedGoroutines(), before)
		}
	}

	// A second New on the registry (the caller retrying) must not panic
	// on the failed one's metrics.
	cfg.Replicas.NATS = ""
	s, err := New(cfg, Options{Logger: zerolog.Nop(), DisableHealthChecks: true, Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	s.Shutdown()
}
