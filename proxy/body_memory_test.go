package proxy

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	rtmetrics "runtime/metrics"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// bodyLimitYAML: an 8 MiB body limit, a tenant capped at one request in
// flight and one without a cap.
const bodyLimitYAML = `
models: [{name: m, block_size: 16}]
backends: [{id: e0, url: 'http://{{e0}}', model: m}]
auth:
  keys: [{key: key-capped-123, tenant: capped}, {key: key-free-45678, tenant: free}]
tenants: [{name: capped, max_concurrency: 1}]
limits: {max_request_body_bytes: 8388608}
`

// heapPeak samples the heap's bytes in objects (live and not yet
// collected) every millisecond until stop is called, which returns the
// highest seen.
func heapPeak() (stop func() uint64) {
	var peak atomic.Uint64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		s := []rtmetrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
		for {
			rtmetrics.Read(s)
			if v := s[0].Value.Uint64(); v > peak.Load() {
				peak.Store(v)
			}
			select {
			case <-done:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	return func() uint64 {
		close(done)
		wg.Wait()
		return peak.Load()
	}
}

func heapNow() uint64 {
	s := []rtmetrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	rtmetrics.Read(s)
	return s[0].Value.Uint64()
}

// A compressed body is decoded after the tenant's concurrency slot is
// taken, into a buffer that stops at the limit: six small brotli bombs at
// once from a tenant with max_concurrency 1 are one 413 and five 429s
// (decoded before the slot was taken, all six were 413s, decoded at once),
// and the heap grows by the buffers one decode grew through, about two
// limits, not yet collected (fasthttp's doubled past the limit: five).
func TestCompressedBombsWaitForTheTenantsSlot(t *testing.T) {
	p := startProxyYAML(t, bodyLimitYAML, startFake(t, "e0", nil))
	const limit = 8 << 20
	bomb := fasthttp.AppendBrotliBytes(nil, []byte(`{"model":"m","prompt":"`+strings.Repeat("a", limit)+`"}`))
	if len(bomb) > 2048 {
		t.Fatalf("the bomb is %d bytes", len(bomb))
	}
	head := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-capped-123\r\n"+
		"Content-Type: application/json\r\nContent-Encoding: br\r\nContent-Length: %d\r\n\r\n", len(bomb))
	const n = 6
	conns := make([]net.Conn, n)
	for i := range conns {
		c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		// All but the last byte: the requests complete together below.
		if _, err := c.Write(append([]byte(head), bomb[:len(bomb)-1]...)); err != nil {
			t.Fatal(err)
		}
		conns[i] = c
	}
	time.Sleep(100 * time.Millisecond) // their headers and bodies are in
	base := heapNow()
	stop := heapPeak()
	for _, c := range conns {
		c.Write(bomb[len(bomb)-1:])
	}
	statuses := map[int]int{}
	for _, c := range conns {
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		statuses[resp.StatusCode]++
	}
	peak := stop()
	if statuses[413] < 1 || statuses[429] < 1 || statuses[413]+statuses[429] != n {
		t.Fatalf("six bombs at once from a tenant with max_concurrency 1: %v, want 413s and 429s", statuses)
	}
	// One decode at a time: the buffers it grew through (about two
	// limits, not yet collected) and the decoder's window.
	if grew := int64(peak) - int64(base); grew > 4*limit {
		t.Fatalf("the heap grew by %d MB decoding bombs one at a time (answers %v)", grew>>20, statuses)
	}
	t.Logf("answers %v, heap peak +%d MB", statuses, (int64(peak)-int64(base))>>20)
	p.waitIdle(t)
}
