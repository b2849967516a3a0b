package proxy

import (
	"bufio"
	"net"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// BenchmarkOverloadedQueue is an engine at its max_concurrency (4) with 256
// clients sending requests back to back, so about 250 wait in kvproxy's
// queue: what a freed slot costs (route-calls/op: Route calls per request,
// 1 when each slot wakes one waiter) and how evenly waiting is shared
// (p99-ms, max-ms: a request's whole time, about 250 × the engine's 1 ms
// answer when the queue is served in order).
func BenchmarkOverloadedQueue(b *testing.B) {
	e := startSlowCannedEngine(b, 0, time.Millisecond)
	s, addr := startBenchServer(b, e.ln.Addr().String(), ", max_concurrency: 4")
	body := `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Say hi to the whole wide world, please."}]}`
	req := []byte("POST /v1/chat/completions HTTP/1.1\r\nHost: kvproxy\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
	routes := func() uint64 {
		var m dto.Metric
		s.metrics.route.Write(&m)
		return m.GetHistogram().GetSampleCount()
	}
	var mu sync.Mutex
	var took []time.Duration
	routes0 := routes()
	b.SetParallelism(128)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Error(err)
			return
		}
		defer c.Close()
		br := bufio.NewReaderSize(c, 64<<10)
		var mine []time.Duration
		for pb.Next() {
			t0 := time.Now()
			if _, err := c.Write(req); err != nil {
				b.Error(err)
				return
			}
			if _, err := readHTTPMessage(br, nil); err != nil {
				b.Error(err)
				return
			}
			mine = append(mine, time.Since(t0))
		}
		mu.Lock()
		took = append(took, mine...)
		mu.Unlock()
	})
	b.StopTimer()
	b.ReportMetric(float64(routes()-routes0)/float64(b.N), "route-calls/op")
	if len(took) > 0 {
		slices.Sort(took)
		b.ReportMetric(float64(took[len(took)*99/100].Microseconds())/1000, "p99-ms")
		b.ReportMetric(float64(took[len(took)-1].Microseconds())/1000, "max-ms")
	}
}
