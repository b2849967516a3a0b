package main

import (
	"errors"
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"
	"path/filepath"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// chartMetrics are the metrics drawn, as kvproxy/nginx ratios.
var chartMetrics = []struct{ workload, metric, label string }{
	{chat, "throughput", "chat req/s"},
	{chat, "latency_p50", "chat p50"},
	{chat, "latency_p99", "chat p99"},
	{chat, "cpu_per_request", "CPU/req"},
	{stream, "first_event_p50", "1st event p50"},
	{stream, "first_event_p99", "1st event p99"},
	{stream, "events", "events/s"},
	{stream, "cpu_per_event", "CPU/event"},
}

var (
	colBetter = color.RGBA{0x2c, 0xa0, 0x2c, 0xff}
	colWorse  = color.RGBA{0xd6, 0x27, 0x28, 0xff}
	colGrid   = color.RGBA{0xcc, 0xcc, 0xcc, 0xff}
	colFloor  = color.RGBA{0x99, 0x99, 0x99, 0xff}
	colLoop   = color.RGBA{0x1f, 0x77, 0xb4, 0xff}
	colText   = color.Black
)

// part is one bar of a slot: a ratio and its colour.
type part struct {
	v *float64
	c color.Color
}

// writeChart draws kvproxy's value over nginx's for each metric and
// concurrency as bars around 1 (green where kvproxy is better, red where
// worse), on a log scale, into path.
func writeChart(path string, rep report) error {
	type bar struct {
		label  string
		v      float64
		better bool
		floor  *float64 // the plain fasthttp proxy's ratio to nginx, if measured
		loop   *float64 // the event-loop proxy's ratio to nginx, if measured
	}
	var groups [][]bar
	var names []string
	for _, cm := range chartMetrics {
		var g []bar
		for _, r := range rep.Results {
			if r.Workload != cm.workload || r.Metric != cm.metric || r.KVProxyNginx == nil {
				continue
			}
			v := *r.KVProxyNginx
			better := v <= 1
			if r.Better == "higher" {
				better = v >= 1
			}
			g = append(g, bar{fmt.Sprint(r.Concurrency), v, better, r.FloorNginx, r.EventLoopNginx})
		}
		if len(g) > 0 {
			groups = append(groups, g)
			names = append(names, cm.label)
		}
	}
	floor, loop := false, false
	for _, g := range groups {
		for _, b := range g {
			floor = floor || b.floor != nil
			loop = loop || b.loop != nil
		}
	}
	if len(groups) == 0 {
		return errors.New("no kvproxy/nginx ratios to draw (nginx absent?)")
	}

	const w, h = 1000, 480
	left, top, right, bott := 70, 50, w-20, h-70
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	draw.Draw(img, img.Bounds(), image.White, image.Point{}, draw.Src)
	text := func(x, y int, s string) {
		d := font.Drawer{Dst: img, Src: image.NewUniform(colText), Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
		d.DrawString(s)
	}
	rect := func(x0, y0, x1, y1 int, c color.Color) {
		if y0 > y1 {
			y0, y1 = y1, y0
		}
		draw.Draw(img, image.Rect(x0, y0, x1, y1), image.NewUniform(c), image.Point{}, draw.Src)
	}
	// Log2 axis from 1/4 to 4.
	const lo, hi = -2.0, 2.0
	y := func(v float64) int {
		l := math.Max(lo, math.Min(hi, math.Log2(v)))
		return bott - int((l-lo)/(hi-lo)*float64(bott-top))
	}
	for _, t := range []float64{0.25, 0.5, 1, 2, 4} {
		rect(left, y(t), right, y(t)+1, colGrid)
		text(left-40, y(t)+4, fmt.Sprintf("%gx", t))
	}
	rect(left, y(1)-1, right, y(1)+1, colText)
	text(left, 20, "kvproxy / nginx per metric and concurrency (log scale; green: kvproxy better, red: worse)")
	text(left, 36, fmt.Sprintf("%d CPUs, loopback, %d rounds x %gs, streams of %d tokens, engine speedup %g",
		rep.Setup.CPUs, rep.Setup.Rounds, rep.Setup.DurationS, rep.Setup.StreamTokens, rep.Setup.EngineSpeedup))

	gw := (right - left) / len(groups)
	for gi, g := range groups {
		x0 := left + gi*gw
		bw := (gw - 20) / len(g)
		for bi, b := range g {
			bx := x0 + 10 + bi*bw
			c := colWorse
			if b.better {
				c = colBetter
			}
			// kvproxy's bar, then the floors' beside it, sharing the slot.
			parts := []part{{&b.v, c}}
			if b.floor != nil {
				parts = append(parts, part{b.floor, colFloor})
			}
			if b.loop != nil {
				parts = append(parts, part{b.loop, colLoop})
			}
			pw := (bw - 4) / len(parts)
			for i, pt := range parts {
				rect(bx+2+i*pw, y(1), bx+2+(i+1)*pw-1, y(*pt.v), pt.c)
			}
			text(bx+bw/2-3*len(b.label), bott+14, b.label)
		}
		text(x0+gw/2-7*len(names[gi])/2, bott+32, names[gi])
	}
	legend := "bars labelled by concurrency"
	if floor {
		legend += "; grey: plain fasthttp proxy (kvproxy's floor)"
	}
	if loop {
		legend += "; blue: Go on its own epoll loop"
	}
	if floor || loop {
		legend += ", each / nginx"
	}
	text(left, bott+52, legend)

	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
