package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
)

// SIGTERM right after start: Shutdown runs while Serve is starting (-race).
func TestShutdownRacingServe(t *testing.T) {
	cfg, err := config.Parse([]byte("models:\n  - name: m\nbackends:\n  - {id: a, url: \"http://127.0.0.1:1\"}\n"))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		s, err := New(cfg, Options{Logger: zerolog.Nop()})
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- s.Serve(ln) }()
		s.Shutdown()
		ln.Close()
		<-served
	}
}

// A client that pipelines a second request behind one in flight when the
// drain begins gets the first answer whole, marked Connection: close (the
// second is never read; the client sends it again elsewhere). fasthttp
// holds an answer unflushed while a pipelined request waits, and dropped
// it when it stopped: the client got nothing (the chaos trial).
func TestDrainAnswersAPipelinedConnection(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 300 * time.Millisecond })
	p := startProxy(t, "kv", e)
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	req := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
	if _, err := c.Write([]byte(req + req)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the first request at the engine", func() bool { return e.requests.Load() == 1 })
	go p.s.Shutdown()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no answer to the first request: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 || !resp.Close || !strings.Contains(string(b), `"choices"`) {
		t.Fatalf("first answer: %d close=%v %v %s", resp.StatusCode, resp.Close, err, b)
	}
}
