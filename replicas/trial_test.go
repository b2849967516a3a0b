package replicas

import (
	"encoding/json"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/internal/testutil"
	"github.com/kvproxy/kvproxy/router"
)

// logLines is the log's lines whose message is msg, decoded.
func logLines(logs string, msg string) []map[string]any {
	var out []map[string]any
	for _, l := range strings.Split(logs, "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["message"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// The "left" line names the replica as the "joined" line does, by its id,
// with its instance as a field of its own: it said "proxy-b/782f1ab0c635d60b"
// (found by the replicas user trial).
func TestLeftLogNamesTheReplicaAsJoinedDoes(t *testing.T) {
	url := startNATS(t).ClientURL()
	_, logs := startLogged(t, Config{URL: url, ID: "proxy-a", Interval: 20 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	b := start(t, url, "proxy-b", []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 1}}}, newSink())
	const joined, left, silent = "replicas: a replica reports; its load counts", "replicas: a replica left; its load no longer counts",
		"replicas: a replica stopped reporting; its load no longer counts"
	waitLog := func(msg string) map[string]any {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if ls := logLines(logs.String(), msg); len(ls) > 0 {
				return ls[0]
			}
			if time.Now().After(deadline) {
				t.Fatalf("no %q line: %s", msg, logs.String())
			}
		}
	}
	j := waitLog(joined)
	b.Close()
	l := waitLog(left)
	if j["replica"] != "proxy-b" || l["replica"] != "proxy-b" || l["instance"] != b.instance || j["instance"] != b.instance {
		t.Fatalf("joined %v, left %v (instance %s)", j, l, b.instance)
	}
	// One that stops reporting without a word (killed) is named alike.
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.Publish("kvproxy.load", []byte(`{"replica":"proxy-c","instance":"c1","interval_ms":20,"loads":[]}`))
	nc.Flush()
	if l := waitLog(silent); l["replica"] != "proxy-c" || l["instance"] != "c1" {
		t.Fatalf("stopped reporting: %v", l)
	}
}

// A NATS server that hangs without closing the connection (kill -STOP)
// is noticed within seconds: kvproxy_replicas_connected stayed 1, and the
// log silent, for about 6 minutes (nats.go's default pings, 2 min × 2;
// found by the replicas user trial).
func TestFrozenNATSIsNoticedWithinSeconds(t *testing.T) {
	f := testutil.NewRelay(t, startNATS(t).Addr().String()) // frozen: a server stopped with kill -STOP
	a, logs := startLogged(t, Config{URL: "nats://" + f.Addr(), ID: "a", Interval: 20 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	if !a.Connected() {
		t.Fatal("not connected through the relay")
	}
	f.Freeze()
	frozen := time.Now()
	for a.Connected() {
		if time.Since(frozen) > 8*time.Second {
			t.Fatalf("still connected %v after NATS froze", time.Since(frozen))
		}
		time.Sleep(50 * time.Millisecond)
	}
	for !strings.Contains(logs.String(), "disconnected from NATS") {
		if time.Since(frozen) > 8*time.Second {
			t.Fatalf("no disconnection logged: %s", logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("lost NATS %v after it froze", time.Since(frozen).Round(100*time.Millisecond))
	// While nats.go tries the frozen server again (each dial waits 2 s for
	// its greeting, under the connection's lock), Connected answers at
	// once: /metrics reads it, and stalled for up to 2 s (the replicas
	// trial). The bound is loose: blocking takes the dial's whole 2 s.
	slowest := time.Duration(0)
	for range 15 {
		t0 := time.Now()
		a.Connected()
		slowest = max(slowest, time.Since(t0))
		time.Sleep(100 * time.Millisecond)
	}
	if slowest > time.Second {
		t.Fatalf("Connected took %v while NATS was being dialled", slowest)
	}
}

// The warning that NATS cannot be reached says why: a URL pointing at a
// port where nothing listens, or at another kind of server, was warned
// about with no reason (found by the replicas user trial).
func TestCannotReachNATSSaysWhy(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	http, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer http.Close()
	go func() {
		for {
			c, err := http.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"))
			c.Close()
		}
	}()
	for addr, want := range map[string]string{closed: "connection refused", http.Addr().String(): "not a NATS server"} {
		_, logs := startLogged(t, Config{URL: "nats://" + addr, ID: "a"}, func() []Entry { return nil }, func(map[Key]router.Load) {})
		ls := logLines(logs.String(), "replicas: cannot reach NATS yet; routing on this replica's load, retrying every 500ms")
		if len(ls) != 1 {
			t.Fatalf("%s: %d warnings: %s", addr, len(ls), logs.String())
		}
		if e, _ := ls[0]["error"].(string); !strings.Contains(e, want) {
			t.Fatalf("%s: the warning says %q, want %q", addr, e, want)
		}
	}
}

// A peer's load on a backend this replica does not have, or has at another
// URL, is not applied and is warned about once per replica and backend:
// replicas whose ids or model names differed shared nothing with no word
// of it, and two naming different engines e0 added one's load to the other
// (found by the replicas user trial). Entries without a URL hash (an older
// version) are taken as before.
func TestMismatchedBackendsAreWarnedOfAndIgnored(t *testing.T) {
	url := startNATS(t).ClientURL()
	ka := newSink()
	x, y := URLHash("http://10.0.0.1:8000"), URLHash("http://10.0.0.2:8000")
	_, logs := startLogged(t, Config{URL: url, ID: "a", Interval: 20 * time.Millisecond},
		func() []Entry {
			return []Entry{{Model: "m", Worker: "e0", URLHash: x}, {Model: "m", Worker: "e1", URLHash: y}}
		}, ka.apply)
	start(t, url, "b", []Entry{
		{Model: "m", Worker: "e0", URLHash: y, Load: router.Load{Inflight: 100}},     // another engine under our e0's id
		{Model: "m", Worker: "e9", URLHash: y, Load: router.Load{Inflight: 100}},     // a backend a does not have
		{Model: "m2", Worker: "e0", URLHash: x, Load: router.Load{Inflight: 100}},    // a model a does not serve
		{Model: "m", Worker: "e1", URLHash: y, Load: router.Load{Inflight: 1}},       // the same engine: counts
		{Model: "m", Worker: "e1", URLHash: "", Load: router.Load{PrefillTokens: 5}}, // an older version: counts
	}, newSink())
	start(t, url, "c", []Entry{{Model: "m", Worker: "e0", URLHash: URLHash("HTTP://10.0.0.1:8000/"), Load: router.Load{Inflight: 2}}}, newSink())
	ka.waitFor(t, "b's and c's load at a", func(m map[Key]router.Load) bool {
		return m[Key{"m", "e1"}] == router.Load{Inflight: 1, PrefillTokens: 5} && m[Key{"m", "e0"}].Inflight == 2
	})
	time.Sleep(200 * time.Millisecond) // ten reports of b's
	ka.mu.Lock()
	sum := ka.last
	ka.mu.Unlock()
	if len(sum) != 2 || sum[Key{"m", "e0"}].Inflight != 2 {
		t.Fatalf("a applied %v: b's load on other engines counted", sum)
	}
	l := logs.String()
	other := logLines(l, "replicas: a replica reports load on a backend of this id at another URL; ignored (replicas must name the same backends with the same URLs)")
	unknown := logLines(l, "replicas: a replica reports load on a backend this replica does not have; ignored (replicas must name the same models and backends)")
	if len(other) != 1 || other[0]["replica"] != "b" || other[0]["backend"] != "e0" || len(unknown) != 2 {
		t.Fatalf("want one warning of b's e0 at another URL and two of unknown backends, once each; log: %s", l)
	}
	for _, w := range append(other, unknown...) {
		if w["replica"] != "b" {
			t.Fatalf("%v: c names e0 at the same URL (spelt otherwise)", w)
		}
	}
}

// countReports counts the load reports replica id sends, as a subscriber
// of the NATS server at url sees them.
func countReports(t *testing.T, url, id string) *atomic.Int64 {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	n := new(atomic.Int64)
	if _, err := nc.Subscribe("kvproxy.load", func(m *nats.Msg) {
		var r report
		if json.Unmarshal(m.Data, &r) == nil && r.Replica == id {
			n.Add(1)
		}
	}); err != nil {
		t.Fatal(err)
	}
	nc.Flush()
	return n
}

// Load that ends (a prefill, a request) reaches the others within
// milliseconds, not at the next interval: they kept weighing it until
// then, and a follow-up sent at once to another replica left the engine
// holding its prefix (found by the replicas user trial). Load that does
// not change brings no report before the interval's.
func TestEndedLoadIsReportedAtOnce(t *testing.T) {
	url := startNATS(t).ClientURL()
	reports := countReports(t, url, "a")
	var mu sync.Mutex
	load := router.Load{Inflight: 1, Pending: 1, PrefillTokens: 830, ActiveBlocks: 52}
	a, err := Start(Config{URL: url, ID: "a", Interval: 5 * time.Second},
		func() []Entry { mu.Lock(); defer mu.Unlock(); return []Entry{{Model: "m", Worker: "e0", Load: load}} },
		func(map[Key]router.Load) {}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	kb := newSink()
	b := start(t, url, "b", nil, kb)
	b.nc.Flush() // b subscribed
	a.Publish()  // taken mid-prefill
	kb.waitFor(t, "a's load at b", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].PrefillTokens == 830 })
	for deadline := time.Now().Add(5 * time.Second); reports.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) { // b saw it: nc will
			t.Fatal("a's report never reached the counting subscriber")
		}
	}
	time.Sleep(300 * time.Millisecond)
	if n := reports.Load(); n != 1 {
		t.Fatalf("%d reports of a's unchanged load before its interval, want the one Publish sent", n)
	}

	mu.Lock()
	load = router.Load{Inflight: 1, ActiveBlocks: 52} // the prefill is done
	mu.Unlock()
	ended := time.Now()
	kb.waitFor(t, "a's prefill gone at b", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].PrefillTokens == 0 })
	mu.Lock()
	load = router.Load{} // and the request
	mu.Unlock()
	kb.waitFor(t, "a's request gone at b", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}] == router.Load{} })
	if d := time.Since(ended); d > 500*time.Millisecond {
		t.Fatalf("ended load reached b after %v (a reports every 5 s)", d)
	}
}

// The regular reports keep their interval beside the early ones: the loop
// counted the watch's ticks as the interval's, and reported at random.
func TestRegularReportsKeepTheirInterval(t *testing.T) {
	url := startNATS(t).ClientURL()
	reports := countReports(t, url, "a")
	a, err := Start(Config{URL: url, ID: "a", Interval: time.Second}, func() []Entry { return nil }, func(map[Key]router.Load) {}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	time.Sleep(3500 * time.Millisecond)
	if n := reports.Load(); n != 3 {
		t.Fatalf("%d reports in 3.5 s at an interval of 1 s, want 3", n)
	}
}

// The watch for ended load runs only while the last report showed load: an
// idle replica was woken every 5 ms for nothing.
func TestIdleReplicaDoesNotWatch(t *testing.T) {
	url := startNATS(t).ClientURL()
	var mu sync.Mutex
	var load router.Load
	a, err := Start(Config{URL: url, ID: "a", Interval: 50 * time.Millisecond},
		func() []Entry { mu.Lock(); defer mu.Unlock(); return []Entry{{Model: "m", Worker: "e0", Load: load}} },
		func(map[Key]router.Load) {}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	waitWatching := func(want bool) {
		t.Helper()
		for deadline := time.Now().Add(3 * time.Second); a.watching.Load() != want; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("watching %v, want %v", !want, want)
			}
		}
	}
	time.Sleep(200 * time.Millisecond) // several idle reports
	if a.watching.Load() {
		t.Fatal("an idle replica watches for ended load")
	}
	mu.Lock()
	load = router.Load{Inflight: 1, PrefillTokens: 100}
	mu.Unlock()
	waitWatching(true)
	mu.Lock()
	load = router.Load{}
	mu.Unlock()
	waitWatching(false)
}
