package replicas

import (
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/router"

	"github.com/kvproxy/kvproxy/internal/testutil"
)

// startNATS runs a real NATS server on a loopback port for one test.
func startNATS(t *testing.T) *server.Server { return startNATSOn(t, -1) }

// startNATSOn runs it on port (-1: any free one).
func startNATSOn(t *testing.T, port int) *server.Server {
	return startNATSWith(t, &server.Options{Port: port})
}

// startNATSWith runs one with opts (on loopback, quiet).
func startNATSWith(t *testing.T, opts *server.Options) *server.Server {
	return testutil.StartNATS(t, opts)
}

// sink keeps the last sum a Sync applied, and lets a test wait for one.
type sink struct {
	mu   sync.Mutex
	last map[Key]router.Load
	cond chan struct{}
}

func newSink() *sink { return &sink{cond: make(chan struct{}, 1)} }

func (k *sink) apply(m map[Key]router.Load) {
	k.mu.Lock()
	k.last = m
	k.mu.Unlock()
	select {
	case k.cond <- struct{}{}:
	default:
	}
}

func (k *sink) waitFor(t *testing.T, what string, ok func(map[Key]router.Load) bool) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		k.mu.Lock()
		done := k.last != nil && ok(k.last)
		k.mu.Unlock()
		if done {
			return
		}
		select {
		case <-k.cond:
		case <-deadline:
			t.Fatalf("never saw %s; last %v", what, k.last)
		}
	}
}

func start(t *testing.T, url, id string, loads []Entry, k *sink) *Sync {
	t.Helper()
	s, err := Start(Config{URL: url, ID: id, Interval: 20 * time.Millisecond},
		func() []Entry { return loads }, k.apply, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// Each replica gets the others' load summed per worker, never its own;
// a replica that leaves stops counting; a malformed report changes nothing.
func TestReplicasShareLoad(t *testing.T) {
	url := startNATS(t).ClientURL()
	ka, kb, kc := newSink(), newSink(), newSink()
	a := start(t, url, "a", []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 3, Pending: 1, PrefillTokens: 900, ActiveBlocks: 40}}}, ka)
	start(t, url, "b", []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 2, PrefillTokens: 100}}, {Model: "m", Worker: "e1", Load: router.Load{Inflight: 1}}}, kb)
	c := start(t, url, "c", []Entry{{Model: "m", Worker: "e1", Load: router.Load{Inflight: 5}}}, kc)

	ka.waitFor(t, "b's and c's load at a", func(m map[Key]router.Load) bool {
		return m[Key{"m", "e0"}] == router.Load{Inflight: 2, PrefillTokens: 100} && m[Key{"m", "e1"}].Inflight == 6
	})
	kb.waitFor(t, "a's and c's load at b", func(m map[Key]router.Load) bool {
		return m[Key{"m", "e0"}] == router.Load{Inflight: 3, Pending: 1, PrefillTokens: 900, ActiveBlocks: 40} && m[Key{"m", "e1"}].Inflight == 5
	})
	if a.Peers() != 2 || !a.Connected() {
		t.Fatalf("a: %d peers, connected %v", a.Peers(), a.Connected())
	}

	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.Publish("kvproxy.load", []byte(`{"loads":"not a list"}`))
	nc.Publish("kvproxy.load", []byte(`garbage`))
	nc.Flush()

	c.Close()
	ka.waitFor(t, "c's load gone at a", func(m map[Key]router.Load) bool {
		return m[Key{"m", "e1"}].Inflight == 1 && m[Key{"m", "e0"}].Inflight == 2
	})
	if a.Peers() != 1 {
		t.Fatalf("a still counts %d peers", a.Peers())
	}
}

// With NATS down at start the replica still starts (and routes alone),
// and joins the others once the server is up.
func TestReplicaStartsWithoutNATS(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close() // nothing listens there yet

	ka, kb := newSink(), newSink()
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	a, logs := startLogged(t, Config{URL: url, ID: "a", Interval: 20 * time.Millisecond},
		func() []Entry { return []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 7}}} }, ka.apply)
	if a.Connected() || !strings.Contains(logs.String(), "cannot reach NATS yet") {
		t.Fatalf("connected %v to a server that is down; log: %s", a.Connected(), logs.String())
	}
	startNATSOn(t, port)
	start(t, url, "b", nil, kb)
	kb.waitFor(t, "a's load once NATS is up", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 7 })
	if n := strings.Count(logs.String(), "replicas: connected to NATS"); n != 1 || strings.Contains(logs.String(), "disconnected") {
		t.Fatalf("%d connected lines (want 1), log: %s", n, logs.String())
	}
}

// startLogged starts a Sync whose log the test reads; it closes when the
// test ends.
func startLogged(t *testing.T, cfg Config, local func() []Entry, apply func(map[Key]router.Load)) (*Sync, *syncBuffer) {
	t.Helper()
	logs := &syncBuffer{}
	s, err := Start(cfg, local, apply, zerolog.New(logs))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s, logs
}

// syncBuffer is the log sink the tests read while servers write.
type syncBuffer = testutil.SyncBuffer

// A replica that stops reporting drops out after three of its intervals
// (at least 1 s), whatever the interval of the replica that watches it: one
// reporting every 5 s looked only at its own ticks, and a peer reporting
// every 50 ms lingered 5 s (found by the ninth session's review).
func TestSilentPeerDropsOutOnTimeWhateverTheWatchersInterval(t *testing.T) {
	url := startNATS(t).ClientURL()
	ka := newSink()
	a, err := Start(Config{URL: url, ID: "a", Interval: 5 * time.Second}, func() []Entry { return nil }, ka.apply, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Start(Config{URL: url, ID: "b", Interval: 50 * time.Millisecond},
		func() []Entry { return []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 7}}} }, func(map[Key]router.Load) {}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ka.waitFor(t, "b's load", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 7 })
	b.Close()
	gone := time.Now()
	ka.waitFor(t, "b's load gone", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 0 })
	if d := time.Since(gone); d > 2500*time.Millisecond {
		t.Fatalf("b's load lingered %v after it stopped (3 × 50 ms, at least 1 s)", d)
	}
}

// A report's unhashed entries on workers this replica does not have are
// kept up to maxUnknownKept: a publisher on the subject made every replica
// keep and sum all it sent (the twenty-ninth session's review: 840,000
// entries from 50 reports).
func TestUnknownEntriesKeptAreBounded(t *testing.T) {
	url := startNATS(t).ClientURL()
	k := newSink()
	start(t, url, "a", []Entry{{Model: "m", Worker: "e0"}}, k)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var b strings.Builder
	b.WriteString(`{"replica":"x","instance":"i","interval_ms":20000,"loads":[{"model":"m","worker":"e0","inflight":2}`)
	for i := range 5000 {
		fmt.Fprintf(&b, `,{"model":"m","worker":"w%d","inflight":1}`, i)
	}
	b.WriteString(`]}`)
	nc.Publish("kvproxy.load", []byte(b.String()))
	nc.Flush()
	k.waitFor(t, "x's report at a", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 2 })
	k.mu.Lock()
	n := len(k.last)
	k.mu.Unlock()
	if n != maxUnknownKept+1 {
		t.Fatalf("%d workers' load kept, want e0's and %d others", n, maxUnknownKept)
	}
}

// An asynchronous NATS error that repeats is said once: a publish the
// server's permissions deny came back at every report (the twenty-ninth
// session's review: 29 lines in 3 s at a 100 ms interval).
func TestRepeatedNATSErrorSaidOnce(t *testing.T) {
	ns := startNATSWith(t, &server.Options{Port: -1, Users: []*server.User{{Username: "u", Password: "p",
		Permissions: &server.Permissions{Publish: &server.SubjectPermission{Deny: []string{"kvproxy.load"}}}}}})
	url := strings.Replace(ns.ClientURL(), "nats://", "nats://u:p@", 1)
	_, logs := startLogged(t, Config{URL: url, ID: "a", Interval: 20 * time.Millisecond},
		func() []Entry { return []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 1}}} }, func(map[Key]router.Load) {})
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(logs.String(), "Permissions Violation") {
		if time.Now().After(deadline) {
			t.Fatalf("no word of the denied publish:\n%s", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // about 25 reports more, each denied
	if n := strings.Count(logs.String(), "replicas: NATS error"); n != 1 {
		t.Fatalf("%d lines of the same error:\n%s", n, logs.String())
	}
}

// A replica that closes says so, and the others drop its load at once,
// not at its expiry (three of its intervals: 15 s here).
func TestClosingReplicaLeavesAtOnce(t *testing.T) {
	url := startNATS(t).ClientURL()
	cfg := Config{URL: url, ID: "a", Interval: 5 * time.Second}
	ka := newSink()
	a, logs := startLogged(t, cfg, func() []Entry { return nil }, ka.apply)
	cfg.ID = "c"
	c, err := Start(cfg, func() []Entry { return []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 4}}} }, func(map[Key]router.Load) {}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	waitPublished(t, c, ka, func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 4 })
	c.Close()
	ka.waitFor(t, "c's load gone at a", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 0 })
	if a.Peers() != 0 || !strings.Contains(logs.String(), "a replica left") {
		t.Fatalf("a counts %d peers; log: %s", a.Peers(), logs.String())
	}
}
