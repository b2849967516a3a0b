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
		mockSpec{id: "m0", port: freePort(t), speedup: 1})
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
	post := func(u, body string) (int, string) {
		t.Helper()
		resp, err := http.Post(u, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, b := post(ops+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`); code != 404 || !strings.Contains(b, "admin_listen") {
		t.Errorf("chat on admin_listen: want a 404 naming admin_listen, got %d %s", code, b)
	}
	// Engines' pushes of KV events are taken on both.
	for _, u := range []string{api, ops} {
		if code, b := post(u+"/v1/kv_events", `{"engine_id":"m0","events":[]}`); code == 404 {
			t.Errorf("POST %s/v1/kv_events: %d %s", u, code, b)
		}
	}
	// Raw requests: an ambiguous framing is refused and its connection
	// closed before the listener's 404 (no request smuggled behind it),
	// and an Expect: 100-continue to the wrong listener gets its 404, not
	// a 100 for a body sent in vain.
	raw := func(addr, req string) string {
		t.Helper()
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		io.WriteString(c, req)
		b, _ := io.ReadAll(c)
		return string(b)
	}
	smuggled := "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /live HTTP/1.1\r\nHost: x\r\n\r\n"
	for _, addr := range []string{v.Listen, v.AdminListen} {
		req := smuggled
		if addr == v.AdminListen {
			req = strings.Replace(req, "/metrics", "/v1/chat/completions", 1)
		}
		if got := raw(addr, req); !strings.HasPrefix(got, "HTTP/1.1 400") || strings.Count(got, "HTTP/1.1") != 1 {
			t.Errorf("ambiguous framing on %s: want one 400, got:\n%s", addr, got)
		}
	}
	if got := raw(v.AdminListen, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 3000\r\nExpect: 100-continue\r\n\r\n"); !strings.HasPrefix(got, "HTTP/1.1 404") {
		t.Errorf("Expect: 100-continue on admin_listen: want its 404 at once, got:\n%s", got)
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
	if !strings.Contains(c.waitLine("operators' connections refused", nil), `"refused":`) {
		t.Fatal("no count in the refusals' line")
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
	if n := metric("kvproxy_admin_connections_refused_total"); n == "0" {
		t.Fatalf("kvproxy_admin_connections_refused_total %s after a refusal", n)
	}

	// Through the drain, admin_listen serves on: /live, /health (503:
	// draining) and /metrics, while listen takes no more connections.
	streamed := make(chan string, 1)
	go func() {
		resp, err := http.Post(api+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hello","max_tokens":500,"ignore_eos":true,"stream":true}`))
		if err != nil {
			streamed <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		streamed <- string(b)
	}()
	for metric(`kvproxy_inflight_requests{backend="m0"}`) == "0" {
		time.Sleep(5 * time.Millisecond)
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	c.waitLine(`"message":"draining"`, nil)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) { // the drain begins just after its line
		code, body := get(t, ops+"/health")
		if code == 503 && strings.Contains(body, `"draining"`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/health on admin_listen while draining: %d %s", code, body)
		}
	}
	if code, body := get(t, ops+"/live"); code != 200 {
		t.Errorf("/live on admin_listen while draining: %d %s", code, body)
	}
	if n := metric(`kvproxy_inflight_requests{backend="m0"}`); n != "1" {
		t.Errorf("kvproxy_inflight_requests %s while the stream drains", n)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", v.Listen, time.Second)
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("listen still takes connections while draining")
		}
	}
	if got := <-streamed; !strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Errorf("the stream in flight did not end whole: %.300s", got)
	}
	c.waitExit("kvproxy exited")
}
