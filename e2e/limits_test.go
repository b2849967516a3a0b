package e2e

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// chatOK sends one chat completion and reports whether it was answered 200.
func chatOK(url string) bool {
	c := &http.Client{Timeout: 2 * time.Second}
	resp, err := c.Post(url+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"default","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	readAll(resp.Body)
	return resp.StatusCode == 200
}

// holdConns opens n connections to addr that send nothing.
func holdConns(t *testing.T, addr string, n int) []net.Conn {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	for range n {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			t.Fatalf("connection %d: %v", len(conns)+1, err)
		}
		conns = append(conns, c)
	}
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	return conns
}

// Idle connections beyond the process's open files limit no longer end
// kvproxy: accepting fails with EMFILE and is retried (a warning, a count
// in kvproxy_accept_errors_total) until the connections close, and then a
// real request is served. kvproxy exited with code 1 within 140 ms of
// ~1,017 idle connections under ulimit -n 1024 (found by the security
// review); here the limit is 64, and limits.max_connections lets the
// connections take every descriptor.
func TestSurvivesDescriptorExhaustion(t *testing.T) {
	engines := fleet(t, 1)
	listen := freePort(t)
	path := filepath.Join(t.TempDir(), "kvproxy.yaml")
	body := "listen: " + listen + "\nlog_level: info\n" +
		backendsYAML(map[string]string{"e0": engines[0]}, "limits: {max_connections: 1000}\n")
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startLimited(t, 64, "kvproxy", "-config", path)
	url := "http://" + listen
	waitHealthy(t, url, p)
	if !chatOK(url) {
		t.Fatalf("no answer before the flood:\n%s", p.String())
	}

	conns := holdConns(t, listen, 100) // they wait in the backlog once descriptors run out
	waitFor(t, 5*time.Second, "the accept error's warning", func() bool {
		return strings.Contains(p.String(), "accepting a connection failed")
	})
	time.Sleep(300 * time.Millisecond)
	if out := p.String(); strings.Contains(out, "server stopped") || strings.Contains(out, "kvproxy exited") {
		t.Fatalf("kvproxy stopped on running out of descriptors:\n%s", tail(out, 3000))
	}

	for _, c := range conns {
		c.Close()
	}
	// Health probes and engine connections failed meanwhile too: the
	// engine may be out of selection for a moment.
	waitFor(t, 10*time.Second, "a request served after the connections closed", func() bool { return chatOK(url) })
	// The request may have come on a keep-alive connection while the
	// listener still waits out its backoff (1 s at most): the line follows.
	waitFor(t, 5*time.Second, "a line saying accepting resumed", func() bool {
		return strings.Contains(p.String(), "accepting connections again")
	})
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m := readAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(m, "kvproxy_accept_errors_total ") || strings.Contains(m, "kvproxy_accept_errors_total 0\n") {
		t.Errorf("kvproxy_accept_errors_total not counted:\n%s", m)
	}
}

// Under the default limits.max_connections (what the open files limit has
// room for: 22 of 64 here, beside one backend) idle connections never exhaust the descriptors:
// those over the cap are answered 503 and closed, no accept fails, the
// engine connections and probes keep theirs, and a request is served at
// once when some close.
func TestDefaultConnectionCapKeepsDescriptors(t *testing.T) {
	engines := fleet(t, 1)
	listen := freePort(t)
	path := filepath.Join(t.TempDir(), "kvproxy.yaml")
	body := "listen: " + listen + "\nlog_level: info\n" +
		backendsYAML(map[string]string{"e0": engines[0]}, "")
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startLimited(t, 64, "kvproxy", "-config", path)
	url := "http://" + listen
	waitHealthy(t, url, p)

	conns := holdConns(t, listen, 60)
	waitFor(t, 5*time.Second, "the refusals' warning", func() bool {
		return strings.Contains(p.String(), "client connections refused")
	})
	time.Sleep(300 * time.Millisecond)
	if out := p.String(); strings.Contains(out, "accepting a connection failed") || strings.Contains(out, "kvproxy exited") {
		t.Fatalf("the connections took every descriptor:\n%s", tail(out, 3000))
	}
	for _, c := range conns[:10] {
		c.Close()
	}
	waitFor(t, 3*time.Second, "a request served with 50 connections held", func() bool { return chatOK(url) })
	for _, c := range conns {
		c.Close()
	}
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m := readAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(m, "kvproxy_client_connections_refused_total ") || strings.Contains(m, "kvproxy_client_connections_refused_total 0\n") ||
		strings.Contains(p.String(), "backend unavailable") {
		t.Errorf("refusals not counted, or the engine taken out:\n%s\n%s", m, tail(p.String(), 3000))
	}
}

// Running out of descriptors is kvproxy's want, not the engine's: a
// request that cannot open an engine connection for it gets a 503 saying
// so, and the engine is not taken out (every engine of a 256-backend fleet
// was, and every request after got "no healthy backend": the scale trial),
// nor is a prefill engine, dialed first (the review).
func TestOutOfDescriptorsEjectsNoEngine(t *testing.T) {
	for _, disaggregated := range []bool{false, true} {
		t.Run(fmt.Sprint("disaggregated=", disaggregated), func(t *testing.T) {
			engines := fleet(t, 2)
			listen := freePort(t)
			path := filepath.Join(t.TempDir(), "kvproxy.yaml")
			addrs := map[string]string{"e0": engines[0]}
			extra := "limits: {max_connections: 1000}\n"
			if disaggregated {
				extra = "  - {id: p0, url: 'http://" + engines[1] + "', model: mock-model, kind: vllm, role: prefill}\n" + extra
			}
			if err := os.WriteFile(path, []byte("listen: "+listen+"\nlog_level: info\n"+backendsYAML(addrs, extra)), 0o600); err != nil {
				t.Fatal(err)
			}
			p := startLimited(t, 64, "kvproxy", "-config", path)
			url := "http://" + listen
			waitHealthy(t, url, p)
			if !disaggregated {
				// A long stream holds the engine connection kvproxy has;
				// the next request needs one of its own.
				resp, err := http.Post(url+"/v1/chat/completions", "application/json",
					strings.NewReader(`{"model":"default","stream":true,"max_tokens":4000,"messages":[{"role":"user","content":"hi"}]}`))
				if err != nil || resp.StatusCode != 200 {
					t.Fatalf("the long stream: %v %v", resp, err)
				}
				defer resp.Body.Close()
				if _, err := resp.Body.Read(make([]byte, 1)); err != nil {
					t.Fatal(err)
				}
			}
			client, err := net.DialTimeout("tcp", listen, 2*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer client.Close()

			conns := holdConns(t, listen, 100)
			waitFor(t, 5*time.Second, "the accept error's warning", func() bool {
				return strings.Contains(p.String(), "accepting a connection failed")
			})
			req, _ := http.NewRequest("POST", url+"/v1/chat/completions", strings.NewReader(`{"model":"default","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`))
			req.Header.Set("Content-Type", "application/json")
			client.SetDeadline(time.Now().Add(5 * time.Second))
			if err := req.Write(client); err != nil {
				t.Fatal(err)
			}
			answer, err := http.ReadResponse(bufio.NewReader(client), req)
			if err != nil {
				t.Fatal(err)
			}
			// A dial that fails is tried again once the pools' idle
			// connections are closed, and a descriptor may have come free
			// meanwhile: then it is served.
			got := readAll(answer.Body)
			if answer.StatusCode != 200 && (answer.StatusCode != 503 || !strings.Contains(got, `"code":"out_of_file_descriptors"`)) {
				t.Fatalf("%d %s\n%s", answer.StatusCode, got, tail(p.String(), 3000))
			}
			for _, c := range conns {
				c.Close()
			}
			waitFor(t, 10*time.Second, "a request served after the connections closed", func() bool { return chatOK(url) })
			if out := p.String(); strings.Contains(out, "backend ejected") || strings.Contains(out, "backend unavailable") {
				t.Fatalf("an engine was taken out for kvproxy's want of descriptors:\n%s", tail(out, 3000))
			}
			if disaggregated {
				// The prefill engine's attempt counts as the client's answer
				// does (503), or as a success, not as the engine's failure
				// (502).
				resp, err := http.Get(url + "/metrics")
				if err != nil {
					t.Fatal(err)
				}
				m := readAll(resp.Body)
				resp.Body.Close()
				if strings.Contains(m, `kvproxy_requests_total{backend="p0",code="502"}`) ||
					answer.StatusCode == 503 && !strings.Contains(m, `kvproxy_requests_total{backend="p0",code="503"} 1`) {
					t.Fatalf("the prefill engine's count (the client's %d):\n%s", answer.StatusCode, m)
				}
			}
		})
	}
}

// The engine connections one engine's pool keeps idle give way when
// another engine needs connections and the descriptors have run out:
// clients within the cap, moving from one engine to the other at once,
// got 503 out_of_file_descriptors (3 to 5 of 20: the review).
func TestIdleEngineConnectionsGiveWay(t *testing.T) {
	engines := fleet(t, 2)
	listen := freePort(t)
	path := filepath.Join(t.TempDir(), "kvproxy.yaml")
	body := "listen: " + listen + "\nlog_level: info\n" + backendsYAML(map[string]string{"e0": engines[0], "e1": engines[1]}, "")
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startLimited(t, 64, "kvproxy", "-config", path)
	url := "http://" + listen
	waitHealthy(t, url, p)
	// Within the automatic cap, (64 - 16 - 2×4) / 2 = 20: the connections
	// of the health check and of the first burst may not be seen closed
	// yet when the next comes.
	const clients = 18
	burst := func(pin string) map[string]int {
		codes := map[string]int{}
		var mu sync.Mutex
		var wg sync.WaitGroup
		for range clients {
			wg.Go(func() {
				c := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
				code := "no answer"
				resp, err := c.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(
					`{"model":"default","max_tokens":64,"min_tokens":64,"messages":[{"role":"user","content":"hi"}],"nvext":{"backend_instance_id":"`+pin+`"}}`))
				if err == nil {
					b := readAll(resp.Body)
					resp.Body.Close()
					code = fmt.Sprint(resp.StatusCode)
					if resp.StatusCode != 200 {
						code += " " + b
					}
				}
				mu.Lock()
				codes[code]++
				mu.Unlock()
			})
		}
		wg.Wait()
		return codes
	}
	if codes := burst("e0"); codes["200"] != clients {
		t.Fatalf("to e0: %v\n%s", codes, tail(p.String(), 3000))
	}
	if codes := burst("e1"); codes["200"] != clients {
		t.Fatalf("to e1 at once, e0's connections still pooled: %v\n%s", codes, tail(p.String(), 3000))
	}
}
