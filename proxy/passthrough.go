package proxy

import (
	"errors"
	"io"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/router"
)

// passthroughPaths are engine endpoints whose requests carry no
// conversation to route on: embeddings, scores, tokenizing. kvproxy reads
// only their model (which picks the engines, and is rewritten to the
// engine's name), strips nvext and cache_salt, and forwards the rest
// untouched to the model's engine with the lowest load; the answer comes
// back as the engine gave it (errors in OpenAI's shape). The value is the
// prompt work the request is counted as while it runs, in tokens per byte
// of body: the router has no tokens to count, and tokenizing costs an
// engine no prefill.
var passthroughPaths = map[string]float64{
	"/v1/embeddings": 0.25, // OpenAI's and every engine's
	"/v1/score":      0.25, // vLLM's cross-encoder and embedding scoring
	"/score":         0.25,
	"/v1/rerank":     0.25, // vLLM (Jina and Cohere shapes)
	"/rerank":        0.25,
	"/v2/rerank":     0.25,
	"/pooling":       0.25, // vLLM
	"/classify":      0.25,
	"/tokenize":      0, // vLLM, SGLang
	"/detokenize":    0,
}

// handlePassthrough proxies a request to one of passthroughPaths.
func (s *Server) handlePassthrough(ctx *fasthttp.RequestCtx, st *state, path string) {
	in, ok := s.admit(ctx, st)
	if !ok {
		return
	}
	defer in.slot.handlerDone()
	sc := s.getScratch()
	defer s.putScratch(sc)
	req := &sc.req
	if pe := req.parseModel(in.body); pe != nil {
		badRequest(ctx, pe.param, pe.msg)
		s.logRejected(ctx, in.rid, in.t.name, "", fasthttp.StatusBadRequest, in.start, pe.msg)
		return
	}
	// vLLM's pooling and tokenizing requests may leave the model out: it
	// means the one the engine serves (to the tenant).
	p, why := s.poolFor(st, in.t, req.model, req.fields.Model != nil)
	switch {
	case why == noModel:
		badRequest(ctx, "model", "you must provide a model parameter (several models are served)")
		s.logRejected(ctx, in.rid, in.t.name, "", fasthttp.StatusBadRequest, in.start, why)
		return
	case p == nil:
		modelNotFound(ctx, req.model)
		s.logRejected(ctx, in.rid, in.t.name, req.model, fasthttp.StatusNotFound, in.start, why)
		return
	case req.fields.Model == nil:
		req.model = p.cfg.Name
	}
	tokens := int(float64(len(req.body)) * passthroughPaths[path])
	if ok, wait := in.t.tokens.take(float64(tokens), &ctx.Response.Header); !ok {
		s.rateLimited(ctx, in.rid, in.t.name, req.model, in.start, wait, "tokens")
		return
	}
	sc.route = router.Request{PromptTokens: tokens, Unstreamed: true, Auxiliary: true, CandidateBuf: sc.cands}
	x := s.newExchange(in.rid, in.engineID, path, false, in.start, p, req.model)
	if x.lora != "" {
		sc.route.Avoid = p.avoidForAdapter(nil, x.lora)
	}
	sc.route.Avoid, _ = p.avoidForRole(sc.route.Avoid, false)
	if x.lora != "" {
		sc.route.Avoid = p.avoidFullBatches(sc.route.Avoid, x.lora)
	}
	x.pass, x.tenant, x.slot = true, in.t.name, in.slot
	x.priority = in.t.queuePriority(0, false)
	req.dropPriority, req.priorityTo = in.t.capped, x.priority
	s.dispatch(ctx, st, sc, x, "")
}

// parseModel fills r from a pass-through request body: a JSON object whose
// model member (matched as parse matches it), if there is one, names a
// model. Its stream member, if any, is forwarded as it came.
func (r *apiRequest) parseModel(body []byte) *paramError {
	if pe := r.setBody(body); pe != nil {
		return pe
	}
	for m := (members{b: r.body}); m.next(); {
		switch {
		case keyIs(m.key, "model"):
			r.fields.Model = m.value
		case keyIs(m.key, "stream"):
			r.fields.Stream = m.value
		}
	}
	return r.readModel()
}

// rawRelay passes a pass-through answer to the client as it arrives, byte
// for byte: an embeddings batch can be larger than anything worth holding,
// and the proxy reads nothing in it. Like relay it is the response's body
// stream and ends the exchange in Close. A body the engine breaks off
// cannot be mended as an SSE stream is: the client's answer is cut short
// (its connection closed), which HTTP clients report as an error.
type rawRelay struct {
	x      *exchange
	body   streamBody
	resp   *fasthttp.Response
	err    error // how the engine's body ended: io.EOF when whole
	closed bool
	// tail is the answer's last bytes, where OpenAI's and vLLM's answers
	// put their usage (plain answers only: coded is true otherwise).
	tail  [512]byte
	tailN int
	coded bool
}

// keepTail keeps the last len(r.tail) bytes relayed.
func (r *rawRelay) keepTail(b []byte) {
	if len(b) >= len(r.tail) {
		r.tailN = copy(r.tail[:], b[len(b)-len(r.tail):])
		return
	}
	keep := min(r.tailN, len(r.tail)-len(b))
	copy(r.tail[:], r.tail[r.tailN-keep:r.tailN])
	r.tailN = keep + copy(r.tail[keep:], b)
}

// Read serves fasthttp (a body with a length, and chunked ones). After a
// break it keeps failing: fasthttp would end a chunked body properly on a
// later io.EOF.
func (r *rawRelay) Read(p []byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	n, err := r.body.Read(p)
	if n > 0 {
		r.x.heard.Store(coarseNow())
	}
	if !r.coded {
		r.keepTail(p[:n])
	}
	if err != nil {
		r.end(err)
	}
	return n, r.err
}

// WriteTo serves relayUntilClose (HTTP/1.0 clients).
func (r *rawRelay) WriteTo(w io.Writer) (int64, error) {
	// fasthttp writes a sized body through WriteTo too: the buffer is the
	// SSE relays' pooled one, not 32 KiB of garbage per request.
	bufs := relayBufs.Get().(*relayBuffers)
	defer relayBufs.Put(bufs)
	buf := bufs.in[:cap(bufs.in)]
	var total int64
	for {
		n, err := r.Read(buf)
		if n > 0 {
			m, werr := w.Write(buf[:n])
			total += int64(m)
			if werr != nil {
				return total, werr
			}
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}

var errClientLeft = errors.New("the client left")

// end records how the engine's body ended.
func (r *rawRelay) end(err error) {
	x := r.x
	r.err = err
	switch {
	case errors.Is(err, io.EOF):
		x.b.succeed()
		if !r.coded {
			x.usage.read(r.tail[:r.tailN]) // for the tenant's token count
		}
	case (errors.Is(err, backends.ErrAborted) || x.ab.Aborted()) && x.s.live.isCut():
		x.status, x.errMsg = fasthttp.StatusServiceUnavailable, errCutMsg
	case (errors.Is(err, backends.ErrAborted) || x.ab.Aborted()) && x.unresponsive.Load() != nil:
		x.status, x.errMsg = fasthttp.StatusGatewayTimeout, *x.unresponsive.Load()
	case errors.Is(err, backends.ErrAborted) || x.ab.Aborted():
		x.status = 499
	default:
		x.errMsg = "backend " + x.b.cfg.ID + " failed mid-answer: " + err.Error()
		x.b.cutOff("mid-answer: " + err.Error())
		x.status = fasthttp.StatusBadGateway
	}
}

// Close ends the exchange; before the body's end, the client left.
func (r *rawRelay) Close() error {
	if r.closed {
		return nil
	}
	r.closed = true
	if r.err == nil {
		r.err = errClientLeft
		r.x.ab.Abort()
		r.x.status = 499
	}
	r.body.Close()
	fasthttp.ReleaseResponse(r.resp)
	r.x.finish()
	return nil
}
