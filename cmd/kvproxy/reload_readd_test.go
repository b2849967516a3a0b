package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/mockengine"
)

type zmqEngine struct {
	e    *mockengine.Engine
	addr string
	pub  *mockengine.Publisher
}

func startZMQEngine(t *testing.T, id string, speedup float64) *zmqEngine {
	mc := mockengine.DefaultConfig()
	mc.ID, mc.Model, mc.Speedup = id, "m", speedup
	e, err := mockengine.New(mc)
	if err != nil {
		t.Fatal(err)
	}
	addr, err := e.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pub, err := mockengine.NewPublisher(mockengine.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	f := e.PublishEvents(pub)
	t.Cleanup(func() { f.Stop(); pub.Close(); e.Close() })
	return &zmqEngine{e: e, addr: addr, pub: pub}
}

func subscribers() int {
	var b bytes.Buffer
	pprof.Lookup("goroutine").WriteTo(&b, 1)
	n := 0
	for _, blk := range strings.Split(b.String(), "\n\n") {
		if strings.Contains(blk, "backends.(*ZMQSubscriber).Run") {
			var c int
			fmt.Sscanf(blk, "%d @", &c)
			n += c
		}
	}
	return n
}

// A backend removed while a stream is in flight on it, then added back
// before that stream ends, has one KV event feed, not two.
func TestReaddedBackendHasOneFeed(t *testing.T) {
	m0, m1 := startZMQEngine(t, "m0", 1000), startZMQEngine(t, "m1", 0.05)
	line := func(id string, e *zmqEngine) string {
		return fmt.Sprintf("  - {id: %s, url: \"http://%s\", model: m, kv_events: {mode: zmq, endpoint: %q, replay: %q}}\n", id, e.addr, e.pub.Endpoint(), e.pub.ReplayEndpoint())
	}
	head := "listen: 127.0.0.1:0\nlog_level: warn\nmodels:\n  - {name: m}\nbackends:\n"
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte(head+line("m1", m1)), 0o644)
	p := startProxy(t, cfg)
	deadline := time.Now().Add(3 * time.Second) // the feed starts beside the server
	for subscribers() != 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := subscribers(); n != 1 {
		t.Fatalf("%d subscribers at start", n)
	}
	done := startStream(t, p, 200)
	os.WriteFile(cfg, []byte(head+line("m0", m0)), 0o644)
	p.reload(t)
	os.WriteFile(cfg, []byte(head+line("m0", m0)+line("m1", m1)), 0o644)
	p.reload(t)
	<-done
	deadline = time.Now().Add(3 * time.Second) // the proxy retires m1's old self 50 ms after its stream
	for subscribers() != 2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := subscribers(); n != 2 {
		t.Fatalf("%d ZMQ subscribers running for 2 backends, 3 s after the stream ended", n)
	}
}
