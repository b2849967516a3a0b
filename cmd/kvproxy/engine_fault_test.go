package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// rawVLLM serves, on loopback, health probes and completions whose stream
// is written by answer, straight onto the connection.
func rawVLLM(t *testing.T, answer func(c net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					io.Copy(io.Discard, req.Body)
					if !strings.HasPrefix(req.URL.Path, "/v1/") {
						io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
						continue
					}
					answer(c)
					return
				}
			}()
		}
	}()
	return ln.Addr().String()
}

const sseHead = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

func chunk(s string) string { return fmt.Sprintf("%x\r\n%s\r\n", len(s), s) }

const tokenEvent = `data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":null}]}` + "\n\n"

// An engine that dies between two chunks of a stream, before [DONE]: the
// client gets an OpenAI error event and [DONE]. One that closes right after
// its [DONE] chunk (without the last, empty chunk) answered in full: the
// client's stream ends with that single [DONE] and no error.
func TestEngineClosingBetweenChunks(t *testing.T) {
	for name, tc := range map[string]struct {
		stream    string
		wantError bool
	}{
		"before [DONE]": {sseHead + chunk(tokenEvent), true},
		"after [DONE]":  {sseHead + chunk(tokenEvent) + chunk("data: [DONE]\n\n"), false},
	} {
		t.Run(name, func(t *testing.T) {
			addr := rawVLLM(t, func(c net.Conn) { io.WriteString(c, tc.stream) })
			cfg := filepath.Join(t.TempDir(), "c.yaml")
			body := "listen: 127.0.0.1:0\nlog_level: error\nmodels:\n  - {name: m}\nbackends:\n  - {id: e, url: \"http://" + addr + "\"}\n"
			if err := os.WriteFile(cfg, []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
			p := startProxy(t, cfg)
			code, out := p.complete(t, true, 4)
			if code != 200 {
				t.Fatalf("status %d: %s", code, out)
			}
			if !strings.HasSuffix(out, "data: [DONE]\n\n") || strings.Count(out, "[DONE]") != 1 {
				t.Fatalf("stream does not end with one [DONE]:\n%s", out)
			}
			if got := strings.Contains(out, `"error"`); got != tc.wantError {
				t.Fatalf("error event %v, want %v:\n%s", got, tc.wantError, out)
			}
		})
	}
}

// Engines close keep-alive connections left idle (uvicorn, under vLLM and
// SGLang, after 5 s). Once they have, a request through kvproxy must still
// succeed, however many idle connections its pool held.
func TestEngineClosesIdleConnections(t *testing.T) {
	const n = 4
	arrived := make(chan struct{}, n)
	release := make(chan struct{})
	closed := make(chan struct{}, 64)
	srv := &http.Server{
		IdleTimeout: 100 * time.Millisecond,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost || !strings.HasPrefix(r.URL.Path, "/v1/") {
				return // not a completion: the probe, or the scrape listing /v1/models
			}
			select {
			case arrived <- struct{}{}:
				<-release
			default:
			}
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"stop"}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}`)
		}),
	}
	var mu sync.Mutex
	var completionConns = map[net.Conn]bool{}
	srv.ConnState = func(c net.Conn, s http.ConnState) {
		mu.Lock()
		defer mu.Unlock()
		if s == http.StateActive {
			completionConns[c] = true
		}
		if s == http.StateClosed && completionConns[c] {
			closed <- struct{}{}
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	defer srv.Close()
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	body := "listen: 127.0.0.1:0\nlog_level: error\nhealth: {interval: 1h}\nmodels:\n  - {name: m}\nbackends:\n  - {id: e, url: \"http://" + ln.Addr().String() + "\"}\n"
	if err := os.WriteFile(cfg, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if code, out := p.complete(t, false, 1); code != 200 {
				t.Errorf("status %d: %s", code, out)
			}
		}()
	}
	for i := 0; i < n; i++ {
		<-arrived // n requests, n connections
	}
	close(release)
	wg.Wait()
	for i := 0; i < n; i++ {
		<-closed // the engine closed them all, idle
	}
	for i := 0; i < 2; i++ {
		if code, out := p.complete(t, false, 1); code != 200 {
			t.Fatalf("request %d after the engine closed its idle connections: %d %s", i, code, out)
		}
	}
}
