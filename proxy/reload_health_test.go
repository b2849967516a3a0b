package proxy

import (
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// startProbedProxy starts a proxy with active health checks (startProxyYAML
// turns them off).
func startProbedProxy(t *testing.T, yaml string) *testProxy {
	t.Helper()
	return serveYAML(t, yaml, false)
}

// deadAddr is a loopback address that refuses connections.
func deadAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func available(p *testProxy, model, name string) bool {
	w, ok := workerStatus(p, model, name)
	return ok && !w.Removed && w.Available
}

// A dead engine is down from its first failed probe, at start and in a
// backend a reload adds, and stays down through a reload that rebuilds its
// backend: the rebuilt backend was available, and taking requests, until
// fall probes had failed again (found by the ninth session's operator trial
// and review).
func TestDeadEngineStaysDownThroughStartAndReload(t *testing.T) {
	live := startFake(t, "live", nil)
	dead := deadAddr(t)
	yaml := func(forget string) string {
		return "models: [{name: m}]\nhealth: {interval: 1h, fall: 3, forget_after: " + forget + "}\nbackends:\n" +
			"  - {id: live, url: 'http://" + live.addr + "', model: m}\n  - {id: dead, url: 'http://" + dead + "', model: m}\n"
	}
	p := startProbedProxy(t, yaml("1m"))
	for deadline := time.Now().Add(5 * time.Second); available(p, "m", "dead"); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a dead engine at start is still available after its first probe (probes every hour, fall 3)")
		}
	}
	for _, forget := range []string{"2m", "3m", "4m"} {
		reloadYAML(t, p, yaml(forget)) // rebuilds every backend
		if p.s.st.Load().backends["dead"] == nil || available(p, "m", "dead") {
			t.Fatal("a reload that rebuilt the dead engine's backend made it available")
		}
	}
	// One outage, one ejection: each reload counted another (found by the
	// ninth session's third review).
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_backend_ejections_total{backend="dead",reason="probe"} 1`+"\n") {
		t.Errorf("ejections of the dead engine after three reloads: %s", metricLine(m, `kvproxy_backend_ejections_total{backend="dead"`))
	}
	if !available(p, "m", "live") {
		t.Fatal("the live engine's rebuilt backend is not available")
	}
	for range 4 {
		if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	if n := live.requests.Load(); n != 4 {
		t.Fatalf("the live engine got %d of 4 requests", n)
	}
}

// A reload that rebuilds a backend (here: only limits.stream_idle_timeout
// changed, which its connections are built with) keeps its KV event feed, and with it the index: a new feed found the
// index empty, and vLLM does not announce again the blocks it still holds
// (found by the ninth session's review). A reload that points the backend
// at another engine starts a new feed.
func TestReloadKeepsTheFeedOfTheSameEngine(t *testing.T) {
	e0, e1 := startFake(t, "e0", nil), startFake(t, "e1", nil)
	yaml := func(addr, idle string) string {
		return "models: [{name: m, block_size: 16}]\nlimits: {stream_idle_timeout: " + idle + "}\nbackends:\n" +
			"  - {id: e0, url: 'http://" + addr + "', model: m, kv_events: {mode: http}}\n"
	}
	p := startProxyYAML(t, yaml(e0.addr, "1m"))
	pushRank(t, p, "e0", 0, promptIDs(100))
	indexed := func() int {
		w, _ := workerStatus(p, "m", "e0")
		return w.IndexedBlocks
	}
	if indexed() != 4 {
		t.Fatalf("%d blocks indexed, want 4", indexed())
	}
	before := p.s.st.Load().backends["e0"]
	reloadYAML(t, p, yaml(e0.addr, "2m"))
	if p.s.st.Load().backends["e0"] == before {
		t.Fatal("the reload did not rebuild the backend: the test tests nothing")
	}
	if n := indexed(); n != 4 {
		t.Fatalf("%d blocks indexed after a reload that changed only limits.stream_idle_timeout, want 4", n)
	}
	more := `{"engine_id":"e0","events":[{"type":"block_stored","block_hashes":[101,102,103,104],"parent_block_hash":null,"token_ids":[` +
		promptIDs(200) + `],"block_size":16}]}`
	if resp, b := post(t, p.url+"/v1/kv_events", more); resp.StatusCode != 200 { // the feed goes on taking events
		t.Fatalf("push: %d %s", resp.StatusCode, b)
	}
	if n := indexed(); n != 8 {
		t.Fatalf("%d blocks indexed after more events, want 8", n)
	}
	reloadYAML(t, p, yaml(e1.addr, "2m"))
	if n := indexed(); n != 0 {
		t.Fatalf("%d blocks indexed after the backend moved to another engine, want 0", n)
	}
}

// An engine ejected because its connections failed is back when its health
// probe passes, not when the ejection's time is up: it may still be dead
// (found by the ninth session's operator trial: after eject_base the
// backend was available again, and the next request was refused and
// rerouted before the probes noticed).
func TestConnectionEjectionEndsWithAPassingProbe(t *testing.T) {
	other := startFake(t, "other", nil)
	var probes atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(http.ResponseWriter, *http.Request) { probes.Add(1) })
	crashy := &http.Server{Handler: mux}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	go crashy.Serve(ln)
	p := startProbedProxy(t, "models: [{name: m}]\nrouter: {policy: round_robin}\n"+
		"health: {interval: 400ms, fall: 100, eject_base: 20ms, eject_max: 20ms}\nbackends:\n"+
		"  - {id: other, url: 'http://"+other.addr+"', model: m}\n  - {id: crashy, url: 'http://"+addr+"', model: m}\n")
	for deadline := time.Now().Add(5 * time.Second); probes.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("crashy was never probed")
		}
	}
	crashy.Close() // the engine dies: connections are refused
	for i := 0; !ejected(p, "crashy"); i++ {
		if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s (another engine should have taken it)", i, resp.StatusCode, b)
		}
		if i > 10 {
			t.Fatal("crashy was never tried")
		}
	}
	time.Sleep(100 * time.Millisecond) // 5 × eject_base, less than a probe interval
	if available(p, "m", "crashy") {
		t.Fatal("the ejection of an engine refusing connections ended on its timer")
	}
	ln, err = net.Listen("tcp", addr) // back, at the same address
	if err != nil {
		t.Skipf("cannot listen on %s again: %v", addr, err)
	}
	back := &http.Server{Handler: mux}
	go back.Serve(ln)
	t.Cleanup(func() { back.Close() })
	for deadline := time.Now().Add(3 * time.Second); !available(p, "m", "crashy"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the engine is back, but a passing probe did not end its ejection")
		}
	}
}
