package backends

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// An engine that closes idle keep-alive connections sooner than the next
// probe leaves the prober a dead pooled connection each time: the probe
// dials again instead of failing (retryStale).
func TestProbeOfEngineClosingIdleConnections(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }))
	srv.Config.IdleTimeout = 20 * time.Millisecond
	srv.Start()
	defer srv.Close()
	down := make(chan string, 1)
	p := NewProber(ProbeConfig{Interval: 100 * time.Millisecond, Timeout: time.Second, Fall: 1})
	p.Add("a", ProbeURL{URL: srv.URL + "/health"}, func(healthy bool, why string) {
		if !healthy {
			select {
			case down <- why:
			default:
			}
		}
	})
	p.Start()
	defer p.Stop()
	for deadline := time.Now().Add(5 * time.Second); hits.Load() < 10; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("too few probes")
		}
	}
	select {
	case why := <-down:
		t.Fatalf("a probe failed on a connection the engine closed while idle: %s", why)
	default:
	}
}

// A backend that stays down for another reason is told the new one: its
// listing's probe_error said "connection refused" for good once the
// engine came back hung (the twenty-ninth session's trial).
func TestProbeTellsANewReasonOfADownBackend(t *testing.T) {
	var status atomic.Int64
	status.Store(503)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(int(status.Load())) }))
	defer srv.Close()
	whys := make(chan string, 100)
	p := NewProber(ProbeConfig{Interval: 20 * time.Millisecond, Timeout: time.Second, Fall: 1, Rise: 1})
	p.Add("a", ProbeURL{URL: srv.URL + "/health"}, func(healthy bool, why string) {
		if !healthy {
			whys <- why
		}
	})
	p.Start()
	defer p.Stop()
	next := func() string {
		select {
		case why := <-whys:
			return why
		case <-time.After(10 * time.Second):
			t.Fatal("no word from the prober")
			return ""
		}
	}
	if why := next(); why != "status 503" {
		t.Fatalf("first: %q", why)
	}
	status.Store(500)
	if why := next(); why != "status 500" {
		t.Fatalf("after the engine's answer changed: %q", why)
	}
	time.Sleep(100 * time.Millisecond) // several probes more, with the same reason
	if len(whys) != 0 {
		t.Fatalf("told again of the same reason: %q", next())
	}
}
