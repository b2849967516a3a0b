package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// The workloads.
const (
	chat   = "chat"   // non-streaming, max_tokens 1
	stream = "stream" // SSE, ignore_eos
)

// maxPerWorker bounds the requests one client goroutine sends in one cell,
// on top of the cell's duration.
const maxPerWorker = 1 << 20

// sample is what one cell (workload, concurrency, target) measured in one
// round; samples of the same cell in different rounds are merged.
type sample struct {
	lat     []time.Duration // chat: request latency; stream: time to first event
	ok      int             // requests that completed correctly
	errors  int             // transport errors, non-200 answers, truncated streams
	events  int64           // stream: SSE data events received (including [DONE])
	elapsed time.Duration   // wall time of the cell
	cpu     float64         // CPU seconds of the target's processes (0 for direct)
	mallocs int64           // heap allocations of the target (kvproxy)
	// noMallocs: the target does not report allocations (or a scrape failed).
	noMallocs bool
}

func (s *sample) merge(o sample) {
	s.lat = append(s.lat, o.lat...)
	s.ok += o.ok
	s.errors += o.errors
	s.events += o.events
	s.elapsed += o.elapsed
	s.cpu += o.cpu
	s.mallocs += o.mallocs
	s.noMallocs = s.noMallocs || o.noMallocs
}

// cellKey names a cell.
type cellKey struct {
	workload string
	conc     int
	target   string
}

// results holds the samples of every cell, one per round.
type results map[cellKey][]sample

// load generates requests against one target.
type load struct {
	hc           *fasthttp.HostClient
	uri          string
	chatBodies   [][]byte // one per client goroutine
	streamBodies [][]byte
}

func newLoad(addr string, maxConc, streamTokens int) *load {
	l := &load{
		hc: &fasthttp.HostClient{
			Addr:                     addr,
			MaxConns:                 maxConc + 16,
			ReadTimeout:              30 * time.Second,
			WriteTimeout:             10 * time.Second,
			MaxIdleConnDuration:      time.Minute,
			NoDefaultUserAgentHeader: true,
		},
		uri: "http://" + addr + "/v1/chat/completions",
	}
	for i := 0; i < maxConc; i++ {
		// A different short prompt per client, so the router hashes and
		// looks up real blocks (and the engine's prefix cache sees reuse
		// within a client, as chat traffic does).
		msg := fmt.Sprintf("You are client %d of a benchmark. Answer in one short sentence: what is the capital of France, and why is it famous?", i)
		l.chatBodies = append(l.chatBodies, fmt.Appendf(nil,
			`{"model":%q,"max_tokens":1,"messages":[{"role":"user","content":%q}]}`, benchModel, msg))
		l.streamBodies = append(l.streamBodies, fmt.Appendf(nil,
			`{"model":%q,"stream":true,"max_tokens":%d,"ignore_eos":true,"messages":[{"role":"user","content":%q}]}`,
			benchModel, streamTokens, msg))
	}
	return l
}

// run drives conc client goroutines, each sending requests back to back
// until d has passed, and returns what they measured.
func (l *load) run(ctx context.Context, workload string, conc int, d time.Duration) sample {
	start := time.Now()
	deadline := start.Add(d)
	parts := make([]sample, conc)
	var wg sync.WaitGroup
	for i := 0; i < conc; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if workload == chat {
				parts[i] = l.chatLoop(ctx, l.chatBodies[i], deadline)
			} else {
				parts[i] = l.streamLoop(ctx, l.streamBodies[i], deadline)
			}
		}(i)
	}
	wg.Wait()
	var s sample
	for _, p := range parts {
		s.merge(p)
	}
	s.elapsed = time.Since(start)
	return s
}

var choicesKey = []byte(`"choices"`)

func (l *load) newRequest(body []byte) *fasthttp.Request {
	req := fasthttp.AcquireRequest()
	req.SetRequestURI(l.uri)
	req.Header.SetMethod(fasthttp.MethodPost)
	req.Header.SetContentType("application/json")
	req.SetBodyRaw(body)
	return req
}

func (l *load) chatLoop(ctx context.Context, body []byte, deadline time.Time) sample {
	var s sample
	req := l.newRequest(body)
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	for n := 0; n < maxPerWorker && ctx.Err() == nil; n++ {
		t0 := time.Now()
		if !t0.Before(deadline) {
			break
		}
		err := l.hc.Do(req, resp)
		if err != nil || resp.StatusCode() != 200 || !bytes.Contains(resp.Body(), choicesKey) {
			s.errors++
			continue
		}
		s.lat = append(s.lat, time.Since(t0))
		s.ok++
	}
	return s
}

var (
	dataPrefix = []byte("data:")
	doneData   = []byte("[DONE]")
)

func (l *load) streamLoop(ctx context.Context, body []byte, deadline time.Time) sample {
	var s sample
	req := l.newRequest(body)
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	br := bufio.NewReaderSize(nil, 16<<10)
	for n := 0; n < maxPerWorker && ctx.Err() == nil; n++ {
		t0 := time.Now()
		if !t0.Before(deadline) {
			break
		}
		resp.StreamBody = true
		if err := l.hc.Do(req, resp); err != nil || resp.StatusCode() != 200 {
			s.errors++
			continue
		}
		br.Reset(resp.BodyStream())
		events, done := int64(0), false
		var err error
		for {
			var line []byte
			line, err = br.ReadSlice('\n')
			if len(line) > 0 && bytes.HasPrefix(line, dataPrefix) {
				if events == 0 {
					s.lat = append(s.lat, time.Since(t0))
				}
				events++
				if bytes.Equal(bytes.TrimSpace(line[len(dataPrefix):]), doneData) {
					done = true
				}
			}
			if err != nil {
				break
			}
		}
		resp.CloseBodyStream()
		s.events += events
		if done && errors.Is(err, io.EOF) {
			s.ok++
		} else {
			s.errors++
		}
	}
	return s
}

// measure runs the warm-up and then every round: for each workload and
// concurrency, every target once, in an order rotated each round.
func measure(ctx context.Context, s *setup, o options, logf func(string, ...any)) (results, error) {
	maxConc := 0
	for _, c := range o.conc {
		maxConc = max(maxConc, c)
	}
	loads := make([]*load, len(s.targets))
	for i, t := range s.targets {
		loads[i] = newLoad(t.addr, maxConc, o.streamTokens)
	}
	warm := min(o.duration/2, 500*time.Millisecond)
	for i, t := range s.targets {
		for _, w := range o.workloads {
			// At the highest concurrency, so every connection exists
			// before measuring.
			if ws := loads[i].run(ctx, w, maxConc, warm); ws.ok == 0 {
				return nil, fmt.Errorf("warm-up of %s against %s: no request succeeded (%d errors)", w, t.name, ws.errors)
			}
		}
	}
	cells := len(o.conc) * len(o.workloads) * len(s.targets)
	logf("%d rounds of %d cells of %v: about %v", o.rounds, cells, o.duration,
		(time.Duration(o.rounds*cells) * o.duration).Round(time.Second))
	// What reading the allocation counter allocates itself, to subtract.
	scrapeCost := map[string]uint64{}
	for _, t := range s.targets {
		if t.mallocs == nil {
			continue
		}
		a, err1 := t.mallocs()
		b, err2 := t.mallocs()
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("%s: %w", t.name, err)
		}
		scrapeCost[t.name] = b - a
	}
	res := results{}
	for r := 0; r < o.rounds; r++ {
		for _, w := range o.workloads {
			for _, c := range o.conc {
				for k := range s.targets {
					i := (k + r) % len(s.targets)
					t := s.targets[i]
					pids := t.pids()
					var m0 uint64
					if t.mallocs != nil {
						m0, _ = t.mallocs()
					}
					cpu0 := cpuSeconds(pids)
					smp := loads[i].run(ctx, w, c, o.duration)
					smp.cpu = cpuSeconds(pids) - cpu0
					smp.noMallocs = true
					if t.mallocs != nil {
						if m1, err := t.mallocs(); err == nil && m0 > 0 {
							smp.mallocs = int64(m1-m0) - int64(scrapeCost[t.name])
							smp.noMallocs = false
						}
					}
					if ctx.Err() != nil {
						return nil, ctx.Err()
					}
					key := cellKey{w, c, t.name}
					res[key] = append(res[key], smp)
				}
			}
		}
		logf("round %d of %d done", r+1, o.rounds)
	}
	return res, nil
}
