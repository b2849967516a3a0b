package proxy

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// midBodyEngine answers /v1/embeddings with a Content-Length body whose
// first part comes at once; input "stall" then waits for the request to be
// cancelled (counted in cancelled), anything else sends the rest.
func midBodyEngine(t *testing.T, cancelled *atomic.Int64) string {
	// The first part is larger than the client connection's write buffer:
	// a smaller one waits there for more (fasthttp flushes a sized body
	// when its buffer is full).
	head, rest := midBodyHead, `0.25]}]}`
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Input string }
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(head)+len(rest)))
		w.Write([]byte(head))
		w.(http.Flusher).Flush()
		if req.Input == "stall" {
			<-r.Context().Done()
			cancelled.Add(1)
			return
		}
		w.Write([]byte(rest))
	})
	return addr
}

var midBodyHead = `{"object":"list","data":[{"embedding":[` + strings.Repeat("0.5,", 16<<10)

// TestPassthroughMidBody: the ways a Content-Length answer can stop partway.
// A client leaving cancels the engine's answer without ejecting it; an
// engine silent past stream_idle_timeout mid-body cuts the client's answer
// short (never a shorter body taken for whole); a drain cut does too and
// ejects nothing. Every time the load is freed and the engine connection
// is not reused for the next request (which reads its own answer whole).
func TestPassthroughMidBody(t *testing.T) {
	var cancelled atomic.Int64
	addr := midBodyEngine(t, &cancelled)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m}]\n"+
		"limits: {stream_idle_timeout: 300ms}\n"+
		"health: {eject_base: 50ms, eject_max: 50ms}\n")
	whole := func(what string) {
		t.Helper()
		resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"x"}`)
		if resp.StatusCode != 200 || string(b) != midBodyHead+`0.25]}]}` {
			t.Fatalf("%s: %d %q", what, resp.StatusCode, b)
		}
		p.waitIdle(t)
	}
	whole("first")

	// The client leaves after the first bytes.
	c := startStall(t, p)
	c.Close()
	waitFor(t, "the engine's answer to be cancelled", func() bool { return cancelled.Load() == 1 })
	p.waitIdle(t)
	if ejected(p, "e0") {
		t.Fatal("a client leaving ejected the engine")
	}
	whole("after the client left")

	// The engine goes silent mid-body: the client's answer is cut short.
	body := `{"model":"m","input":"stall"}`
	resp, err := http.Post(p.url+"/v1/embeddings", "application/json", strings.NewReader(body))
	if err == nil {
		b, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		if rerr == nil {
			t.Fatalf("a body the engine left unfinished read as whole: %d %q", resp.StatusCode, b)
		}
	}
	p.waitIdle(t)
	waitFor(t, "the engine to see the cancel", func() bool { return cancelled.Load() == 2 })
	for ejected(p, "e0") {
		time.Sleep(5 * time.Millisecond)
	}
	whole("after the timeout")

	// A drain cut mid-body.
	c = startStall(t, p)
	p.s.Cut()
	if raw, err := io.ReadAll(c); err != nil || strings.HasSuffix(string(raw), `0.25]}]}`) {
		t.Fatalf("a cut answer read as whole: %v, %d bytes", err, len(raw))
	}
	c.Close()
	p.waitIdle(t)
	if ejected(p, "e0") {
		t.Fatal("a drain cut ejected the engine")
	}
	if !strings.Contains(p.logs.String(), `"status":503`) {
		t.Fatalf("the cut is not logged as a 503: %s", p.logs.String())
	}
}

// startStall sends a request the engine answers in part, and returns the
// client's connection once the first part has arrived.
func startStall(t *testing.T, p *testProxy) net.Conn {
	t.Helper()
	body := `{"model":"m","input":"stall"}`
	c := rawPost(t, p, "HTTP/1.1", "/v1/embeddings", body)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 4096)
	for got := 0; got < 8<<10; {
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("the first part did not come: %v after %d bytes", err, got)
		}
		got += n
	}
	return c
}

// TestPassthroughSizedHTTP10: an HTTP/1.0 client gets a Content-Length
// answer with its length, whole.
func TestPassthroughSizedHTTP10(t *testing.T) {
	var cancelled atomic.Int64
	addr := midBodyEngine(t, &cancelled)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m}]\n")
	body := `{"model":"m","input":"x"}`
	c := rawPost(t, p, "HTTP/1.0", "/v1/embeddings", body)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	raw, err := io.ReadAll(c)
	want := midBodyHead + `0.25]}]}`
	if err != nil || !strings.Contains(string(raw), "Content-Length: "+strconv.Itoa(len(want))) || !strings.HasSuffix(string(raw), "\r\n\r\n"+want) {
		t.Fatalf("HTTP/1.0: %v %q", err, raw)
	}
	p.waitIdle(t)
}
