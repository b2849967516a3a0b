package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"

	"github.com/valyala/fasthttp"
)

// The hidden first arguments that make kvoverhead run as a floor proxy
// instead of measuring: kvoverhead floor-proxy LISTEN UPSTREAM (plain
// fasthttp), kvoverhead eventloop-proxy LISTEN UPSTREAM (Go on its own
// epoll loop, Linux only).
const (
	floorCommand     = "floor-proxy"
	eventLoopCommand = "eventloop-proxy"
)

// serveFloor runs the floor of kvproxy's stack: a plain fasthttp reverse
// proxy with no parsing, routing, metrics or logging: the request goes to
// the upstream as it came, the answer comes back as it left, SSE bodies
// relayed read by read with a flush after each (fasthttp's own
// streaming). What kvproxy costs above it is its own work; what this costs
// above nginx is Go's runtime and fasthttp. It answers /health and serves
// go_memstats_mallocs_total on /metrics itself.
func serveFloor(listen, upstream string) error {
	fmt.Printf("listening on http://%s\n", listen)
	return fasthttp.ListenAndServe(listen, floorHandler(upstream))
}

func floorHandler(upstream string) fasthttp.RequestHandler {
	hc := &fasthttp.HostClient{Addr: upstream, MaxConns: 4096, StreamResponseBody: true}
	return func(ctx *fasthttp.RequestCtx) {
		switch string(ctx.Path()) {
		case "/health":
			ctx.SetBodyString("ok")
			return
		case "/metrics":
			var m runtime.MemStats
			runtime.ReadMemStats(&m)
			fmt.Fprintf(ctx, "# floor proxy\ngo_memstats_mallocs_total %d\n", m.Mallocs)
			return
		}
		resp := fasthttp.AcquireResponse()
		if err := hc.Do(&ctx.Request, resp); err != nil {
			fasthttp.ReleaseResponse(resp)
			ctx.Error(err.Error(), fasthttp.StatusBadGateway)
			return
		}
		resp.Header.CopyTo(&ctx.Response.Header)
		if string(resp.Header.ContentType()) != "text/event-stream" {
			ctx.SetBody(resp.Body())
			resp.CloseBodyStream()
			fasthttp.ReleaseResponse(resp)
			return
		}
		body := resp.BodyStream()
		ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
			defer fasthttp.ReleaseResponse(resp)
			defer resp.CloseBodyStream()
			buf := make([]byte, 16<<10)
			for {
				n, err := body.Read(buf)
				if n > 0 {
					if _, werr := w.Write(buf[:n]); werr != nil || w.Flush() != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		})
	}
}

// startFloor starts this binary again as a floor proxy in front of the
// engine: as target "fasthttp" (command floorCommand) or "eventloop"
// (eventLoopCommand, which forwards every path, so it has no allocation
// counter of its own to scrape).
func (s *setup) startFloor(ctx context.Context, name, command, engineAddr string, logf func(string, ...any)) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	listen, err := freePort()
	if err != nil {
		return err
	}
	fp, err := startProc(name, self, command, listen, engineAddr)
	if err != nil {
		return err
	}
	s.proxies = append(s.proxies, fp)
	if err := waitHTTP(ctx, fp, "http://"+listen+"/health"); err != nil {
		return err
	}
	pid := fp.cmd.Process.Pid
	t := target{name: name, addr: listen, pids: func() []int { return []int{pid} }}
	if command == floorCommand {
		metricsURL := "http://" + listen + "/metrics"
		t.mallocs = func() (uint64, error) { return scrapeMallocs(metricsURL) }
	}
	s.targets = append(s.targets, t)
	logf("%s floor proxy on %s (pid %d)", name, listen, pid)
	return nil
}
