package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// get answers a GET of url: its status and body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// With admin_listen, the operators' endpoints are served there and not on
// listen, the API only on listen, and probes on both; the operators'
// connections are not the clients' (limits.max_connections): with every
// client connection held by clients slow to send their headers, /live,
// /metrics and /admin/* still answer on admin_listen, whose own connections
// are capped too.
func TestAdminListen(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	const maxConns = 4
	opsConfig(t, cfg, "info", fmt.Sprintf("admin_listen: 127.0.0.1:0\nlimits: {max_connections: %d, header_timeout: 30s}\n", maxConns),
		mockSpec{id: "m0", port: freePort(t), speedup: 1000})
	c := startChild(t, cfg)
	var v struct {
		Listen      string
		AdminListen string `json:"admin_listen"`
	}
	if err := json.Unmarshal([]byte(c.waitLine("kvproxy serving", nil)), &v); err != nil {
		t.Fatal(err)
	}
	if v.AdminListen == "" || v.AdminListen == v.Listen {
		t.Fatalf("serving line names no admin listener of its own: %+v", v)
	}
	api, ops := "http://"+v.Listen, "http://"+v.AdminListen

	resp, err := http.Post(api+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("chat on listen: %d %s", resp.StatusCode, b)
	}
	for _, u := range []string{api + "/live", api + "/health", ops + "/live", ops + "/healthz", ops + "/admin/backends"} {
		if code, body := get(t, u); code != 200 {
			t.Errorf("GET %s: %d %s", u, code, body)
		}
	}
	if code, body := get(t, ops+"/metrics"); code != 200 || !strings.Contains(body, `kvproxy_requests_total{backend="m0",code="200"} 1`) {
		t.Errorf("GET /metrics on admin_listen: %d %.300s", code, body)
	}
	for _, u := range []string{api + "/metrics", api + "/admin/backends", ops + "/v1/models"} {
		code, body := get(t, u)
		if code != 404 || !strings.Contains(body, "admin_listen") || !strings.Contains(body, `"code":"not_found"`) {
			t.Errorf("GET %s: want a 404 naming admin_listen, got %d %s", u, code, body)
		}
	}
	for _, u := range []string{api + "/v1/kv_events", ops + "/v1/chat/completions"} {
		resp, err := http.Post(u, "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 404 || !strings.Contains(string(b), "admin_listen") {
			t.Errorf("POST %s: want a 404 naming admin_listen, got %d %s", u, resp.StatusCode, b)
		}
	}

	// Clients hold every connection listen takes, and the spares past it,
	// each with half a request: none is idle, none may be evicted. The
	// operators' connections are none of them.
	var held []net.Conn
	defer func() {
		for _, h := range held {
			h.Close()
		}
	}()
	hold := func(addr string, n int) {
		for range n {
			h, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			held = append(held, h)
			if _, err := io.WriteString(h, "GET /live HTTP/1.1\r\nHost: x\r\n"); err != nil {
				t.Fatal(err)
			}
		}
	}
	hold(v.AdminListen, 8) // an operator's tools: not clients, whatever they hold
	hold(v.Listen, maxConns+8)
	metric := func(name string) string {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			_, body := get(t, ops+"/metrics")
			for _, l := range strings.Split(body, "\n") {
				if f := strings.Fields(l); len(f) == 2 && f[0] == name {
					return f[1]
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("no %s in /metrics", name)
			}
		}
	}
	for deadline := time.Now().Add(10 * time.Second); metric("kvproxy_client_connections") != fmt.Sprint(maxConns); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("kvproxy_client_connections %s, want %d (the clients' held connections; admin_listen's not among them)", metric("kvproxy_client_connections"), maxConns)
		}
	}
	for range 5 {
		if code, body := get(t, ops+"/live"); code != 200 {
			t.Fatalf("/live on admin_listen with listen full: %d %s", code, body)
		}
	}
	if code, body := get(t, ops+"/admin/backends"); code != 200 || !strings.Contains(body, `"m0"`) {
		t.Fatalf("/admin/backends on admin_listen with listen full: %d %s", code, body)
	}

	// admin_listen has a cap of its own: with all of it held, one more is
	// answered 503 and closed.
	hold(v.AdminListen, 64-8)
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, body, err := func() (int, string, error) {
			resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Get(ops + "/live")
			if err != nil {
				return 0, "", err
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(b), nil
		}()
		if code == 503 && strings.Contains(body, "admin_listen") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a 65th connection on admin_listen: %d %v, want 503", code, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, h := range held {
		h.Close()
	}
	held = nil
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if resp, err := http.Get(ops + "/live"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("admin_listen did not serve again once its connections closed")
		}
	}

	// admin_listen moves only at a restart.
	y, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg, []byte(strings.Replace(string(y), "admin_listen: 127.0.0.1:0", "admin_listen: 127.0.0.1:1", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	resp, err = http.Post(ops+"/admin/reload", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"admin_listen"`) {
		t.Fatalf("reload moving admin_listen: %d %s, want restart_needed to name it", resp.StatusCode, b)
	}
	if code, _ := get(t, ops+"/live"); code != 200 {
		t.Fatalf("admin_listen after the reload: %d", code)
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	c.waitExit("kvproxy exited")
}
