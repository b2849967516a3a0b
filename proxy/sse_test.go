package proxy

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/router"
)

// burstBody is an engine stream that arrives in bursts: Read returns at most
// step bytes, and Buffered reports what a burst still holds.
type burstBody struct {
	data        []byte
	step, burst int // bytes per Read, bytes per burst
	inBurst     int
	closed      bool
}

func (b *burstBody) Read(p []byte) (int, error) {
	if len(b.data) == 0 {
		return 0, io.EOF
	}
	n := min(len(p), b.step, len(b.data))
	copy(p, b.data[:n])
	b.data = b.data[n:]
	b.inBurst += n
	if b.inBurst >= b.burst {
		b.inBurst = 0
	}
	return n, nil
}

func (b *burstBody) Buffered() int {
	if b.inBurst == 0 {
		return 0 // the burst is over: the next Read would wait
	}
	return min(len(b.data), b.burst-b.inBurst)
}

func (b *burstBody) Close()              { b.closed = true }
func (b *burstBody) EndBy(time.Duration) {}

// chunkRecorder records each Write, as fasthttp sends each as one chunk.
type chunkRecorder struct{ chunks [][]byte }

func (c *chunkRecorder) Write(p []byte) (int, error) {
	c.chunks = append(c.chunks, bytes.Clone(p))
	return len(p), nil
}

func relayFixture(t testing.TB) (*Server, *modelPool, *backend) {
	t.Helper()
	cfg, err := config.Parse([]byte("models: [{name: m, block_size: 4}]\nbackends: [{id: e0, url: 'http://127.0.0.1:1'}]\nlog_level: warn\n"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(cfg, Options{Logger: zerolog.Nop(), DisableHealthChecks: true})
	if err != nil {
		t.Fatal(err)
	}
	st := s.st.Load()
	return s, st.pools[0], st.backends["e0"]
}

func sseEvents(n int) []byte {
	var b bytes.Buffer
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "data: {\"choices\":[{\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
	}
	b.WriteString("data: [DONE]\n\n")
	return b.Bytes()
}

func startRelay(t *testing.T, s *Server, p *modelPool, be *backend, body streamBody) (*relay, *exchange) {
	t.Helper()
	_, active, err := p.rt.Route(&router.Request{PromptTokens: 10})
	if err != nil {
		t.Fatal(err)
	}
	x := &exchange{s: s, p: p, b: be, active: active, stream: true, usage: tokenUsage{-1, -1, -1}, status: 200}
	x.ab = &backends.Abort{}
	s.live.add(x)
	return newRelay(x, body, fasthttp.AcquireResponse()), x
}

// Events that arrive in one burst leave in one chunk; every event arrives
// intact, in order, and the slot is freed once, when fasthttp closes the body.
func TestRelayBatchesBurstsIntoChunks(t *testing.T) {
	s, p, be := relayFixture(t)
	raw := sseEvents(20)
	body := &burstBody{data: raw, step: 40, burst: len(raw)/2 + 1}
	r, x := startRelay(t, s, p, be, body)
	var rec chunkRecorder
	if _, err := r.WriteTo(&rec); err != nil {
		t.Fatal(err)
	}
	if got := bytes.Join(rec.chunks, nil); !bytes.Equal(got, raw) {
		t.Fatalf("relayed bytes differ:\n%s", got)
	}
	if len(rec.chunks) > 3 {
		t.Fatalf("%d chunks for 2 bursts, want at most 3", len(rec.chunks))
	}
	if x.outputTokens != 20 {
		t.Fatalf("counted %d tokens, want 20", x.outputTokens)
	}
	if p.rt.Idle() {
		t.Fatal("slot freed before fasthttp closed the body")
	}
	r.Close()
	r.Close()
	if !p.rt.Idle() || !body.closed || x.status != 200 {
		t.Fatalf("after Close: idle %v, engine body closed %v, status %d", p.rt.Idle(), body.closed, x.status)
	}
}

// Read, fasthttp's fallback, yields exactly what WriteTo would.
func TestRelayReadMatchesWriteTo(t *testing.T) {
	s, p, be := relayFixture(t)
	raw := sseEvents(50)
	r, _ := startRelay(t, s, p, be, &burstBody{data: raw, step: 7, burst: 7})
	got, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, raw) {
		t.Fatalf("Read relayed:\n%s", got)
	}
	r.Close()
	if !p.rt.Idle() {
		t.Fatal("slot not freed")
	}
}

// A response fasthttp drops unwritten (the client left before the headers
// went out) still frees the slot and closes the engine's stream.
func TestRelayClosedUnwrittenFreesTheSlot(t *testing.T) {
	s, p, be := relayFixture(t)
	body := &burstBody{data: sseEvents(5), step: 64, burst: 64}
	r, x := startRelay(t, s, p, be, body)
	r.Close()
	if !p.rt.Idle() || !body.closed || x.status != 499 || !x.ab.Aborted() {
		t.Fatalf("idle %v, body closed %v, status %d, aborted %v", p.rt.Idle(), body.closed, x.status, x.ab.Aborted())
	}
}

type panicBody struct{ burstBody }

func (*panicBody) Read([]byte) (int, error) { panic("engine body exploded") }

// A panic while relaying is a server error in the access log (fasthttp
// recovers it and closes the body), and the slot is still freed.
func TestRelayPanicIsAServerError(t *testing.T) {
	s, p, be := relayFixture(t)
	body := &panicBody{}
	r, x := startRelay(t, s, p, be, body)
	func() {
		defer func() { recover() }()
		r.WriteTo(&chunkRecorder{})
	}()
	r.Close()
	if x.status != 500 || !p.rt.Idle() || !body.closed {
		t.Fatalf("status %d, idle %v, body closed %v; want 500, freed, closed", x.status, p.rt.Idle(), body.closed)
	}
}

// endlessEvent is an engine that starts one event and never ends it.
type endlessEvent struct {
	read            int
	started, closed bool
}

func (e *endlessEvent) Read(p []byte) (int, error) {
	if !e.started {
		e.started = true
		return copy(p, `data: {"choices":[{"text":"`), nil
	}
	if e.read >= 4*maxSSEEvent { // a bound for the test itself
		return 0, io.EOF
	}
	for i := range p {
		p[i] = 'x'
	}
	e.read += len(p)
	return len(p), nil
}
func (e *endlessEvent) Buffered() int       { return 0 }
func (e *endlessEvent) EndBy(time.Duration) {}
func (e *endlessEvent) Close()              { e.closed = true }

// TestEndlessEventIsBounded: an event that never ends is not buffered
// without limit: past maxSSEEvent the stream ends with an OpenAI error event
// and [DONE]. The request's answer is at fault, not the engine: it stays in.
func TestEndlessEventIsBounded(t *testing.T) {
	s, p, be := relayFixture(t)
	body := &endlessEvent{}
	r, x := startRelay(t, s, p, be, body)
	var out bytes.Buffer
	if _, err := r.WriteTo(&out); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if body.read > 2*maxSSEEvent {
		t.Fatalf("read %d MiB of one event", body.read>>20)
	}
	if !strings.Contains(out.String(), `"code":"event_too_large"`) || !strings.HasSuffix(out.String(), "data: [DONE]\n\n") || x.status != 502 {
		t.Fatalf("ending %q, status %d", out.String()[max(0, out.Len()-300):], x.status)
	}
	be.mu.Lock()
	ejected := be.ejected
	be.mu.Unlock()
	if ejected {
		t.Fatal("the engine was ejected for one request's answer")
	}
	if !body.closed || !p.rt.Idle() {
		t.Fatalf("engine body closed %v, router idle %v", body.closed, p.rt.Idle())
	}
}

// loggedBody is a burstBody that logs its reads and EndBy calls, beside
// the client writes a loggedWriter logs.
type loggedBody struct {
	burstBody
	log *[]string
}

func (b *loggedBody) Read(p []byte) (int, error) {
	*b.log = append(*b.log, "read")
	return b.burstBody.Read(p)
}
func (b *loggedBody) EndBy(time.Duration) { *b.log = append(*b.log, "endby") }

type loggedWriter struct{ log *[]string }

func (w loggedWriter) Write(p []byte) (int, error) {
	*w.log = append(*w.log, "write")
	return len(p), nil
}

// Once [DONE] has come, the engine's grace to end its body (EndBy) is
// given again before each read, after the client write: a slow client
// taking the last events used up the engine's 2 s, and its healthy
// connection was closed instead of reused.
func TestEndGraceCountsFromEachRead(t *testing.T) {
	s, p, be := relayFixture(t)
	raw := sseEvents(3)
	var log []string
	body := &loggedBody{burstBody{data: raw, step: len(raw), burst: len(raw)}, &log}
	r, _ := startRelay(t, s, p, be, body)
	if _, err := r.WriteTo(loggedWriter{&log}); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if got := strings.Join(log, " "); got != "read write endby read" {
		t.Fatalf("reads, grants and writes: %s; want the grant after the client write, before the read", got)
	}
}

// A stream's event over 1 MiB is charged to limits.body_memory_mb as the
// relay's buffer grows for it (twice: the buffer and the batch's copy),
// and given back when the stream ends; with no room, the stream ends with
// body_memory_full (retry), and an event the whole budget cannot hold
// with event_too_large (no retry mends it: the review); either way the
// engine stays in. Six streams of one large event each held 550 MB
// uncounted (the chaos trial).
func TestLargeEventIsCharged(t *testing.T) {
	event := append(append([]byte(`data: {"choices":[{"delta":{"content":"`), bytes.Repeat([]byte("x"), 6<<20)...), "\"}}]}\n\ndata: [DONE]\n\n"...)
	for _, c := range []struct {
		limit, other int64
		code         string
		status       int
	}{{64 << 20, 0, "", 200}, {64 << 20, 56 << 20, "body_memory_full", 503}, {8 << 20, 0, "event_too_large", 502},
		{14 << 20, 0, "", 200}} { // its buffer grown to half the budget, not doubled past it (the review)
		s, p, be := relayFixture(t)
		s.bodyMem.SetLimit(c.limit)
		s.bodyMem.Take(c.other)
		body := &burstBody{data: bytes.Clone(event), step: 64 << 10, burst: len(event) + 1}
		r, x := startRelay(t, s, p, be, body)
		var out bytes.Buffer
		if _, err := r.WriteTo(&out); err != nil {
			t.Fatal(err)
		}
		held := s.bodyMem.Used() - c.other
		r.Close()
		if c.code == "" {
			if !bytes.Equal(out.Bytes(), event) || held < 2*6<<20 {
				t.Fatalf("room for it: %d bytes relayed of %d, %d held", out.Len(), len(event), held)
			}
		} else if !strings.Contains(out.String(), `"code":"`+c.code+`"`) || !strings.HasSuffix(out.String(), "data: [DONE]\n\n") || x.status != c.status {
			t.Fatalf("%d MiB of %d held: ending %q, status %d", c.other>>20, c.limit>>20, out.String()[max(0, out.Len()-300):], x.status)
		}
		be.mu.Lock()
		ejected := be.ejected
		be.mu.Unlock()
		if used := s.bodyMem.Used() - c.other; used != 0 || !p.rt.Idle() || ejected {
			t.Fatalf("%d MiB of %d held: %d still charged, router idle %v, engine ejected %v", c.other>>20, c.limit>>20, used, p.rt.Idle(), ejected)
		}
	}
}

// bigThenPanic sends the start of an event over 1 MiB, then panics.
type bigThenPanic struct {
	burstBody
	sent int
}

func (b *bigThenPanic) Read(p []byte) (int, error) {
	if b.sent >= 3<<20 {
		panic("engine body exploded")
	}
	n := copy(p, bytes.Repeat([]byte("x"), len(p)))
	if b.sent == 0 {
		n = copy(p, "data: {\"x\":\"")
	}
	b.sent += n
	return n, nil
}

// A panic while the handler primes a stream (the recovery abandons the
// exchange, which knows no relay) still gives back what the relay's
// buffer held of the budget (the review).
func TestPanicWhilePrimingGivesBackTheRoom(t *testing.T) {
	s, p, be := relayFixture(t)
	r, _ := startRelay(t, s, p, be, &bigThenPanic{})
	func() {
		defer func() { recover() }()
		r.primeInHandler()
	}()
	if used := s.bodyMem.Used(); used != 0 {
		t.Fatalf("%d bytes still charged after a panic while priming", used)
	}
}
