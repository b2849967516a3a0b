package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// row is one metric of one cell across the three configurations. A nil
// value is not applicable (the proxy CPU of direct) or not measured (nginx
// absent).
type row struct {
	Workload    string   `json:"workload"`
	Concurrency int      `json:"concurrency"`
	Metric      string   `json:"metric"`
	Unit        string   `json:"unit"`
	Better      string   `json:"better"` // "higher" or "lower"
	Direct      *float64 `json:"direct"`
	KVProxy     *float64 `json:"kvproxy"`
	Nginx       *float64 `json:"nginx"`
	// Ratios of kvproxy's value to direct's and to nginx's.
	KVProxyDirect *float64 `json:"kvproxy_direct"`
	KVProxyNginx  *float64 `json:"kvproxy_nginx"`
	// The floor proxy's value (plain fasthttp), kvproxy's ratio to it and
	// its ratio to nginx.
	Floor        *float64 `json:"fasthttp,omitempty"`
	KVProxyFloor *float64 `json:"kvproxy_fasthttp,omitempty"`
	FloorNginx   *float64 `json:"fasthttp_nginx,omitempty"`
	// With -eventloop: the event-loop proxy's value and its ratio to nginx.
	EventLoop      *float64 `json:"eventloop,omitempty"`
	EventLoopNginx *float64 `json:"eventloop_nginx,omitempty"`
	// With -kvproxy2: the second build's value and its ratio to kvproxy's.
	KVProxy2        *float64 `json:"kvproxy2,omitempty"`
	KVProxy2KVProxy *float64 `json:"kvproxy2_kvproxy,omitempty"`
}

type setupInfo struct {
	CPUs            int     `json:"cpus"`
	Rounds          int     `json:"rounds"`
	DurationS       float64 `json:"duration_s"`
	StreamTokens    int     `json:"stream_tokens"`
	NginxWorkers    int     `json:"nginx_workers"`
	EngineSpeedup   float64 `json:"engine_speedup"`
	KVProxyPolicy   string  `json:"kvproxy_policy"`
	KVProxyKVEvents string  `json:"kvproxy_kv_events"`
}

type report struct {
	Setup        setupInfo `json:"setup"`
	Results      []row     `json:"results"`
	hasKV2       bool
	hasFloor     bool
	hasEventLoop bool
}

func ptr(v float64) *float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return nil
	}
	return &v
}

// percentile is the q-quantile (0..1] of sorted latencies, in ms.
func percentile(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	i = max(0, min(i, len(sorted)-1))
	return float64(sorted[i]) / float64(time.Millisecond)
}

// cell is what the report knows of one cell: the samples of all rounds
// pooled (latencies, counts, CPU), and the median over rounds of the rates,
// which a burst of noise in one round moves less than a pooled rate.
type cell struct {
	sample
	reqRate, eventRate float64
}

func newCell(rounds []sample) *cell {
	c := &cell{}
	var reqs, evs []float64
	for _, r := range rounds {
		c.merge(r)
		reqs = append(reqs, float64(r.ok)/r.elapsed.Seconds())
		evs = append(evs, float64(r.events)/r.elapsed.Seconds())
	}
	slices.Sort(c.lat)
	c.reqRate, c.eventRate = median(reqs), median(evs)
	return c
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	slices.Sort(v)
	if n := len(v); n%2 == 0 {
		return (v[n/2-1] + v[n/2]) / 2
	}
	return v[len(v)/2]
}

// metric computes one value of a cell, NaN when not applicable; direct is
// the same cell measured without a proxy.
type metric struct {
	name, unit, better string
	workload           string // "" for both
	value              func(c, direct *cell, isDirect bool) float64
}

var metrics = []metric{
	{"throughput", "req/s", "higher", chat, func(c, _ *cell, _ bool) float64 { return c.reqRate }},
	{"latency_p50", "ms", "lower", chat, func(c, _ *cell, _ bool) float64 { return percentile(c.lat, 0.50) }},
	{"latency_p99", "ms", "lower", chat, func(c, _ *cell, _ bool) float64 { return percentile(c.lat, 0.99) }},
	{"added_p50", "ms", "lower", chat, added(0.50)},
	{"added_p99", "ms", "lower", chat, added(0.99)},
	{"cpu_per_request", "µs", "lower", chat, cpuPer(func(c *cell) float64 { return float64(c.ok) })},
	{"allocs_per_request", "allocs", "lower", chat, allocsPer(func(c *cell) float64 { return float64(c.ok) })},
	{"first_event_p50", "ms", "lower", stream, func(c, _ *cell, _ bool) float64 { return percentile(c.lat, 0.50) }},
	{"first_event_p99", "ms", "lower", stream, func(c, _ *cell, _ bool) float64 { return percentile(c.lat, 0.99) }},
	{"added_first_event_p50", "ms", "lower", stream, added(0.50)},
	{"added_first_event_p99", "ms", "lower", stream, added(0.99)},
	{"events", "events/s", "higher", stream, func(c, _ *cell, _ bool) float64 { return c.eventRate }},
	{"cpu_per_event", "µs", "lower", stream, cpuPer(func(c *cell) float64 { return float64(c.events) })},
	{"allocs_per_event", "allocs", "lower", stream, allocsPer(func(c *cell) float64 { return float64(c.events) })},
	{"errors", "count", "lower", "", func(c, _ *cell, _ bool) float64 { return float64(c.errors) }},
}

func added(q float64) func(c, direct *cell, isDirect bool) float64 {
	return func(c, direct *cell, isDirect bool) float64 {
		if isDirect || direct == nil {
			return math.NaN()
		}
		return percentile(c.lat, q) - percentile(direct.lat, q)
	}
}

func cpuPer(units func(*cell) float64) func(c, _ *cell, isDirect bool) float64 {
	return func(c, _ *cell, isDirect bool) float64 {
		if isDirect {
			return math.NaN()
		}
		return c.cpu / units(c) * 1e6
	}
}

// allocsPer is heap allocations per unit, where the target reports them
// (kvproxy: everything it allocated during the cell, per request or event).
func allocsPer(units func(*cell) float64) func(c, _ *cell, _ bool) float64 {
	return func(c, _ *cell, _ bool) float64 {
		if c.noMallocs {
			return math.NaN()
		}
		// Scrapes vary a little in cost: a cell with few allocations may
		// come out slightly below zero.
		return math.Max(0, float64(c.mallocs)/units(c))
	}
}

func buildReport(res results, o options, s *setup) report {
	rep := report{Setup: setupInfo{
		CPUs: runtime.NumCPU(), Rounds: o.rounds, DurationS: o.duration.Seconds(),
		StreamTokens: o.streamTokens, NginxWorkers: s.nginxWorkers, EngineSpeedup: o.speedup,
		KVProxyPolicy: "kv", KVProxyKVEvents: "zmq",
	}}
	cells := map[cellKey]*cell{}
	for k, rounds := range res {
		cells[k] = newCell(rounds)
	}
	for _, w := range o.workloads {
		for _, c := range o.conc {
			direct := cells[cellKey{w, c, "direct"}]
			for _, m := range metrics {
				if m.workload != "" && m.workload != w {
					continue
				}
				r := row{Workload: w, Concurrency: c, Metric: m.name, Unit: m.unit, Better: m.better}
				val := func(target string) *float64 {
					cl := cells[cellKey{w, c, target}]
					if cl == nil {
						return nil
					}
					return ptr(m.value(cl, direct, target == "direct"))
				}
				r.Direct, r.KVProxy, r.Nginx, r.KVProxy2 = val("direct"), val("kvproxy"), val("nginx"), val("kvproxy2")
				r.Floor, r.EventLoop = val("fasthttp"), val("eventloop")
				if m.name != "errors" && !strings.HasPrefix(m.name, "added") {
					// Ratios of differences (and of error counts) mislead.
					r.KVProxyDirect = ratio(r.KVProxy, r.Direct)
					r.KVProxyNginx = ratio(r.KVProxy, r.Nginx)
					r.KVProxy2KVProxy = ratio(r.KVProxy2, r.KVProxy)
					r.KVProxyFloor = ratio(r.KVProxy, r.Floor)
					r.FloorNginx = ratio(r.Floor, r.Nginx)
					r.EventLoopNginx = ratio(r.EventLoop, r.Nginx)
				}
				rep.hasFloor = rep.hasFloor || cells[cellKey{w, c, "fasthttp"}] != nil
				rep.hasEventLoop = rep.hasEventLoop || cells[cellKey{w, c, "eventloop"}] != nil
				rep.hasKV2 = rep.hasKV2 || cells[cellKey{w, c, "kvproxy2"}] != nil
				rep.Results = append(rep.Results, r)
			}
		}
	}
	return rep
}

func ratio(a, b *float64) *float64 {
	if a == nil || b == nil || *b == 0 {
		return nil
	}
	return ptr(*a / *b)
}

func writeJSON(w io.Writer, rep report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

func fmtVal(v *float64) string {
	if v == nil {
		return "-"
	}
	a := math.Abs(*v)
	switch {
	case a == 0:
		return "0"
	case a >= 1000:
		return strconv.FormatFloat(*v, 'f', 0, 64)
	case a >= 10:
		return strconv.FormatFloat(*v, 'f', 1, 64)
	case a >= 0.1:
		return strconv.FormatFloat(*v, 'f', 2, 64)
	default:
		return strconv.FormatFloat(*v, 'f', 3, 64)
	}
}

func fmtRatio(v *float64) string {
	if v == nil {
		return "-"
	}
	return strconv.FormatFloat(*v, 'f', 2, 64) + "×"
}

func writeTable(w io.Writer, rep report) {
	s := rep.Setup
	fmt.Fprintf(w, "kvproxy overhead: %d CPUs, %d rounds × %gs per cell, streams of %d tokens, nginx %d workers, engine kvmock -speedup %g; kvproxy policy %s, KV events %s\n\n",
		s.CPUs, s.Rounds, s.DurationS, s.StreamTokens, s.NginxWorkers, s.EngineSpeedup, s.KVProxyPolicy, s.KVProxyKVEvents)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	kv2Head, kv2Gap := "", ""
	if rep.hasFloor {
		kv2Head, kv2Gap = "fasthttp\tkvproxy/fasthttp\tfasthttp/nginx\t", "\t\t\t"
	}
	if rep.hasEventLoop {
		kv2Head, kv2Gap = kv2Head+"eventloop\teventloop/nginx\t", kv2Gap+"\t\t"
	}
	if rep.hasKV2 {
		kv2Head, kv2Gap = kv2Head+"kvproxy2\tkvproxy2/kvproxy\t", kv2Gap+"\t\t"
	}
	fmt.Fprintln(tw, "workload\tconc\tmetric\tunit\tdirect\tkvproxy\tnginx\tkvproxy/direct\tkvproxy/nginx\t"+kv2Head)
	prev := ""
	for _, r := range rep.Results {
		cell := r.Workload + strconv.Itoa(r.Concurrency)
		if prev != "" && cell != prev {
			fmt.Fprintln(tw, "\t\t\t\t\t\t\t\t\t"+kv2Gap)
		}
		prev = cell
		kv2 := ""
		if rep.hasFloor {
			kv2 = fmtVal(r.Floor) + "\t" + fmtRatio(r.KVProxyFloor) + "\t" + fmtRatio(r.FloorNginx) + "\t"
		}
		if rep.hasEventLoop {
			kv2 += fmtVal(r.EventLoop) + "\t" + fmtRatio(r.EventLoopNginx) + "\t"
		}
		if rep.hasKV2 {
			kv2 += fmtVal(r.KVProxy2) + "\t" + fmtRatio(r.KVProxy2KVProxy) + "\t"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Workload, r.Concurrency, r.Metric, r.Unit,
			fmtVal(r.Direct), fmtVal(r.KVProxy), fmtVal(r.Nginx), fmtRatio(r.KVProxyDirect), fmtRatio(r.KVProxyNginx), kv2)
	}
	tw.Flush()
}
