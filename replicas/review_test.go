package replicas

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/router"
)

// Two replicas given the same id (a copied config; or the default
// hostname-pid of two containers sharing the host's name, both pid 1)
// still count each other: neither takes the other's report for its own
// echo.
func TestSameIDStillShares(t *testing.T) {
	url := startNATS(t).ClientURL()
	k1, k2 := newSink(), newSink()
	start(t, url, "dup", []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 3}}}, k1)
	start(t, url, "dup", []Entry{{Model: "m", Worker: "e1", Load: router.Load{Inflight: 4}}}, k2)
	k1.waitFor(t, "the other dup's load", func(m map[Key]router.Load) bool {
		return m[Key{"m", "e1"}].Inflight == 4 && m[Key{"m", "e0"}].Inflight == 0
	})
	k2.waitFor(t, "the other dup's load", func(m map[Key]router.Load) bool {
		return m[Key{"m", "e0"}].Inflight == 3 && m[Key{"m", "e1"}].Inflight == 0
	})
}

// A hostile or buggy publisher on the subject cannot cancel the others'
// load with negative numbers, nor wrap the sum negative with huge ones.
func TestHostileReportsAreClamped(t *testing.T) {
	url := startNATS(t).ClientURL()
	ka, kb := newSink(), newSink()
	start(t, url, "a", nil, ka)
	start(t, url, "b", []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 2}}}, kb)

	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	huge := router.Load{Inflight: math.MaxInt64, Pending: math.MaxInt64, PrefillTokens: math.MaxInt64, ActiveBlocks: math.MaxInt64}
	var reports [][]byte
	for _, id := range []string{"evil1", "evil2"} {
		b, _ := json.Marshal(report{Replica: id, Loads: []Entry{
			{Model: "m", Worker: "e0", Load: router.Load{Inflight: -5, Pending: -1}},
			{Model: "m", Worker: "e1", Load: huge},
		}})
		reports = append(reports, b)
	}
	// Published as a replica would, again and again: reports sent once may
	// reach a before its subscription is in place, or expire before a
	// merges them with b's (a flake CI hit).
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			for _, b := range reports {
				nc.Publish("kvproxy.load", b)
			}
			nc.Flush()
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	ka.waitFor(t, "b's load and the evil reports at a", func(m map[Key]router.Load) bool {
		return m[Key{"m", "e1"}].Inflight != 0 && m[Key{"m", "e0"}].Inflight != 0
	})
	ka.mu.Lock()
	m := ka.last
	ka.mu.Unlock()
	if l := m[Key{"m", "e0"}]; l.Inflight != 2 || l.Pending != 0 {
		t.Fatalf("e0: %+v: negative reports cancelled b's load", l)
	}
	if l := m[Key{"m", "e1"}]; l.Inflight != router.MaxRemoteLoad || l.ActiveBlocks != router.MaxRemoteLoad {
		t.Fatalf("e1: %+v: want every field at router.MaxRemoteLoad", l)
	}
}

// A peer is expired after three of its own intervals, not the receiver's:
// one configured to report every 1.5 s (a rolling config change) must not
// drop out at a replica reporting every 20 ms between its reports.
func TestPeerExpiresAfterItsOwnInterval(t *testing.T) {
	url := startNATS(t).ClientURL()
	ka := newSink()
	a := start(t, url, "a", nil, ka)
	b, err := Start(Config{URL: url, ID: "b", Interval: 1500 * time.Millisecond},
		func() []Entry { return []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 1}}} },
		func(map[Key]router.Load) {}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	b.Publish()
	ka.waitFor(t, "b's load at a", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 1 })
	if a.expire(time.Now().Add(1600*time.Millisecond)) || a.Peers() != 1 {
		t.Fatal("b dropped out 1.6 s after its report, though it reports every 1.5 s")
	}
	if !a.expire(time.Now().Add(5*time.Second)) || a.Peers() != 0 {
		t.Fatal("b still counted 5 s after its last report")
	}
}

// A publisher inventing replica ids keeps at most maxPeers of them in
// memory; the replicas already known keep counting.
func TestPeersAreBounded(t *testing.T) {
	url := startNATS(t).ClientURL()
	ka, kb := newSink(), newSink()
	a := start(t, url, "a", nil, ka)
	start(t, url, "b", []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 2}}}, kb)
	ka.waitFor(t, "b's load at a", func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 2 })

	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	for i := 0; i < 3*maxPeers; i++ {
		b, _ := json.Marshal(report{Replica: fmt.Sprint("fake", i), Instance: fmt.Sprint(i), IntervalMs: 20000,
			Loads: []Entry{{Model: "m", Worker: "e1", Load: router.Load{Inflight: 1}}}})
		nc.Publish("kvproxy.load", b)
	}
	nc.Flush()
	ka.waitFor(t, "the fake reports at a", func(m map[Key]router.Load) bool { return m[Key{"m", "e1"}].Inflight >= maxPeers-1 })
	time.Sleep(100 * time.Millisecond) // b reports every 20 ms meanwhile
	if n := a.Peers(); n > maxPeers {
		t.Fatalf("%d peers kept, at most %d", n, maxPeers)
	}
	ka.mu.Lock()
	m := ka.last
	ka.mu.Unlock()
	if m[Key{"m", "e0"}].Inflight != 2 || m[Key{"m", "e1"}].Inflight > maxPeers {
		t.Fatalf("e0 %+v (b's must still count), e1 %+v", m[Key{"m", "e0"}], m[Key{"m", "e1"}])
	}
}

// A replica that crashed and is back under the same id (a restarted
// container keeps its hostname-pid) replaces its former self at once:
// the dead one's last load counted beside the new one's until it expired
// (three intervals, at least 1 s).
func TestReplicaBackUnderItsIDReplacesItsFormerSelf(t *testing.T) {
	url := startNATS(t).ClientURL()
	kb := newSink()
	start(t, url, "b", nil, kb)
	startA := func(inflight int64) *Sync {
		a, err := Start(Config{URL: url, Subject: "kvproxy.load", ID: "a", Interval: time.Second},
			func() []Entry { return []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: inflight}}} },
			func(map[Key]router.Load) {}, zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(a.Close)
		return a
	}
	old := startA(3)
	waitPublished(t, old, kb, func(m map[Key]router.Load) bool { return m[Key{"m", "e0"}].Inflight == 3 })
	old.Close()                         // gone without a word, as a crash; b keeps its load 3 s
	time.Sleep(2500 * time.Millisecond) // two of its reports missed (2 s), with room either side of its expiry (3 s)
	back := startA(5)
	// b's first view with the new a: 5 if it took its former self's
	// place, 8 if both count.
	waitPublished(t, back, kb, func(m map[Key]router.Load) bool { n := m[Key{"m", "e0"}].Inflight; return n == 5 || n == 8 })
	kb.mu.Lock()
	n := kb.last[Key{"m", "e0"}].Inflight
	kb.mu.Unlock()
	if n != 5 {
		t.Fatalf("b counts %d in flight on e0, want the new a's 5 alone", n)
	}
}

// waitPublished publishes s's load until k has seen what ok wants (a
// report sent once may come before the subscriber's subscription).
func waitPublished(t *testing.T, s *Sync, k *sink, ok func(map[Key]router.Load) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s.Publish()
		k.mu.Lock()
		done := k.last != nil && ok(k.last)
		k.mu.Unlock()
		if done {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the report never arrived")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// feedReport hands s a report of replica id's instance, as NATS would.
func feedReport(s *Sync, id, instance string, intervalMs, inflight int64) {
	b, _ := json.Marshal(report{Replica: id, Instance: instance, IntervalMs: intervalMs,
		Loads: []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: inflight}}}})
	s.receive(&nats.Msg{Subject: "kvproxy.load", Data: b})
}

// A replica back under its id takes its former self's place even with as
// many replicas as are kept (it was refused, and the dead one kept), and
// the log says the former instance went, as it says a replica's leaving
// (the trial: joins without leaves).
func TestReplicaBackUnderItsIDAtTheCap(t *testing.T) {
	logs := &syncBuffer{}
	s := &Sync{cfg: Config{ID: "r", Interval: 100 * time.Millisecond}, instance: "me",
		local: func() []Entry { return nil }, apply: func(map[Key]router.Load) {},
		log: zerolog.New(logs), peers: map[string]*peer{},
		mine: map[Key]string{{"m", "e0"}: ""}, mineAt: time.Now(), mismatched: map[string]bool{}}
	for i := range maxPeers - 1 {
		feedReport(s, fmt.Sprint("x", i), "i", 20000, 0)
	}
	feedReport(s, "a", "old", 100, 3)
	s.mu.Lock()
	s.peers["a/old"].seen = time.Now().Add(-300 * time.Millisecond) // two reports missed
	s.mu.Unlock()
	feedReport(s, "a", "new", 100, 5)
	s.mu.Lock()
	_, hasNew := s.peers["a/new"]
	_, hasOld := s.peers["a/old"]
	s.mu.Unlock()
	if !hasNew || hasOld {
		t.Fatalf("at the cap: new instance kept %v, old kept %v", hasNew, hasOld)
	}
	if l := logs.String(); !strings.Contains(l, `"instance":"old"`) || !strings.Contains(l, "its former instance's load no longer counts") || strings.Contains(l, "too many replicas") {
		t.Fatalf("log: %s", l)
	}
}

// A replica advertises the interval it reports at, its interval rounded to
// the loop's ticks (at 375ms it reports every 500ms): the others judge
// its reports missed by it.
func TestReplicaAdvertisesItsReportPeriod(t *testing.T) {
	for iv, want := range map[time.Duration]time.Duration{100 * time.Millisecond: 100 * time.Millisecond, 375 * time.Millisecond: 500 * time.Millisecond, time.Second: time.Second} {
		tick, per := reportTicks(iv)
		if got := time.Duration(per) * tick; got != want {
			t.Errorf("interval %v: reports every %v, want %v", iv, got, want)
		}
	}
	url := startNATS(t).ClientURL()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	got := make(chan report, 1)
	sub, err := nc.Subscribe("kvproxy.load", func(m *nats.Msg) {
		var r report
		if json.Unmarshal(m.Data, &r) == nil {
			select {
			case got <- r:
			default:
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	nc.Flush()
	a, err := Start(Config{URL: url, ID: "a", Interval: 375 * time.Millisecond}, func() []Entry { return nil }, func(map[Key]router.Load) {}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	a.Publish()
	select {
	case r := <-got:
		if r.IntervalMs != 500 {
			t.Fatalf("a replica reporting every 500ms advertises %d ms", r.IntervalMs)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no report")
	}
}
