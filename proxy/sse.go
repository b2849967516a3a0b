package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
)

// relay copies an engine's SSE stream to the client event by event, flushing
// after each read that completed events, and drives the request lifecycle:
// first event → PrefillDone; every block_size output tokens → OutputBlock;
// end, error or client gone → Free (exactly once, in finish).
//
// It runs as fasthttp's body stream writer, after the handler returned: it
// must not touch the RequestCtx.
type relay struct {
	x    *exchange
	body streamBody
	resp *fasthttp.Response

	sawFirst bool
	sawDone  bool
	blocks   int
}

// streamBody is an engine's streamed answer (*backends.Body).
type streamBody interface {
	Read(p []byte) (int, error)
	Close()
}

var relayBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

func (r *relay) run(w *bufio.Writer) {
	x := r.x
	bp := relayBufs.Get().(*[]byte)
	f := newSSEFramer(*bp)
	defer func() {
		if cap(f.buf) <= 1<<20 {
			*bp = f.buf
			relayBufs.Put(bp)
		}
		r.body.Close()
		fasthttp.ReleaseResponse(r.resp)
		x.finish()
	}()
	for {
		n, err := r.body.Read(f.free())
		f.commit(n)
		wrote := false
		for {
			raw, content, ok := f.next()
			if !ok {
				break
			}
			if fixed := r.onEvent(content); fixed != nil {
				raw = fixed
			}
			if _, werr := w.Write(raw); werr != nil {
				r.clientGone()
				return
			}
			wrote = true
		}
		if wrote {
			if ferr := w.Flush(); ferr != nil {
				r.clientGone()
				return
			}
		}
		if err == nil {
			continue
		}
		if errors.Is(err, io.EOF) && r.sawDone {
			x.b.succeed()
			if rest := f.pending(); len(rest) > 0 { // bytes after [DONE] without a blank line
				w.Write(rest)
				w.Write([]byte("\n\n"))
			}
			w.Flush()
			return
		}
		if errors.Is(err, backends.ErrAborted) || x.ab.Aborted() {
			x.status = 499
			return
		}
		// The engine failed mid-stream (an error, or the connection ended
		// before [DONE]: a dropped chunked stream reads as a plain EOF): tell
		// the client in OpenAI's shape and end the stream properly.
		if errors.Is(err, io.EOF) {
			err = errors.New("stream ended without [DONE]")
		}
		x.errMsg = "backend " + x.b.cfg.ID + " failed mid-stream: " + err.Error()
		x.b.fail("mid-stream: " + err.Error())
		x.status = fasthttp.StatusBadGateway
		w.Write([]byte("data: "))
		w.Write(errorJSON("the backend serving this request failed mid-stream", "upstream_error", "", "backend_failed"))
		w.Write([]byte("\n\n"))
		w.Write(doneEvent)
		w.Flush()
		return
	}
}

var doneEvent = []byte("data: [DONE]\n\n")

func (r *relay) clientGone() {
	r.x.ab.Abort()
	r.x.status = 499
}

var (
	dataPrefix   = []byte("data:")
	doneData     = []byte("[DONE]")
	contentKey   = []byte(`"content":"`)
	textKey      = []byte(`"text":"`)
	reasoningKey = []byte(`"reasoning_content":"`)
	toolCallsKey = []byte(`"tool_calls":[`)
)

// onEvent inspects one event (without its terminating blank line). It
// returns a replacement for the event when the engine's must not reach the
// client as it is (an error frame in older vLLM's flat shape), else nil.
func (r *relay) onEvent(ev []byte) []byte {
	var fixed []byte
	for len(ev) > 0 {
		line := ev
		if k, n := lineEnd(ev); k >= 0 {
			line, ev = ev[:k], ev[k+n:]
		} else {
			ev = nil
		}
		if !bytes.HasPrefix(line, dataPrefix) {
			continue
		}
		data := bytes.TrimLeft(line[len(dataPrefix):], " ")
		if bytes.Equal(data, doneData) {
			r.sawDone = true
			continue
		}
		if bytes.HasPrefix(data, flatErrorPrefix) {
			// {"object":"error","message":...}: older vLLM's error frame.
			r.x.errMsg = "engine error frame"
			fixed = append(append(append(fixed, "data: "...), normalizeEngineError(500, data)...), "\n\n"...)
			continue
		}
		r.onData(data)
	}
	return fixed
}

var flatErrorPrefix = []byte(`{"object":"error"`)

func (r *relay) onData(data []byte) {
	x := r.x
	if !r.sawFirst {
		r.sawFirst = true
		x.ttft = time.Since(x.start)
		x.active.PrefillDone()
		x.active.ObserveTTFT(x.ttft)
		x.s.metrics.ttft.Observe(x.ttft.Seconds())
	}
	if carriesToken(data) {
		x.outputTokens++
		if bs := x.p.cfg.BlockSize; x.outputTokens/bs > r.blocks {
			r.blocks++
			x.active.OutputBlock()
		}
		return
	}
	// Usage arrives in a chunk of its own (stream_options.include_usage).
	if c := cachedTokens(data); c >= 0 {
		x.cachedTokens = c
	}
}

// carriesToken reports whether a chunk carries generated output. Engines
// stream one token per chunk; role-only and usage-only chunks carry none.
func carriesToken(data []byte) bool {
	for _, key := range [...][]byte{contentKey, textKey, reasoningKey} {
		if i := bytes.Index(data, key); i >= 0 {
			if k := i + len(key); k < len(data) && data[k] != '"' {
				return true
			}
		}
	}
	return bytes.Contains(data, toolCallsKey)
}
