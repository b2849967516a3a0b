package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// testUpstream serves a JSON answer on /json, three SSE events on /sse, 320 KB
// on /big and 200 on /health.
func testUpstream(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		switch string(ctx.Path()) {
		case "/health":
			ctx.SetBodyString("ok")
		case "/big":
			ctx.SetBody(bytes.Repeat([]byte("0123456789abcdef"), 20000)) // 320 KB: many reads, a full socket buffer
		case "/json":
			ctx.SetContentType("application/json")
			ctx.SetBody(append([]byte(`{"echo":`), append(ctx.PostBody(), '}')...))
		case "/sse":
			ctx.SetContentType("text/event-stream")
			ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
				for _, ev := range []string{"data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"} {
					w.WriteString(ev)
					w.Flush()
					time.Sleep(5 * time.Millisecond)
				}
			})
		default:
			ctx.SetStatusCode(404)
		}
	}}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Shutdown() })
	return ln.Addr().String()
}

// startFloorProc builds kvoverhead and runs it as a floor proxy (command)
// in front of upstream, a process of its own as the benchmark runs it; it
// returns the proxy's base URL.
func startFloorProc(t *testing.T, command, upstream string) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds kvoverhead")
	}
	bin := filepath.Join(t.TempDir(), "kvoverhead")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	listen, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	p, err := startProc(command, bin, command, listen, upstream)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.stop)
	if err := waitHTTP(context.Background(), p, "http://"+listen+"/health"); err != nil {
		t.Fatal(err)
	}
	return "http://" + listen
}

// checkRelays checks that the proxy at base relays what testUpstream sends.
func checkRelays(t *testing.T, base string) {
	t.Helper()
	resp, err := http.Post(base+"/json", "application/json", strings.NewReader(`[1,2]`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != `{"echo":[1,2]}` || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("json: %d %q %q", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}

	resp, err = http.Get(base + "/sse")
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" || string(b) != "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n" {
		t.Fatalf("sse: %q %q", resp.Header.Get("Content-Type"), b)
	}

	resp, err = http.Get(base + "/nothing")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 404 {
		t.Fatalf("upstream's 404 came back as %d", resp.StatusCode)
	}

	resp, err = http.Get(base + "/big")
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := bytes.Repeat([]byte("0123456789abcdef"), 20000); !bytes.Equal(b, want) {
		t.Fatalf("big: %d bytes, want %d", len(b), len(want))
	}
}

// TestFloorProxyProcess runs kvoverhead as the fasthttp floor proxy.
func TestFloorProxyProcess(t *testing.T) {
	base := startFloorProc(t, floorCommand, testUpstream(t))
	checkRelays(t, base)
	if n, err := scrapeMallocs(base + "/metrics"); err != nil || n == 0 {
		t.Fatalf("mallocs %d, %v", n, err)
	}
}

func TestFloorProxyWithoutUpstreamAnswers502(t *testing.T) {
	dead, err := freePort() // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	var ctx fasthttp.RequestCtx
	ctx.Request.SetRequestURI("/v1/chat/completions")
	ctx.Request.Header.SetMethod("POST")
	floorHandler(dead)(&ctx)
	if ctx.Response.StatusCode() != fasthttp.StatusBadGateway {
		t.Fatalf("status %d, want 502", ctx.Response.StatusCode())
	}
}
