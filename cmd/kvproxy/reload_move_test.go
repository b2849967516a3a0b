package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// A backend moved to another model by reload keeps being health-probed.
func TestMovedBackendIsStillProbed(t *testing.T) {
	var sick atomic.Bool
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" && sick.Load() {
			w.WriteHeader(503)
			return
		}
		w.WriteHeader(200)
	})}
	go srv.Serve(ln)
	defer srv.Close()
	ln2, err := net.Listen("tcp", "127.0.0.1:0") // y: another engine (one engine is not listed twice for a model)
	if err != nil {
		t.Fatal(err)
	}
	srv2 := &http.Server{Handler: srv.Handler}
	go srv2.Serve(ln2)
	defer srv2.Close()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	write := func(model string) {
		body := fmt.Sprintf("listen: 127.0.0.1:0\nlog_level: warn\nhealth: {interval: 50ms, fall: 1}\nmodels:\n  - {name: a}\n  - {name: b}\nbackends:\n  - {id: x, url: \"http://%s\", model: %s, served_model: m}\n  - {id: y, url: \"http://%s\", model: a, served_model: m}\n", ln.Addr(), model, ln2.Addr())
		os.WriteFile(cfg, []byte(body), 0o644)
	}
	write("a")
	p := startProxy(t, cfg)
	write("b")
	p.reload(t)
	sick.Store(true)
	deadline := time.Now().Add(3 * time.Second)
	for {
		resp, err := http.Get("http://" + p.addr + "/admin/backends")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var rows []struct {
			ID      string `json:"id"`
			Healthy bool   `json:"healthy"`
		}
		json.Unmarshal(b, &rows)
		healthy := map[string]bool{}
		for _, r := range rows {
			healthy[r.ID] = r.Healthy
		}
		if !healthy["y"] && !healthy["x"] {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("health endpoint failing for 3s, probes every 50ms: %s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
