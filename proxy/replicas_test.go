package proxy

import (
	"bytes"
	"net"
	"runtime/pprof"
	"strings"
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

// A replicas block with no nats (nats: ${NATS_URL:-}, the variable unset)
// is warned about at start and on reload: the replica ran alone, with no
// word of it (found by the replicas user trial). No block, no warning.
func TestReplicasWithoutNATSWarns(t *testing.T) {
	const base = "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
		"backends:\n  - {id: e0, url: 'http://127.0.0.1:1', model: m}\n"
	const warning = `"setting":"replicas.nats"`
	parse := func(y string) *config.Config {
		t.Helper()
		cfg, err := config.Parse([]byte(y))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	logs := &syncBuffer{}
	s, err := New(parse(base+"replicas: {nats: '', id: proxy-a, interval: 200ms}\n"),
		Options{Logger: zerolog.New(logs), DisableHealthChecks: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Shutdown()
	if n := strings.Count(logs.String(), warning); n != 1 {
		t.Fatalf("%d warnings at start, want 1: %s", n, logs.String())
	}
	if err := s.Reload(parse(base + "replicas: {subject: fleet-b}\n")); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(logs.String(), warning); n != 2 {
		t.Fatalf("%d warnings after a reload, want 2: %s", n, logs.String())
	}
	if err := s.Reload(parse(base)); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(logs.String(), warning); n != 2 {
		t.Fatalf("a config without replicas warned: %s", logs.String())
	}
}
