package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/internal/testutil"
	"github.com/kvproxy/kvproxy/mockengine"
)

// fakeDNS answers lookups of one name from a set the test changes.
type fakeDNS struct {
	mu    sync.Mutex
	addrs []string
	err   error
}

func (f *fakeDNS) set(err error, addrs ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.addrs, f.err = addrs, err
}

func (f *fakeDNS) lookup(_ context.Context, host string) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if host != "engines.test" {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	return slices.Clone(f.addrs), f.err
}

// liveBackends lists the backends /admin/backends shows that are not
// draining, sorted: their ids, and with urls their urls.
func liveBackends(t *testing.T, p *proxyRun, urls bool) []string {
	t.Helper()
	resp, err := http.Get("http://" + p.addr + "/admin/backends")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []struct {
		ID       string `json:"id"`
		URL      string `json:"url"`
		Draining bool   `json:"draining"`
	}
	json.NewDecoder(resp.Body).Decode(&rows)
	var out []string
	for _, r := range rows {
		if !r.Draining {
			if urls {
				out = append(out, r.ID+" "+r.URL)
			} else {
				out = append(out, r.ID)
			}
		}
	}
	slices.Sort(out)
	return out
}

// backends discovered by DNS (backends[].discover: dns): kvproxy serves
// the engines at the addresses the name resolves to, takes the ones that
// appear and drops the ones that go, keeps them through a lookup that
// fails, and serves none (503) while the name does not exist.
func TestDiscoveredBackendsFollowTheirName(t *testing.T) {
	// Two engines on one port at two loopback addresses, as two pods of a
	// headless service.
	var engines []*mockengine.Engine
	port := 0
	for _, ip := range []string{"127.0.0.1", "127.0.0.2"} {
		mc := mockengine.DefaultConfig()
		mc.ID, mc.Model, mc.Speedup = "e-"+ip, "m", 1000
		e, err := mockengine.New(mc)
		if err != nil {
			t.Fatal(err)
		}
		addr, err := e.Start(fmt.Sprintf("%s:%d", ip, port))
		if err != nil {
			t.Skipf("cannot listen on %s:%d: %v", ip, port, err)
		}
		t.Cleanup(func() { e.Close() })
		_, p, _ := net.SplitHostPort(addr)
		fmt.Sscan(p, &port)
		engines = append(engines, e)
	}
	dns := &fakeDNS{}
	dns.set(nil, "127.0.0.1")
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, fmt.Appendf(nil, "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nrouter: {policy: round_robin}\n"+
		"backends: [{id: pool, url: 'http://engines.test:%d', discover: dns, discover_interval: 1s}]\n", port), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	ids := func() []string { return liveBackends(t, p, true) }
	await := func(want ...string) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !slices.Equal(ids(), want) {
			if time.Now().After(deadline) {
				t.Fatalf("backends %q, want %q", ids(), want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	one := fmt.Sprintf("pool@127.0.0.1 http://127.0.0.1:%d", port)
	two := fmt.Sprintf("pool@127.0.0.2 http://127.0.0.2:%d", port)
	await(one)
	if code, body := p.complete(t, false, 4); code != 200 {
		t.Fatalf("%d %s", code, body)
	}

	dns.set(nil, "127.0.0.2", "127.0.0.1")
	await(one, two)
	for range 4 {
		if code, body := p.complete(t, false, 4); code != 200 {
			t.Fatalf("%d %s", code, body)
		}
	}
	for _, e := range engines {
		if e.Stats().Requests == 0 {
			t.Fatalf("engine %s got no request", e.Config().ID)
		}
	}

	dns.set(&net.DNSError{Err: "i/o timeout", Name: "engines.test", IsTimeout: true})
	time.Sleep(2500 * time.Millisecond) // two lookups fail
	if got := ids(); !slices.Equal(got, []string{one, two}) {
		t.Fatalf("a failed lookup changed the backends: %q", got)
	}

	dns.set(nil, "127.0.0.2")
	await(two)
	dns.set(&net.DNSError{Err: "no such host", Name: "engines.test", IsNotFound: true})
	await()
	if code, body := p.complete(t, false, 4); code != 503 {
		t.Fatalf("no engine: %d %s", code, body)
	}
	if !strings.Contains(p.logs.String(), `"message":"discovery: addresses changed"`) {
		t.Errorf("the log does not tell of the changes:\n%s", p.logs.String())
	}
}

// gatedDNS answers from a table, and holds lookups of one host while its
// gate is set (a slow DNS server).
type gatedDNS struct {
	mu      sync.Mutex
	table   map[string][]string
	gate    chan struct{}
	blocked chan struct{}
}

func (g *gatedDNS) lookup(ctx context.Context, host string) ([]string, error) {
	g.mu.Lock()
	gate := g.gate
	addrs, ok := g.table[host]
	g.mu.Unlock()
	if gate != nil && host == "a.test" {
		select {
		case g.blocked <- struct{}{}:
		default:
		}
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if !ok {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	return addrs, nil
}

// A reload that adds a template while the watcher looks the old ones up
// keeps what it added: the watcher's older answer undid it (the review:
// resolve forgot the new template, and the sync removed its backends).
func TestReloadDuringADiscoveryLookup(t *testing.T) {
	dns := &gatedDNS{table: map[string][]string{"a.test": {"127.0.0.1"}, "b.test": {"127.0.0.2"}}, blocked: make(chan struct{}, 1)}
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	head := "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n"
	tA := "  - {id: a, url: 'http://a.test:29999', model: m, discover: dns, discover_interval: 1s}\n"
	tB := "  - {id: b, url: 'http://b.test:29999', model: m, discover: dns, discover_interval: 1s}\n"
	os.WriteFile(cfg, []byte(head+tA), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	release := make(chan struct{})
	dns.mu.Lock()
	dns.gate = release
	dns.mu.Unlock()
	<-dns.blocked // the watcher's lookup of a.test waits
	os.WriteFile(cfg, []byte(head+tA+tB), 0o644)
	reloaded := make(chan struct{})
	go func() { defer close(reloaded); p.reload(t) }()
	time.Sleep(200 * time.Millisecond)
	close(release)
	<-reloaded
	for end := time.Now().Add(3 * time.Second); !slices.Equal(liveBackends(t, p, false), []string{"a@127.0.0.1", "b@127.0.0.2"}); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("backends %q after a reload that added b", liveBackends(t, p, false))
		}
	}
	ids := func() []string { return liveBackends(t, p, false) }
	for range 3 { // through two more ticks
		if got := ids(); !slices.Equal(got, []string{"a@127.0.0.1", "b@127.0.0.2"}) {
			t.Fatalf("backends %q after a reload that added b", got)
		}
		time.Sleep(600 * time.Millisecond)
	}
	if strings.Contains(p.logs.String(), `"backends_removed"`) {
		t.Fatalf("a backend was removed:\n%s", p.logs.String())
	}
}

// slowDNS: lookups of hosts in slow wait until their context ends (a DNS
// server that does not answer), of hosts in fail get a temporary error,
// of others an answer from the table or "no such host".
type slowDNS struct {
	mu      sync.Mutex
	slow    map[string]bool
	fail    map[string]bool
	table   map[string][]string
	blocked chan string
}

func (d *slowDNS) set(f func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	f()
}

func (d *slowDNS) lookup(ctx context.Context, host string) ([]string, error) {
	d.mu.Lock()
	slow, fail, addrs, ok := d.slow[host], d.fail[host], d.table[host], d.table[host] != nil
	d.mu.Unlock()
	switch {
	case slow:
		select {
		case d.blocked <- host:
		default:
		}
		<-ctx.Done()
		return nil, &net.DNSError{Err: "i/o timeout", Name: host, IsTimeout: true}
	case fail:
		return nil, &net.DNSError{Err: "server misbehaving", Name: host, IsTemporary: true}
	case !ok:
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	return slices.Clone(addrs), nil
}

// templatesYAML is a configuration of one template per name n, each of
// host n.test, resolved again every interval.
func templatesYAML(interval string, names ...string) string {
	y := "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n"
	for _, n := range names {
		y += "  - {id: " + n + ", url: 'http://" + n + ".test:29999', model: m, discover: dns, discover_interval: " + interval + "}\n"
	}
	return y
}

func newSlowDNS(table map[string][]string) *slowDNS {
	return &slowDNS{slow: map[string]bool{}, fail: map[string]bool{}, table: table, blocked: make(chan string, 8)}
}

// While the DNS server does not answer, a SIGHUP and a SIGTERM are not
// held up by the watcher's lookups (the second review: both waited on
// them, 20 s with two templates).
func TestSignalsDoNotWaitForDiscoveryLookups(t *testing.T) {
	dns := newSlowDNS(map[string][]string{"a.test": {"127.0.0.1"}, "b.test": {"127.0.0.2"}})
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte(templatesYAML("1s", "a", "b")), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	dns.set(func() { dns.slow["a.test"], dns.slow["b.test"] = true, true })
	<-dns.blocked // the watcher waits on a lookup
	start := time.Now()
	p.reload(t)
	if d := time.Since(start); d > time.Second {
		t.Errorf("a reload waited %v for the watcher's lookups", d)
	}
	p.hup <- syscall.SIGHUP
	time.Sleep(100 * time.Millisecond)
	start = time.Now()
	p.term <- syscall.SIGTERM
	select {
	case <-p.code:
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("SIGTERM took %v", d)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no exit 15 s after SIGTERM")
	}
	go func() { p.code <- 0 }() // for the cleanup, which waits for an exit
}

// A template whose host changed stands for nothing until the new name
// resolves, whatever its id had stood for (the second review: a reused
// id brought back the old name's addresses, for another model).
func TestTemplateOfANewHostStartsEmpty(t *testing.T) {
	dns := newSlowDNS(map[string][]string{"old.test": {"127.0.0.1"}})
	dns.fail["new.test"] = true
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	head := "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}, {name: other}]\nhealth: {interval: 1h}\nbackends:\n  - {id: s, url: 'http://127.0.0.9:29999', model: m}\n"
	os.WriteFile(cfg, []byte(head+"  - {id: pool, url: 'http://old.test:29999', model: m, discover: dns, discover_interval: 1h}\n"), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	if got := liveBackends(t, p, false); !slices.Equal(got, []string{"pool@127.0.0.1", "s"}) {
		t.Fatalf("at start: %q", got)
	}
	os.WriteFile(cfg, []byte(head), 0o644)
	p.reload(t)
	os.WriteFile(cfg, []byte(head+"  - {id: pool, url: 'http://new.test:28888', model: other, discover: dns, discover_interval: 1h}\n"), 0o644)
	p.reload(t)
	if got := liveBackends(t, p, false); !slices.Equal(got, []string{"s"}) {
		t.Fatalf("a template of an unresolved new name stands for %q", got)
	}
}

// A prefill engine beside a decoding template whose name went: the model
// waits for engines (503), the configuration applies, and the reload
// counter does not fail every tick (the second review: the expansion
// was refused, at start and then every tick).
func TestDecodingTemplateOfNoneBesideAPrefillEngine(t *testing.T) {
	dns := newSlowDNS(map[string][]string{})
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n"+
		"  - {id: pre, url: 'http://127.0.0.9:29997', model: m, role: prefill}\n"+
		"  - {id: dec, url: 'http://dec.test:29999', model: m, discover: dns, discover_interval: 1s}\n"), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	if got := liveBackends(t, p, false); !slices.Equal(got, []string{"pre"}) {
		t.Fatalf("backends %q", got)
	}
	time.Sleep(1500 * time.Millisecond)
	if code, _ := p.complete(t, false, 2); code != 503 {
		t.Fatalf("no decoding engine: %d", code)
	}
	if strings.Contains(p.logs.String(), "could not be applied") {
		t.Fatalf("discovery failed to apply:\n%s", p.logs.String())
	}
}

// A reload adding a name the DNS server does not answer and one it does:
// the second is resolved at once (the fourth review: the first held it up,
// until the watcher's next tick an hour later).
func TestUnansweredNameHoldsUpNoOther(t *testing.T) {
	dns := newSlowDNS(map[string][]string{"b.test": {"127.0.0.2"}})
	dns.slow["a.test"] = true
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	head := "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n  - {id: s, url: 'http://127.0.0.9:29999', model: m}\n"
	os.WriteFile(cfg, []byte(head), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	os.WriteFile(cfg, []byte(head+
		"  - {id: a, url: 'http://a.test:29999', model: m, discover: dns, discover_interval: 1h}\n"+
		"  - {id: b, url: 'http://b.test:29999', model: m, discover: dns, discover_interval: 1h}\n"), 0o644)
	p.reload(t)
	for end := time.Now().Add(2 * time.Second); !slices.Equal(liveBackends(t, p, false), []string{"b@127.0.0.2", "s"}); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("backends %q", liveBackends(t, p, false))
		}
	}
}

// A template that leaves the file and comes back is resolved again: the
// watcher did not keep its name current meanwhile (the third and fourth
// reviews: it came back with the addresses it left with, or with none).
func TestReaddedTemplateIsResolvedAgain(t *testing.T) {
	for _, tc := range []struct {
		name    string
		before  []string // what the name stood for when the template left
		failing bool     // its lookups fail when it is back
	}{{"moved", []string{"127.0.0.1"}, false}, {"did not exist", nil, false}, {"lookup failing", []string{"127.0.0.1"}, true}} {
		t.Run(tc.name, func(t *testing.T) {
			dns := newSlowDNS(map[string][]string{"pool.test": tc.before})
			cfg := filepath.Join(t.TempDir(), "c.yaml")
			head := "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n  - {id: s, url: 'http://127.0.0.9:29999', model: m}\n"
			tmpl := "  - {id: pool, url: 'http://pool.test:29999', model: m, discover: dns, discover_interval: 1h}\n"
			os.WriteFile(cfg, []byte(head+tmpl), 0o644)
			p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
			os.WriteFile(cfg, []byte(head), 0o644)
			p.reload(t)
			dns.set(func() { dns.table["pool.test"], dns.fail["pool.test"] = []string{"127.0.0.2"}, tc.failing })
			os.WriteFile(cfg, []byte(head+tmpl), 0o644)
			p.reload(t)
			want := []string{"pool@127.0.0.2", "s"}
			if tc.failing {
				want = []string{"s"}
			}
			for end := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				got := liveBackends(t, p, false)
				if slices.Contains(got, "pool@127.0.0.1") {
					t.Fatalf("the template came back with the address it left with: %q", got)
				}
				if slices.Equal(got, want) && (!tc.failing || time.Until(end) < 2500*time.Millisecond) {
					break
				}
				if time.Now().After(end) {
					t.Fatalf("the template back stands for %q, want %q", got, want)
				}
			}
		})
	}
}

// A SIGHUP adding templates of names the DNS server does not answer, then
// a SIGTERM: the reload's lookups are bounded all together, and the
// SIGTERM waits no longer (the third review: 5 s a name, under the lock).
func TestSigtermAfterAReloadOfUnansweredNames(t *testing.T) {
	dns := newSlowDNS(map[string][]string{})
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	head := "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n  - {id: s, url: 'http://127.0.0.9:29999', model: m}\n"
	os.WriteFile(cfg, []byte(head), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	dns.set(func() { dns.slow["a.test"], dns.slow["b.test"] = true, true })
	os.WriteFile(cfg, []byte(head+
		"  - {id: a, url: 'http://a.test:29999', model: m, discover: dns, discover_interval: 1h}\n"+
		"  - {id: b, url: 'http://b.test:29999', model: m, discover: dns, discover_interval: 1h}\n"), 0o644)
	p.hup <- syscall.SIGHUP
	<-dns.blocked
	start := time.Now()
	p.term <- syscall.SIGTERM
	select {
	case <-p.code:
		if d := time.Since(start); d > lookupsTime+time.Second {
			t.Errorf("SIGTERM took %v", d)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no exit 15 s after SIGTERM")
	}
	go func() { p.code <- 0 }() // for the cleanup, which waits for an exit
}

// A reload's shorter discover_interval applies at once: a name whose
// lookup failed at the reload is resolved a second later, not after the
// interval of the configuration before (the third review: an hour).
func TestReloadedIntervalAppliesAtOnce(t *testing.T) {
	dns := newSlowDNS(map[string][]string{"a.test": {"127.0.0.1"}, "new.test": {"127.0.0.3"}})
	dns.fail["new.test"] = true
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	head := "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n  - {id: a, url: 'http://a.test:29999', model: m, discover: dns, discover_interval: 1h}\n"
	os.WriteFile(cfg, []byte(head), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	os.WriteFile(cfg, []byte(head+"  - {id: pool, url: 'http://new.test:29999', model: m, discover: dns, discover_interval: 1s}\n"), 0o644)
	p.reload(t)
	if got := liveBackends(t, p, false); !slices.Equal(got, []string{"a@127.0.0.1"}) {
		t.Fatalf("after a failed lookup: %q", got)
	}
	dns.set(func() { dns.fail["new.test"] = false })
	for end := time.Now().Add(5 * time.Second); !slices.Contains(liveBackends(t, p, false), "pool@127.0.0.3"); {
		if time.Now().After(end) {
			t.Fatalf("5 s after its name resolves (discover_interval 1s): %q", liveBackends(t, p, false))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A reload renaming a template's host keeps its engines serving: the
// reload resolves the new name before it applies (the fifth review: its
// backends went and came back, and requests got 503 between).
func TestRenamedHostKeepsServing(t *testing.T) {
	_, port, _ := net.SplitHostPort(startZMQEngine(t, "e", 1000).addr)
	dns := newSlowDNS(map[string][]string{"old.test": {"127.0.0.1"}, "new.test": {"127.0.0.1"}})
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	write := func(host string) {
		os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nbackends:\n"+
			"  - {id: pool, url: 'http://"+host+":"+port+"', model: m, discover: dns, discover_interval: 1h}\n"), 0o644)
	}
	write("old.test")
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	for i := range 10 {
		write([]string{"new.test", "old.test"}[i%2])
		p.reload(t)
		if code, body := p.complete(t, false, 2); code != 200 {
			t.Fatalf("after renaming %d times: %d %s", i+1, code, body)
		}
	}
	if strings.Contains(p.logs.String(), `"backends_removed"`) {
		t.Fatalf("the engine was taken out and put back:\n%s", p.logs.String())
	}
}

// One tick that finds several names changed applies them in one reload of
// the proxy (the fifth review: one per name).
func TestOneApplyPerTick(t *testing.T) {
	dns := newSlowDNS(map[string][]string{"a.test": {"127.0.0.1"}, "b.test": {"127.0.0.2"}, "c.test": {"127.0.0.3"}})
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte(templatesYAML("1s", "a", "b", "c")), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	dns.set(func() {
		dns.table["a.test"], dns.table["b.test"], dns.table["c.test"] = []string{"127.0.0.4"}, []string{"127.0.0.5"}, []string{"127.0.0.6"}
	})
	want := []string{"a@127.0.0.4", "b@127.0.0.5", "c@127.0.0.6"}
	for end := time.Now().Add(3 * time.Second); !slices.Equal(liveBackends(t, p, false), want); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("backends %q", liveBackends(t, p, false))
		}
	}
	if n := strings.Count(p.logs.String(), `"message":"configuration reloaded"`); n != 1 {
		t.Fatalf("%d reloads for one tick's changes", n)
	}
}

// A name whose lookup failed at start is tried again every second, not
// after its discover_interval (the fifth review: an hour).
func TestNameUnresolvedAtStartIsRetried(t *testing.T) {
	dns := newSlowDNS(map[string][]string{"pool.test": {"127.0.0.1"}})
	dns.fail["pool.test"] = true
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n"+
		"  - {id: pool, url: 'http://pool.test:29999', model: m, discover: dns, discover_interval: 1h}\n"), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	dns.set(func() { dns.fail["pool.test"] = false })
	for end := time.Now().Add(3 * time.Second); !slices.Equal(liveBackends(t, p, false), []string{"pool@127.0.0.1"}); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("backends %q", liveBackends(t, p, false))
		}
	}
}

// countingDNS is slowDNS counting the lookups of each host.
type countingDNS struct {
	*slowDNS
	n sync.Map // host → *atomic.Int32
}

func (c *countingDNS) lookup(ctx context.Context, host string) ([]string, error) {
	v, _ := c.n.LoadOrStore(host, new(atomic.Int32))
	v.(*atomic.Int32).Add(1)
	return c.slowDNS.lookup(ctx, host)
}

func (c *countingDNS) count(host string) int32 {
	v, _ := c.n.LoadOrStore(host, new(atomic.Int32))
	return v.(*atomic.Int32).Load()
}

// What a reload that failed looked up is not kept: a later reload adding
// the same name resolves it anew (the sixth review: the failed reload's
// answer served until the next interval).
func TestFailedReloadKeepsNoLookup(t *testing.T) {
	dns := newSlowDNS(map[string][]string{"pool.test": {"127.0.0.1"}})
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	head := "listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n  - {id: s, url: 'http://127.0.0.9:29999', model: m}\n"
	tmpl := "  - {id: pool, url: 'http://pool.test:29999', model: m, discover: dns, discover_interval: 1h}\n"
	os.WriteFile(cfg, []byte(head), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	os.WriteFile(cfg, []byte(head+tmpl+"  - {id: mk, url: 'http://"+taken.Addr().String()+"', model: m, kind: mock}\n"), 0o644)
	p.reloadRejected(t) // the mock's port is taken
	dns.set(func() { dns.table["pool.test"], dns.fail["pool.test"] = []string{"127.0.0.2"}, true })
	os.WriteFile(cfg, []byte(head+tmpl), 0o644)
	p.reload(t)
	if got := liveBackends(t, p, false); !slices.Equal(got, []string{"s"}) {
		t.Fatalf("the failed reload's lookup served: %q", got)
	}
	dns.set(func() { dns.fail["pool.test"] = false })
	for end := time.Now().Add(4 * time.Second); !slices.Equal(liveBackends(t, p, false), []string{"pool@127.0.0.2", "s"}); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("backends %q", liveBackends(t, p, false))
		}
	}
}

// A name whose lookups keep failing is tried again after 1 s, 2 s, 4 s ...
// and warned of once (the sixth review: every second, with a warning
// each time, whatever its discover_interval).
func TestUnresolvedNameBacksOff(t *testing.T) {
	dns := &countingDNS{slowDNS: newSlowDNS(map[string][]string{})}
	dns.fail["pool.test"] = true
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nlog_level: info\nmodels: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n"+
		"  - {id: pool, url: 'http://pool.test:29999', model: m, discover: dns, discover_interval: 1h}\n"), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	time.Sleep(6500 * time.Millisecond)
	if n := dns.count("pool.test"); n < 3 || n > 4 { // at 0, 1, 3 (and 7) s
		t.Errorf("%d lookups in 6.5 s", n)
	}
	if n := strings.Count(p.logs.String(), `"message":"discovery: lookup failed`); n != 1 {
		t.Errorf("%d warnings of the failed lookups", n)
	}
}

// A name that does not answer holds up another's change in the watcher by
// the tick's bound at most, not each lookup's 5 s (the sixth review).
func TestSlowNameHoldsUpTheWatcherLittle(t *testing.T) {
	dns := newSlowDNS(map[string][]string{"a.test": {"127.0.0.1"}, "b.test": {"127.0.0.2"}})
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte(templatesYAML("1s", "a", "b")), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	dns.set(func() { dns.slow["a.test"], dns.table["b.test"] = true, []string{"127.0.0.5"} })
	start := time.Now()
	for !slices.Contains(liveBackends(t, p, false), "b@127.0.0.5") {
		if time.Since(start) > lookupsTime+2*time.Second {
			t.Fatalf("b's change not applied %v after it: %q", time.Since(start), liveBackends(t, p, false))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := liveBackends(t, p, false); !slices.Contains(got, "a@127.0.0.1") {
		t.Fatalf("a name that stopped answering lost its engines: %q", got)
	}
}

// A change of the engines found does not read the listener's certificate
// again: with its files gone, discovery still applies (the sixth review:
// every apply failed on the missing file).
func TestDiscoveryNeedsNoCertificateFiles(t *testing.T) {
	dir := t.TempDir()
	testutil.SelfSignedCert(t, dir, 1)
	dns := newSlowDNS(map[string][]string{"a.test": {"127.0.0.1"}})
	cfg := filepath.Join(dir, "c.yaml")
	os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nlog_level: info\ntls: {cert_file: "+filepath.Join(dir, "cert.pem")+", key_file: "+filepath.Join(dir, "key.pem")+"}\n"+
		"models: [{name: m}]\nhealth: {interval: 1h}\nbackends:\n  - {id: a, url: 'http://a.test:29999', model: m, discover: dns, discover_interval: 1s}\n"), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	os.Remove(filepath.Join(dir, "cert.pem"))
	dns.set(func() { dns.table["a.test"] = []string{"127.0.0.2"} })
	time.Sleep(2500 * time.Millisecond)
	if strings.Contains(p.logs.String(), "could not be applied") {
		t.Fatalf("discovery read the certificate:\n%s", p.logs.String())
	}
}

// A name that leaves the file ends its streak of failed lookups: back, it
// is tried again after a second, and warned of anew (the seventh review:
// it inherited the old streak's backoff and silence).
func TestReaddedNameStartsAFreshStreak(t *testing.T) {
	dns := &countingDNS{slowDNS: newSlowDNS(map[string][]string{"a.test": {"127.0.0.1"}, "b.test": {"127.0.0.2"}})}
	dns.fail["b.test"] = true
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte(templatesYAML("1h", "a", "b")), 0o644)
	p := startProxyWith(t, cfg, func(c *command) { c.lookup = dns.lookup })
	time.Sleep(3500 * time.Millisecond) // b fails at 0, 1, 3 s: its next try at 7 s
	os.WriteFile(cfg, []byte(templatesYAML("1h", "a")), 0o644)
	p.reload(t)
	os.WriteFile(cfg, []byte(templatesYAML("1h", "a", "b")), 0o644)
	p.reload(t) // its lookup fails: a new streak
	dns.set(func() { dns.fail["b.test"] = false })
	for end := time.Now().Add(2500 * time.Millisecond); !slices.Contains(liveBackends(t, p, false), "b@127.0.0.2"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("the name back was not tried again within a second or two: %q", liveBackends(t, p, false))
		}
	}
	if n := strings.Count(p.logs.String(), `"host":"b.test","error"`); n != 2 {
		t.Errorf("%d warnings for b.test's two streaks of failures", n)
	}
}
