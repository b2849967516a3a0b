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
