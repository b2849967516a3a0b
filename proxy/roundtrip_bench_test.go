package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
)

// cannedEngine is an engine that costs next to nothing: it reads each request
// on a keep-alive connection and answers with fixed bytes, so a round-trip
// benchmark's profile is the proxy's.
type cannedEngine struct {
	ln           net.Listener
	whole, sse   []byte
	streamMarker []byte
	delay        time.Duration // before each answer
}

func startCannedEngine(b *testing.B, events int) *cannedEngine {
	return startSlowCannedEngine(b, events, 0)
}

// startSlowCannedEngine starts a canned engine that takes delay to answer.
func startSlowCannedEngine(b *testing.B, events int, delay time.Duration) *cannedEngine {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	body := `{"id":"cmpl-1","object":"chat.completion","created":1,"model":"engine-m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":20,"completion_tokens":1,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":16}}}`
	e := &cannedEngine{ln: ln, streamMarker: []byte(`"stream":true`), delay: delay}
	e.whole = []byte("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body)
	var sse bytes.Buffer
	sse.WriteString("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
	for i := 0; i < events; i++ {
		ev := fmt.Sprintf(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"engine-m","choices":[{"index":0,"delta":{"content":" tok%d"},"logprobs":null,"finish_reason":null}]}`+"\n\n", i)
		fmt.Fprintf(&sse, "%x\r\n%s\r\n", len(ev), ev)
	}
	fmt.Fprintf(&sse, "%x\r\n%s\r\n0\r\n\r\n", len("data: [DONE]\n\n"), "data: [DONE]\n\n")
	e.sse = sse.Bytes()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go e.serve(c)
		}
	}()
	b.Cleanup(func() { ln.Close() })
	return e
}

func (e *cannedEngine) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReaderSize(c, 64<<10)
	var body []byte
	for {
		var err error
		body, err = readHTTPMessage(br, body)
		if err != nil {
			return
		}
		time.Sleep(e.delay)
		answer := e.whole
		if bytes.Contains(body, e.streamMarker) {
			answer = e.sse
		}
		if _, err := c.Write(answer); err != nil {
			return
		}
	}
}

// readHTTPMessage reads one HTTP/1.1 message (headers, then a Content-Length
// or chunked body) and returns its body.
func readHTTPMessage(br *bufio.Reader, buf []byte) ([]byte, error) {
	length, chunked := 0, false
	for {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return nil, err
		}
		if len(line) <= 2 {
			break
		}
		k, v, _ := bytes.Cut(bytes.TrimSpace(line), []byte(":"))
		v = bytes.TrimSpace(v)
		switch {
		case bytes.EqualFold(k, []byte("content-length")):
			length = atoi(v)
		case bytes.EqualFold(k, []byte("transfer-encoding")):
			chunked = bytes.EqualFold(v, []byte("chunked"))
		}
	}
	if !chunked {
		body := slices.Grow(buf[:0], length)[:length]
		_, err := io.ReadFull(br, body)
		return body, err
	}
	body := buf[:0]
	for {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return nil, err
		}
		n, err := strconv.ParseInt(string(bytes.TrimSpace(line)), 16, 64)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			_, err := br.Discard(2)
			return body, err
		}
		start := len(body)
		body = append(body, make([]byte, n+2)...)
		if _, err := io.ReadFull(br, body[start:]); err != nil {
			return nil, err
		}
		body = body[:start+int(n)]
	}
}

func atoi(b []byte) int {
	n := 0
	for _, c := range b {
		n = n*10 + int(c-'0')
	}
	return n
}

func startBenchProxy(b *testing.B, engine string) string {
	_, addr := startBenchServer(b, engine, "")
	return addr
}

// startBenchServer serves a proxy in front of engine, with more (YAML) in
// its backend's settings.
func startBenchServer(b *testing.B, engine, more string) (*Server, string) {
	cfg, err := config.Parse([]byte("models:\n  - {name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}\n" +
		"backends:\n  - {id: e0, url: 'http://" + engine + "', model: m, served_model: engine-m" + more + "}\n" +
		"router: {policy: kv}\nlog_level: warn\n"))
	if err != nil {
		b.Fatal(err)
	}
	s, err := New(cfg, Options{Logger: zerolog.Nop(), DisableHealthChecks: true})
	if err != nil {
		b.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go s.Serve(ln)
	b.Cleanup(func() { s.Shutdown() })
	return s, ln.Addr().String()
}

// benchRoundTrips sends body over keep-alive connections (parallelism × GOMAXPROCS
// of them) to the proxy in front of a canned engine and checks every answer.
func benchRoundTrips(b *testing.B, stream bool, events int) {
	e := startCannedEngine(b, events)
	addr := startBenchProxy(b, e.ln.Addr().String())
	body := `{"model":"m","max_tokens":1,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hi to the whole wide world, please."}]}`
	want := []byte(`"cached_tokens":16`)
	if stream {
		body = `{"model":"m","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"Say hi to the whole wide world, please."}]}`
		want = []byte("data: [DONE]")
	}
	roundTrips(b, addr, "/v1/chat/completions", body, want)
	if stream {
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*events), "ns/event")
	}
}

// roundTrips sends body to path over keep-alive connections (parallelism ×
// GOMAXPROCS of them) and checks that every answer holds want.
func roundTrips(b *testing.B, addr, path, body string, want []byte) {
	req := []byte("POST " + path + " HTTP/1.1\r\nHost: kvproxy\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
	b.ReportAllocs()
	b.SetParallelism(8)
	cpu0 := processCPU()
	b.RunParallel(func(pb *testing.PB) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Error(err)
			return
		}
		defer c.Close()
		br := bufio.NewReaderSize(c, 64<<10)
		var got []byte
		for pb.Next() {
			if _, err := c.Write(req); err != nil {
				b.Error(err)
				return
			}
			var err error
			got, err = readHTTPMessage(br, got)
			if err != nil {
				b.Error(err)
				return
			}
			if !bytes.Contains(got, want) {
				b.Errorf("answer without %s: %.200s", want, got)
				return
			}
		}
	})
	if cpu1 := processCPU(); cpu0 >= 0 && cpu1 >= 0 {
		// The whole process's CPU: proxy, client and engine. It stays
		// comparable on a busy machine, where ns/op does not.
		b.ReportMetric(float64(cpu1-cpu0)/float64(b.N), "cpu-ns/op")
	}
}

// BenchmarkProxyChat is a whole non-streaming request through the proxy over
// loopback: parse, tokenize, hash, route, forward, relay, log. The client and
// the canned engine run in the same process, so ns/op is an upper bound of
// the proxy's own cost; compare runs, not absolute numbers.
func BenchmarkProxyChat(b *testing.B) { benchRoundTrips(b, false, 0) }

// BenchmarkProxyStream is a streamed request of 64 events through the proxy.
func BenchmarkProxyStream(b *testing.B) { benchRoundTrips(b, true, 64) }

// BenchmarkProxyEmbeddings is a pass-through request (its answer relayed as
// it arrives, unread) through the proxy.
func BenchmarkProxyEmbeddings(b *testing.B) {
	e := startCannedEngine(b, 0)
	addr := startBenchProxy(b, e.ln.Addr().String())
	roundTrips(b, addr, "/v1/embeddings", `{"model":"m","input":"Say hi to the whole wide world, please."}`, []byte(`"cached_tokens":16`))
}

// BenchmarkProxyLargeBody is a pass-through request with a body past
// fasthttp's prefetch, which kvproxy reads itself into a pooled array of
// its size class: B/op shows whether the arrays come back to the pool.
func BenchmarkProxyLargeBody(b *testing.B) {
	for _, size := range []int{20 << 10, 200 << 10, 900 << 10} {
		b.Run(fmt.Sprint(size>>10, "KiB"), func(b *testing.B) {
			e := startCannedEngine(b, 0)
			addr := startBenchProxy(b, e.ln.Addr().String())
			body := `{"model":"m","input":"` + strings.Repeat("w", size) + `"}`
			roundTrips(b, addr, "/v1/embeddings", body, []byte(`"cached_tokens":16`))
		})
	}
}
