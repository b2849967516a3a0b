package proxy

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// Requests answered before an endpoint takes them (unknown path, wrong
// method, a bad key on /v1/models, the Responses API, headers too large)
// get an access-log line like every other request, and the log never
// quotes their headers: an API key stays out of it.
func TestUnroutedRequestsAreLogged(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, tenantsYAML, e)
	do := func(method, path string) int {
		req, _ := http.NewRequest(method, p.url+path, nil)
		req.Header.Set("Authorization", "Bearer wrong-secret-key-0001")
		req.Header.Set("X-Request-Id", "mine-7")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if id := resp.Header.Get("X-Request-Id"); id != "mine-7" { // the SDKs show it with the error
			t.Errorf("%s %s: X-Request-Id %q, want the client's", method, path, id)
		}
		return resp.StatusCode
	}
	for _, c := range []struct {
		method, path string
		status       int
	}{
		{"GET", "/no/such/path", 404},
		{"GET", "/v1/models", 401},
		{"POST", "/v1/threads", 404},
		{"PUT", "/health", 405},
	} {
		if got := do(c.method, c.path); got != c.status {
			t.Fatalf("%s %s: %d, want %d", c.method, c.path, got, c.status)
		}
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(conn, "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer header-secret-key-0002\r\nX-Big: %s\r\n\r\n", strings.Repeat("a", 200<<10))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil || resp.StatusCode != 431 {
		t.Fatalf("200 KB of headers: %v %v", resp, err)
	}
	if id := resp.Header.Get("X-Request-Id"); !strings.HasPrefix(id, "req-") {
		t.Errorf("431: X-Request-Id %q, want kvproxy's own", id)
	}
	var logs string
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		logs = p.logs.String()
		if strings.Contains(logs, `"status":431`) || time.Now().After(deadline) {
			break
		}
	}
	for _, want := range []string{
		`"method":"GET","path":"/no/such/path","status":404`,
		`"method":"GET","path":"/v1/models","status":401`,
		`"method":"POST","path":"/v1/threads","status":404`,
		`"method":"PUT","path":"/health","status":405`,
		`"remote":"127.0.0.1","status":431,"error":"headers too large"`,
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("no access-log line with %s in:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, `"duration":9223372036854`) {
		t.Errorf("a transport error logged a duration from fasthttp's zero start time:\n%s", logs)
	}
	for _, secret := range []string{"wrong-secret-key-0001", "header-secret-key-0002"} {
		if strings.Contains(logs, secret) {
			t.Errorf("%s leaked into the log", secret)
		}
	}
}

// A request the client named has both ids in its access log line: the
// client's, which any client can send, and kvproxy's unique one, the id
// the engine got (the security review).
func TestClientNamedRequestLogsKvproxysID(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}'}]\n", e)
	if resp, b := postHeaders(t, p.url+"/v1/completions", `{"model":"m","prompt":"hi"}`, "X-Request-Id", "mine-7"); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	e.mu.Lock()
	engineID := e.headers[len(e.headers)-1].Get("X-Request-Id")
	e.mu.Unlock()
	if !strings.HasPrefix(engineID, "req-") || !strings.HasSuffix(engineID, ".mine-7") {
		t.Fatalf("the engine got X-Request-Id %q", engineID)
	}
	want := `"request_id":"mine-7","engine_request_id":"` + engineID + `"`
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(p.logs.String(), want); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no line with %s:\n%s", want, p.logs.String())
		}
	}
}
