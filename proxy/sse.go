package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
)

// relay copies an engine's SSE stream to the client event by event and
// drives the request lifecycle: first event → PrefillDone; every block_size
// output tokens → OutputBlock; end, error or client gone → Free (exactly
// once, in Close).
//
// It is the response's body stream. fasthttp calls WriteTo from the client
// connection's own goroutine after the handler returned, and each Write there
// is one HTTP chunk, flushed: so the events of one engine read go out as one
// chunk, with no pipe and no goroutine between the engine and the client.
// fasthttp calls Close once the response is written or abandoned. The relay
// must not touch the RequestCtx.
type relay struct {
	x    *exchange
	body streamBody
	resp *fasthttp.Response
	bufs *relayBuffers
	f    sseFramer
	pend []byte // Read: bytes of the current batch not yet returned

	sawFirst bool
	sawDone  bool
	// finished: the last chunk with choices gave a finish_reason, so an
	// engine that ends its body there without [DONE] answered in full.
	finished bool
	// choices: with several choices asked for (x.choices), whether
	// each one seen so far, by index, has finished; nil before the first.
	// untracked: one came past maxTrackedChoices.
	choices   []bool
	untracked bool
	// sawError: the engine sent an error frame (it answered, with an
	// error: a body that ends after it is not an engine failing);
	// engineFault: one not of the request's doing (not a 4xx's type),
	// which counts against the engine as a 500 answer does.
	sawError, engineFault bool
	// noStream: the engine's first event holds no SSE field (errNoEvents).
	noStream bool
	// quietSince is when the engine's reads began to bring no event that is
	// not only comments (coarseNow; 0 while events come), sawEvent whether
	// one came in the current read (errOnlyComments).
	quietSince int64
	sawEvent   bool
	// anyEvent: an event that is not only comments came, ever (when).
	anyEvent bool
	// failedFrame: an error frame of the engine's own making, held back
	// while the stream may move to another engine (errEngineErrorFrame).
	failedFrame []byte
	// afterDone: the time spent waiting for the engine since [DONE]
	afterDone time.Duration
	relayed   int // a Responses stream's events: its next sequence_number
	// engineEvents counts the engine's events relayed (or held in pend),
	// not those a moved stream drops;
	// failMsg, failTyp and failCode are kvproxy's error event's, once one
	// ends the stream.
	engineEvents               int
	failMsg, failTyp, failCode string
	blocks                     int
	ended                      bool // the engine's stream is over (or failed): nothing more to send
	closed                     bool
	// A stream continued on another engine (migrate): resumed until that
	// engine's first token (the events before it, which restate the role,
	// are dropped), restarted until its first event (its prefill);
	// blockBase is the output relayed before it.
	resumed, restarted bool
	moved              bool // continued on another engine at least once
	blockBase          int
}

// streamBody is an engine's streamed answer (*backends.Body).
type streamBody interface {
	Read(p []byte) (int, error)
	Buffered() int // bytes received and not yet read
	Close()
	EndBy(d time.Duration) // the answer's end came: the next read must end within d
}

// endGrace is how long the engine may take to end its body once its
// answer's last event came: the client waits for that end, and SDKs read
// a stream to its end after [DONE].
const endGrace = 2 * time.Second

// maxBatch bounds the events gathered into one client chunk.
const maxBatch = 16 << 10

// relayBuffers are one stream's read buffer (framed in place) and the batch
// of events written to the client per engine read.
type relayBuffers struct{ in, out []byte }

var relayBufs = sync.Pool{New: func() any { return &relayBuffers{in: make([]byte, 32<<10), out: make([]byte, 0, 4<<10)} }}

func newRelay(x *exchange, body streamBody, resp *fasthttp.Response) *relay {
	r := &relay{x: x, body: body, resp: resp, bufs: relayBufs.Get().(*relayBuffers)}
	r.f = *newSSEFramer(r.bufs.in)
	r.f.mem, r.f.own = x.s.bodyMem, &x.answerHeld
	return r
}

// SupportsBodyWriteTo tells fasthttp to call WriteTo rather than Read.
func (r *relay) SupportsBodyWriteTo() bool { return true }

// WriteTo relays the stream to w, one Write per engine read that completed
// events.
func (r *relay) WriteTo(w io.Writer) (int64, error) {
	defer func() {
		if p := recover(); p != nil {
			// fasthttp recovers it and closes the body: log a server error,
			// not the client hang-up Close would assume.
			r.ended = true
			r.x.status = fasthttp.StatusInternalServerError
			r.x.errMsg = fmt.Sprint("relay panic: ", p)
			panic(p)
		}
	}()
	var total int64
	for !r.ended || len(r.pend) > 0 {
		out := r.pend // prime's
		r.pend = nil
		if len(out) == 0 {
			out = r.nextBatch()
		}
		if len(out) == 0 {
			continue
		}
		n, err := w.Write(out)
		total += int64(n)
		if err != nil {
			r.clientGone()
			return total, err
		}
	}
	return total, nil
}

// prime reads the stream up to its first events, before the answer's
// status goes out (fasthttp writes it with the first chunk anyway), and
// keeps them for WriteTo or Read. It reports false when the stream ended
// before any event of the engine's: the engine failed or went silent
// (failMsg says how), the client left (status 499), or kvproxy is shutting
// down.
func (r *relay) prime() bool {
	// A batch of blank lines only is no event: the next read decides (a
	// batch is the relay's buffer, overwritten by the next, and blank
	// lines before the first event tell the client nothing).
	for !r.ended && (len(r.pend) == 0 || r.engineEvents == 0) {
		r.pend = r.nextBatch()
	}
	return r.engineEvents > 0
}

// primeInHandler is prime for the handler, whose recovery from a panic
// abandons the exchange, which knows no relay: what the relay's buffer
// holds of the budget is given back here (the review).
func (r *relay) primeInHandler() bool {
	defer func() {
		if p := recover(); p != nil {
			r.f.release()
			panic(p)
		}
	}()
	return r.prime()
}

// Read serves the same bytes as WriteTo to a caller that reads.
func (r *relay) Read(p []byte) (int, error) {
	for len(r.pend) == 0 {
		if r.ended {
			return 0, io.EOF
		}
		r.pend = r.nextBatch()
	}
	n := copy(p, r.pend)
	r.pend = r.pend[n:]
	return n, nil
}

// nextBatch reads from the engine (once, and again while it has already
// sent more) and returns the complete events read (inspected, and fixed
// where needed), plus the stream's ending when the engine's stream is over.
func (r *relay) nextBatch() []byte {
	f := &r.f
	out := r.bufs.out[:0]
	var err error
	for {
		if f.tooLarge() {
			err = errEventTooLarge
			break
		}
		ending := r.sawDone
		var t0 time.Time
		if ending {
			// What is left of endGrace, counted in the engine's time
			// only: the time a slow client took to take the last events
			// between two reads is not the engine's, and an engine that
			// trickles bytes after [DONE] does not get 2 s per read.
			t0 = time.Now()
			r.body.EndBy(endGrace - r.afterDone)
		}
		room := f.free()
		if room == nil {
			err = refusedEvent(f.refused)
			break
		}
		var n int
		n, err = r.body.Read(room)
		if ending {
			r.afterDone += time.Since(t0)
		}
		if n > 0 {
			r.x.heard.Store(coarseNow())
		}
		f.commit(n)
		if err != nil && (errors.Is(err, io.EOF) || errors.Is(err, backends.ErrTruncated)) {
			f.atEOF()
		}
		out = r.events(out)
		if r.failedFrame == nil && errors.Is(err, io.EOF) && lastEventWhole(f.pending()) {
			// The body ended cleanly on an event without its blank
			// line: the OpenAI SDKs take it, and so does kvproxy.
			f.endEvent()
			out = r.events(out)
		}
		if f.refused != nil { // at the end's last bytes
			err = refusedEvent(f.refused)
			break
		}
		if r.failedFrame != nil { // also one that ended the body (the review)
			err = errEngineErrorFrame
			break
		}
		if r.noStream {
			err = errNoEvents
			break
		}
		if r.sawEvent {
			r.sawEvent, r.quietSince = false, 0
		} else if n > 0 && err == nil && !r.sawDone && r.onlyComments() {
			// Comments (pings) keep the engine's connection busy, and its
			// read timeout with it, but carry no answer: an engine whose
			// generation hung while a task of its own still pings (as
			// sse-starlette's does, every 15 s) held the stream and its
			// load slot for good.
			err = errOnlyComments
			break
		}
		// What the engine has already sent goes out in the same chunk: one
		// client write per burst, not per engine chunk, as a pipe would.
		if err != nil || len(out) >= maxBatch || r.body.Buffered() == 0 {
			break
		}
	}
	if err != nil {
		out = r.end(out, err)
	}
	r.bufs.out = out // keep what the buffer grew to
	return out
}

// events appends the complete events the framer holds to out, inspected
// (and fixed where needed).
func (r *relay) events(out []byte) []byte {
	for {
		raw, content, ok := r.f.next()
		if !ok {
			return out
		}
		switch r.x.api {
		case apiResponses:
			raw = r.onResponsesEvent(raw, content)
			r.relayed++
		case apiMessages:
			r.onAnthropicEvent(content)
		default:
			if fixed := r.onEvent(content); fixed != nil {
				raw = fixed
			}
		}
		if r.engineEvents == 0 && len(content) > 0 && !hasSSEField(bytes.TrimPrefix(content, utf8BOM)) && len(bytes.TrimSpace(content)) > 0 {
			// Bytes typed as an event stream that hold none (a buffer of
			// junk, a page): no event, and no answer (the chaos trial:
			// they went out in a 200).
			r.noStream = true
			return out
		}
		if len(raw) > 0 && len(content) > 0 { // not a blank line (no event), nor one a moved stream drops
			r.engineEvents++
		}
		if !r.sawEvent && len(content) > 0 && !commentsOnly(content) {
			r.sawEvent, r.anyEvent = true, true
		}
		out = append(out, raw...)
		if r.failedFrame != nil {
			return out // the engine's stream ends there (nextBatch)
		}
	}
}

// end appends the stream's ending to out once the engine's stream is over
// (err): nothing more after [DONE], or an OpenAI error event and [DONE] when
// the engine failed; it records the outcome on the exchange.
func (r *relay) end(out []byte, err error) []byte {
	x := r.x
	r.ended = true
	frame := r.failedFrame // held for a move: never the next engine's
	r.failedFrame = nil
	switch {
	case r.sawDone && !errors.Is(err, errEventTooLarge) && !errors.Is(err, errRelayOverBudget) && !errors.Is(err, errEventBeyondBudget):
		// Complete, whatever ends the body after [DONE]: a connection
		// dropped or reset, one aborted (a cut, or a client that hung up
		// once it had [DONE], as SDKs do, before the engine closed its
		// stream), or an engine that did not end its body within endGrace
		// of [DONE], adds nothing. A [DONE] not yet written goes in out,
		// and a client gone since fails that write: a 499 still.
		r.answered()
		if rest := r.f.pending(); len(rest) > 0 { // bytes after [DONE] without a blank line
			out = append(append(out, rest...), "\n\n"...)
		}
	case err == io.EOF && (x.choices == 1 && r.finished || x.choices != 1 && r.allFinished()) && r.resp != nil &&
		(x.api == apiChat || x.api == apiCompletions) && len(bytes.TrimSpace(r.f.pending())) == 0 &&
		r.resp.Header.ContentLength() != -2:
		// The body ended cleanly after the answer's finish_reason, with
		// no [DONE]: engines that leave it out (llama.cpp before late
		// 2024, TGI before mid-2024, ik_llama.cpp without --send-done)
		// answered in full. The client gets the [DONE] OpenAI sends, and
		// the engine is not taken for one that died mid-answer. Not for
		// several choices (one finishing says nothing of the others), nor
		// for a body that ends with its connection, where a crash reads
		// as its end. A usage chunk asked for and missing is not waited
		// for: such engines may not send one (TGI ignores include_usage),
		// and kvproxy then meters by its own count. With several choices
		// asked for, every one must have come and finished (or the one
		// choice of an engine that ignores n, as llama.cpp does).
		x.b.succeed()
		if x.b.noDoneSaid.CompareAndSwap(false, true) {
			x.b.log.Info().Str("backend", x.b.cfg.ID).
				Msg("the engine ends its streams without data: [DONE] (after the finish_reason): kvproxy adds it for the clients")
		}
		out = append(out, doneEvent...)
	case err == io.EOF && r.sawError && r.resp != nil && r.resp.Header.ContentLength() != -2:
		// The engine answered with an error frame and ended its body
		// without [DONE] (TGI before mid-2024): the client has the error,
		// and gets the [DONE] vLLM sends after one. The engine is not
		// taken for one that died, nor is the request moved. Not for a
		// body that ends with its connection, where a crash reads as its
		// end.
		r.answered()
		out = append(out, doneEvent...)
	case (errors.Is(err, backends.ErrAborted) || x.ab.Aborted()) && x.s.live.isCut():
		x.errMsg = errCutMsg
		x.status = fasthttp.StatusServiceUnavailable
		out = r.failEvent(out, errCutMsg, "service_unavailable", "shutting_down")
	case (errors.Is(err, backends.ErrAborted) || x.ab.Aborted()) && x.unresponsive.Load() != nil:
		msg := *x.unresponsive.Load()
		return r.engineFailed(out, msg, msg, fasthttp.StatusGatewayTimeout,
			"the backend serving this request stopped answering: "+msg, "timeout_error", "backend_timeout")
	case errors.Is(err, backends.ErrAborted) || x.ab.Aborted():
		x.status = 499
	case errors.Is(err, errEngineErrorFrame):
		// Counted as the engine's error answers are, before it moves.
		x.b.answeredError("an error event in its stream")
		// Its kind only: the message may quote the prompt, which the
		// log never holds (the third review).
		out, handled, detail := r.moveOrEnd("sent an error event"+engineErrorKind(frame), out)
		if handled {
			return out
		}
		// Not moved: the client gets the engine's frame and [DONE], as
		// it would have.
		r.sawError, r.engineFault = true, true
		if x.mig != nil {
			x.mig.stop(x.s.bodyMem)
		}
		x.errMsg = "engine error frame" + engineErrorKind(frame) + detail
		// The engine's event: one before any other is a stream's first,
		// which prime relays as a stream (it was answered as a 200 with
		// a JSON error of kvproxy's: the review).
		r.engineEvents++
		out = append(append(append(out, "data: "...), frame...), "\n\n"...)
		return append(out, doneEvent...)
	case errors.Is(err, errNoEvents):
		msg := "backend " + x.b.cfg.ID + " answered a stream request with bytes that hold no event"
		x.b.answeredError(msg)
		x.errMsg, x.status = msg, fasthttp.StatusBadGateway
		out = r.failEvent(out, "the backend serving this request answered with no event stream", "upstream_error", "backend_failed")
	case errors.Is(err, errEventTooLarge) || errors.Is(err, errEventBeyondBudget):
		// This request's answer, not the engine, is at fault (a first chunk
		// with prompt logprobs of a huge prompt): the engine stays in.
		x.errMsg = "backend " + x.b.cfg.ID + " sent " + err.Error()
		x.status = fasthttp.StatusBadGateway
		more := "more than kvproxy relays"
		if errors.Is(err, errEventBeyondBudget) {
			more = fmt.Sprintf("more than kvproxy holds at once (limits.body_memory_mb: %d MiB)", x.s.bodyMem.Limit()>>20)
		}
		out = r.failEvent(out, "the answer holds "+err.Error()+", "+more, "upstream_error", "event_too_large")
	case errors.Is(err, errRelayOverBudget):
		// Nor is it when other large bodies hold the room its event needs.
		x.s.metrics.unavailable.WithLabelValues(string(whyBodyMemory)).Inc()
		x.errMsg = "backend " + x.b.cfg.ID + " sent an event larger than the room left in limits.body_memory_mb"
		x.status = fasthttp.StatusServiceUnavailable
		out = r.failEvent(out, fmt.Sprintf("kvproxy holds its limit of memory for bodies over 1 MiB (limits.body_memory_mb: %d MiB) and has no room for an event of this answer; retry", x.s.bodyMem.Limit()>>20),
			"service_unavailable", string(whyBodyMemory))
	case backends.IsTimeout(err) || errors.Is(err, errOnlyComments):
		msg, when := x.b.silent(), r.when()
		if errors.Is(err, errOnlyComments) {
			msg = "backend " + x.b.cfg.ID + " sent only SSE comments for " + x.b.up.ReadTimeout.String() + " (limits.stream_idle_timeout)"
		}
		x.b.fail(ejectTimeout, "silent "+when)
		return r.engineFailed(out, "silent for "+x.b.up.ReadTimeout.String(), msg+" "+when, fasthttp.StatusGatewayTimeout,
			"the backend serving this request went silent "+when+": "+msg, "timeout_error", "backend_timeout")
	default:
		// The engine failed mid-stream (an error, or the connection ended
		// before [DONE]: a dropped chunked stream reads as a plain EOF): tell
		// the client in OpenAI's shape and end the stream properly.
		// A body that ended on its own framing (not with its connection,
		// where a crash reads the same).
		clean := errors.Is(err, io.EOF) && r.resp != nil && r.resp.Header.ContentLength() != -2
		if errors.Is(err, io.EOF) || errors.Is(err, backends.ErrTruncated) {
			err = errors.New("stream ended without [DONE]")
			switch x.api {
			case apiResponses:
				err = errors.New("stream ended before the response's last event")
			case apiMessages:
				err = errors.New("stream ended before message_stop")
			}
		}
		when := r.when()
		if clean && r.engineEvents == 0 {
			// A body that ended cleanly with no event: the engine answered,
			// wrongly, over a connection that works. Counted as its other
			// error answers are (which never eject a model's only engine),
			// not as one that died.
			x.b.answeredError("a stream " + when + ": " + err.Error())
		} else {
			x.b.cutOff(when + ": " + err.Error())
		}
		return r.engineFailed(out, err.Error(), "backend "+x.b.cfg.ID+" failed "+when+": "+err.Error(), fasthttp.StatusBadGateway,
			"the backend serving this request failed "+when, "upstream_error", "backend_failed")
	}
	return out
}

// onlyComments reports whether the engine's reads have brought nothing but
// comments for its stream_idle_timeout, counted from the first such read
// (an event still coming in pieces is not silence). Events read reset it:
// the clock is read only while none come.
func (r *relay) onlyComments() bool {
	now := coarseNow()
	if r.quietSince == 0 {
		r.quietSince = now
		return false
	}
	return time.Duration(now-r.quietSince) > r.x.b.up.ReadTimeout && commentsOnly(r.f.pending())
}

// when says where in the stream the engine failed, for the messages.
func (r *relay) when() string {
	if r.engineEvents == 0 || !r.anyEvent { // pings are no event of the answer
		return "before its first event"
	}
	return "mid-stream"
}

// engineFailed ends a stream whose engine failed mid-answer (why), unless
// it moves to another engine (migrate): the exchange records logMsg and
// status, and the client gets the error event of msg, typ and code.
func (r *relay) engineFailed(out []byte, why, logMsg string, status int, msg, typ, code string) []byte {
	out, handled, detail := r.moveOrEnd(why, out)
	if handled {
		return out
	}
	r.x.errMsg = logMsg + detail
	r.x.status = status
	return r.failEvent(out, msg, typ, code)
}

// Close ends the exchange: the engine connection is released (or closed, if
// the client left before the stream ended) and the slot freed. fasthttp calls
// it after writing the response, or when it drops the response unwritten.
func (r *relay) Close() error {
	if r.closed {
		return nil
	}
	r.closed = true
	if !r.ended {
		r.clientGone()
	}
	if r.body != nil { // nil after a failed migration
		r.body.Close()
		fasthttp.ReleaseResponse(r.resp)
	}
	r.f.release()
	if cap(r.f.buf) <= 1<<20 && cap(r.bufs.out) <= 1<<20 {
		r.bufs.in = r.f.buf
		relayBufs.Put(r.bufs)
	}
	r.bufs, r.f.buf, r.pend = nil, nil, nil
	r.x.finish()
	return nil
}

var (
	doneEvent = []byte("data: [DONE]\n\n")
	cr        = []byte("\r")
)

// errEngineErrorFrame ends an engine's stream at an error frame of its own
// making, for the stream to move (relay.failedFrame).
var errEngineErrorFrame = errors.New("an error event of the engine's making")

var errEventTooLarge = fmt.Errorf("an SSE event larger than %d MiB", maxSSEEvent>>20)

// errNoEvents: the engine's stream begins with bytes that hold no event.
var errNoEvents = errors.New("no event stream")

// errOnlyComments: the engine sent nothing but comments (or blank lines)
// for limits.stream_idle_timeout.
var errOnlyComments = errors.New("only SSE comments")

// errRelayOverBudget: an event outgrew the room limits.body_memory_mb had;
// errEventBeyondBudget: the whole of it (which no retry mends).
var (
	errRelayOverBudget   = errors.New("no room in limits.body_memory_mb for an event")
	errEventBeyondBudget = errors.New("an SSE event larger than half of limits.body_memory_mb (an event is held twice, as read and as relayed)")
)

// refusedEvent is the relay's error for the budget's refusal err of an
// event's room.
func refusedEvent(err error) error {
	if errors.Is(err, backends.ErrBeyondBudget) {
		return errEventBeyondBudget
	}
	return errRelayOverBudget
}

func (r *relay) clientGone() {
	r.ended = true
	r.x.ab.Abort()
	r.x.status = 499
}

var (
	dataPrefix   = []byte("data:")
	doneData     = []byte("[DONE]")
	contentKey   = []byte(`"content":`)
	textKey      = []byte(`"text":`)
	reasoningKey = []byte(`"reasoning_content":`)
	reasonKey    = []byte(`"reasoning":`) // vLLM's name for it since early 2026
	toolCallsKey = []byte(`"tool_calls":`)
)

// nextLine splits an event (without its terminating blank line) into its
// first line and the rest. The event's last line may end in a lone \r:
// that is its end (lineEnd waits for a \n a complete event will not get).
func nextLine(ev []byte) (line, rest []byte) {
	if k, n := lineEnd(ev); k >= 0 {
		return ev[:k], ev[k+n:]
	}
	return bytes.TrimSuffix(ev, cr), nil
}

// onEvent inspects one event (without its terminating blank line). It
// returns a replacement for the event when the engine's must not reach the
// client as it is (an error frame in older vLLM's flat shape), else nil.
func (r *relay) onEvent(ev []byte) []byte {
	var fixed []byte
	for len(ev) > 0 {
		var line []byte
		line, ev = nextLine(ev)
		if !bytes.HasPrefix(line, dataPrefix) {
			continue
		}
		data := bytes.TrimLeft(line[len(dataPrefix):], " ")
		if bytes.Equal(data, doneData) {
			r.sawDone = true
			continue
		}
		if r.moved {
			if d, drop := r.continued(data); drop {
				return dropped
			} else if d != nil {
				if r.onData(d) {
					return dropped
				}
				fixed = append(append(append(fixed, "data: "...), d...), "\n\n"...)
				continue
			}
		}
		if isErrorFrame(data) {
			if norm := normalizeEngineError(500, data); !requestsFault(norm) && r.mayMove() {
				// The engine failed in its own words (vLLM's
				// InternalServerError frame when its engine core dies):
				// the stream moves as one whose engine dropped it, and
				// the client gets the frame only if it cannot (the
				// twenty-ninth session's review: it ended the stream).
				r.failedFrame = append(r.failedFrame[:0], norm...)
				return dropped
			}
			r.sawError = true
			if r.x.mig != nil {
				r.x.mig.stop(r.x.s.bodyMem) // the client was told
			}
			// The engine failed mid-stream (vLLM: {"error": {...}}, older
			// versions {"object": "error", "message": ...}, TGI {"error":
			// "...", "error_type": ...}, compact or spaced): logged, and
			// passed on in OpenAI's shape, with the string code clients
			// expect.
			r.x.errMsg = "engine error frame"
			norm := normalizeEngineError(500, data)
			r.engineFault = r.engineFault || !requestsFault(norm)
			if !bytes.Equal(norm, data) {
				fixed = append(append(append(fixed, "data: "...), norm...), "\n\n"...)
				continue
			}
		}
		if r.onData(data) {
			return dropped
		}
	}
	return fixed
}

// answered records a stream the engine ended as it should: a success, or
// with an error frame an error answer (one of its own making counts
// towards ejection as a 500 does; one of the request's, neither way).
func (r *relay) answered() {
	switch {
	case !r.sawError:
		r.x.b.succeed()
	case r.engineFault:
		r.x.b.answeredError("an error event in its stream")
	}
}

// requestsFault reports whether an error in OpenAI's shape is the
// request's doing: its type is invalid_request_error.
func requestsFault(errJSON []byte) bool {
	var e struct {
		Error struct {
			Type string `json:"type"`
		} `json:"error"`
	}
	return json.Unmarshal(errJSON, &e) == nil && e.Error.Type == "invalid_request_error"
}

// failEvent appends the event that ends a stream the engine or kvproxy
// failed: an OpenAI error and [DONE], or for a response the Responses
// API's error event (its streams have no [DONE]).
func (r *relay) failEvent(out []byte, msg, typ, code string) []byte {
	r.failMsg, r.failTyp, r.failCode = msg, typ, code
	switch r.x.api {
	case apiResponses:
		out = append(out, "event: error\ndata: "...)
		return append(append(out, responsesErrorJSON(msg, typ, code, r.relayed)...), "\n\n"...)
	case apiMessages:
		return anthropicFailEvent(out, r.x.status, msg)
	}
	out = append(out, "data: "...)
	out = append(out, errorJSON(msg, typ, "", code)...)
	return append(append(out, "\n\n"...), doneEvent...)
}

// isErrorFrame reports whether data, an event's JSON, is an engine's error:
// an object whose first member is "error" holding an object or a string
// (TGI's), or "object" holding "error". A chunk's first member is "id", so
// this costs a few byte comparisons per event.
func isErrorFrame(data []byte) bool {
	// At once for a chunk: its first member's name starts with neither
	// letter (measured: the full look cost 10% of the relay's time).
	if len(data) > 2 && data[0] == '{' && data[1] == '"' && data[2] != 'e' && data[2] != 'o' {
		return false
	}
	key, val, ok := firstMember(data)
	if !ok {
		return false
	}
	switch string(key) {
	case "error":
		return len(val) > 0 && (val[0] == '{' || val[0] == '"')
	case "object":
		return bytes.HasPrefix(val, quotedError)
	}
	return false
}

var quotedError = []byte(`"error"`)

// firstMember splits a JSON object's text after its first member's name:
// the name (unescaped names only) and the text from its value on.
func firstMember(data []byte) (key, val []byte, ok bool) {
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		return nil, nil, false
	}
	i = skipSpace(data, i+1)
	if i >= len(data) || data[i] != '"' {
		return nil, nil, false
	}
	end := bytes.IndexByte(data[i+1:], '"')
	if end < 0 || bytes.IndexByte(data[i+1:i+1+end], '\\') >= 0 {
		return nil, nil, false
	}
	key = data[i+1 : i+1+end]
	i = skipSpace(data, i+2+end)
	if i >= len(data) || data[i] != ':' {
		return nil, nil, false
	}
	return key, data[skipSpace(data, i+1):], true
}

// onData follows a chunk of the answer (its finish, output, choice and
// usage) and reports whether it is the usage the client did not ask for.
func (r *relay) onData(data []byte) (unasked bool) {
	last := false
	if v, ok := finishValue(data); ok { // none in a usage chunk (no choices)
		r.finished = len(v) > 1 && v[0] == '"' && v[1] != '"' // SGLang 0.4.3 sent "" mid-answer
		last = r.finished
	}
	if r.x.choices != 1 {
		r.noteChoice(data, last)
	}
	k, v := outputOf(data)
	if m := r.x.mig; m != nil {
		if m.note(data, k, v); m.off && m.body != nil {
			m.stop(r.x.s.bodyMem) // it can no longer move
		}
	}
	if k >= 0 {
		r.onToken()
		if last {
			// TGI sends the usage with the last token, not after it.
			r.x.usage.read(data)
		}
		return false
	}
	if !r.sawFirst && !noChoices(data) {
		r.firstEvent()
	}
	// Usage arrives in a chunk of its own (stream_options.include_usage):
	// one kvproxy asked the engine for and the client did not
	// (exchange.addedUsage) is metered, not relayed.
	r.x.usage.read(data)
	return r.x.addedUsage && noChoices(data) && hasUsage(data)
}

// noteChoice records, for a request of several choices, the choice a
// chunk is of (its first "index": engines write the choice's before its
// delta's tool calls', JSON of sorted keys does not, and such a stream
// never counts as finished) and whether it finished. A chunk of several
// choices is not followed.
func (r *relay) noteChoice(data []byte, finished bool) {
	if bytes.Count(data, finishKey) > 1 {
		r.untracked = true // several choices in one chunk: not followed
		return
	}
	i := intAfter(data, indexKey)
	if i < 0 {
		return
	}
	if i >= maxTrackedChoices {
		r.untracked = true
		return
	}
	for len(r.choices) <= i {
		r.choices = append(r.choices, false)
	}
	r.choices[i] = r.choices[i] || finished
}

// maxTrackedChoices bounds the choices noteChoice tracks (vLLM allows n up
// to 128 and a batch's prompts multiply it); a stream with one past it
// never counts as finished.
const maxTrackedChoices = 4096

var indexKey = []byte(`"index":`)

// allFinished reports whether every choice asked for has come and
// finished, or the one choice of an engine that ignores n has.
func (r *relay) allFinished() bool {
	if seen := len(r.choices); seen == 0 || r.untracked || seen != 1 && seen != r.x.choices {
		return false
	}
	for _, done := range r.choices {
		if !done {
			return false
		}
	}
	return true
}

// onToken counts an event that carried output, the first of them ending
// the prefill.
func (r *relay) onToken() {
	if !r.sawFirst {
		r.firstEvent()
	}
	x := r.x
	x.outputTokens++
	if bs := x.p.cfg.BlockSize; (x.outputTokens-r.blockBase)/bs > r.blocks {
		r.blocks++
		x.active.OutputBlock()
	}
}

// firstEvent ends the prefill: the engine has started to answer.
func (r *relay) firstEvent() {
	x := r.x
	r.sawFirst = true
	now := time.Now()
	x.ttft = now.Sub(x.start)
	x.active.PrefillDone()
	// The engine's part only: time in kvproxy's queue, on /tokenize
	// or on refused attempts is not the engine being slow (calibration
	// took it for that; found by the eighth session's review).
	if !x.wholeAnswer {
		x.active.ObserveTTFT(now.Sub(x.sent))
	}
	x.s.metrics.observeTTFT(x.b.cfg.ID, x.ttft.Seconds())
}

// noChoices reports whether a chunk's choices are an empty array: Azure
// OpenAI's first chunk, which carries only its prompt_filter_results as soon
// as the request is taken, long before the prefill ends (as a usage chunk
// does after the answer).
func noChoices(data []byte) bool {
	i := bytes.Index(data, choicesKey)
	if i < 0 {
		return false
	}
	i = skipSpace(data, i+len(choicesKey))
	if i >= len(data) || data[i] != '[' {
		return false
	}
	i = skipSpace(data, i+1)
	return i < len(data) && data[i] == ']'
}

var choicesKey = []byte(`"choices":`)

// finishValue finds a chunk's "finish_reason" and returns what follows its
// colon, spaces skipped. The search is for "_reason": (measured: from the
// name's opening quote, which starts every member, it made the relay's time
// per event half as long again; from '_', rare in a chunk, nothing
// measurable).
func finishValue(data []byte) ([]byte, bool) {
	for off := 0; ; {
		i := bytes.Index(data[off:], reasonSuffix)
		if i < 0 {
			return nil, false
		}
		at := off + i
		off = at + len(reasonSuffix)
		if at >= len(finishPrefix) && bytes.Equal(data[at-len(finishPrefix):at], finishPrefix) {
			return bytes.TrimLeft(data[off:], " \t"), true
		}
	}
}

var reasonSuffix, finishPrefix = []byte(`_reason":`), []byte(`"finish`)

// carriesToken reports whether a chunk carries generated output: a
// non-empty content, text, reasoning or reasoning_content string, or
// tool_calls.
// Engines stream one token per chunk; role-only and usage-only chunks carry
// none. Engines that write JSON with spaces (Python's json.dumps) count as
// compact ones do.
func carriesToken(data []byte) bool {
	k, _ := outputOf(data)
	return k >= 0
}

// outputKeys are the members whose non-empty string carries output.
var outputKeys = [...][]byte{contentKey, textKey, reasoningKey, reasonKey}

// outputOf finds a chunk's output: the value (from its start on) of the
// first of outputKeys holding a non-empty string, and that key's place in
// outputKeys, or a non-empty tool_calls array with len(outputKeys); -1
// when the chunk carries none.
func outputOf(data []byte) (key int, v []byte) {
	for i, k := range outputKeys {
		if v := valueAfter(data, k); len(v) > 1 && v[0] == '"' && v[1] != '"' {
			return i, v
		}
	}
	if v := valueAfter(data, toolCallsKey); len(v) > 1 && v[0] == '[' && v[1] != ']' {
		return len(outputKeys), v
	}
	return -1, nil
}

// valueAfter is what follows the first key in data, spaces skipped.
func valueAfter(data, key []byte) []byte {
	i := bytes.Index(data, key)
	if i < 0 {
		return nil
	}
	v := data[i+len(key):]
	for len(v) > 0 && (v[0] == ' ' || v[0] == '\t') {
		v = v[1:]
	}
	return v
}
