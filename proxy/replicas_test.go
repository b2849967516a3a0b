package proxy

import (
	"bytes"
	"net"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/internal/testutil"
	"github.com/kvproxy/kvproxy/router"
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

// Replicas that name one backend id at different URLs (two engines
// swapped) do not add each other's load there, and say so: each report
// carries a hash of the backend's URL (found by the replicas user trial;
// the load was applied silently).
func TestReplicasWithSwappedBackendURLsWarn(t *testing.T) {
	nats := startNATS(t)
	start := func(id, e0, e1 string) (*Server, *syncBuffer) {
		t.Helper()
		s, logs := newTestServer(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
			"backends:\n  - {id: e0, url: '"+e0+"', model: m}\n  - {id: e1, url: '"+e1+"', model: m}\n"+
			"replicas: {nats: '"+nats+"', id: "+id+", interval: 20ms}\n", true)
		t.Cleanup(func() { s.Shutdown() })
		return s, logs
	}
	const one, two = "http://127.0.0.1:1", "http://127.0.0.1:2"
	_, la := start("proxy-a", one, two)
	_, lb := start("proxy-b", two, one) // swapped
	_, lc := start("proxy-c", one, two+"/")
	const warning = "at another URL"
	for deadline := time.Now().Add(5 * time.Second); strings.Count(lb.String(), warning) < 4; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("proxy-b never warned of a's and c's e0 and e1: %s", lb.String())
		}
	}
	time.Sleep(200 * time.Millisecond) // ten more reports each
	if n := strings.Count(lb.String(), warning); n != 4 {
		t.Fatalf("%d warnings at proxy-b, want 4 (e0 and e1 of a and of c, once each): %s", n, lb.String())
	}
	for _, l := range []*syncBuffer{la, lc} {
		if n := strings.Count(l.String(), warning); n != 2 || strings.Contains(l.String(), `"replica":"proxy-a","model"`) || strings.Contains(l.String(), `"replica":"proxy-c","model"`) {
			t.Fatalf("want warnings of proxy-b's e0 and e1 only: %s", l.String())
		}
	}
}

// startNATS runs an embedded NATS server on a free loopback port for the
// test and returns its URL.
func startNATS(t *testing.T) string {
	return testutil.StartNATS(t, &natsserver.Options{Port: -1}).ClientURL()
}

// The load a replica puts on a data-parallel rank above 0 ("e0#1") reaches
// the others: it was not published, as the rank's worker has no backend of
// its own in the pool's list, so every replica saw the ranks above 0 idle
// and sent its requests there (the twenty-ninth session's review).
func TestReplicasShareDataParallelRanksLoad(t *testing.T) {
	nats := startNATS(t)
	eng := deadAddr(t) // no engine: the load is the router's
	yaml := func(id string) string {
		return "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
			"backends:\n  - {id: e0, url: 'http://" + eng + "', model: m, kv_events: {mode: http}}\n" +
			"replicas: {nats: '" + nats + "', id: " + id + ", interval: 50ms}\n"
	}
	a := serveYAML(t, yaml("a"), true)
	b := serveYAML(t, yaml("b"), true)
	for _, p := range []*testProxy{a, b} {
		pushRank(t, p, "e0", 1, promptIDs(100))
	}
	rank1, ok := workerStatus(a, "m", "e0#1")
	if !ok {
		t.Fatal("no worker for rank 1")
	}
	rt := a.s.st.Load().models["m"].rt
	for _, id := range []router.WorkerID{rank1.ID, 0} {
		for range 4 {
			if _, _, err := rt.Route(&router.Request{PromptTokens: 100, Pinned: true, Pin: id}); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitFor(t, "replica a's load on both ranks to reach b", func() bool {
		r0, _ := workerStatus(b, "m", "e0")
		r1, _ := workerStatus(b, "m", "e0#1")
		return r0.Remote.Inflight == 4 && r1.Remote.Inflight == 4
	})
}
