package proxy

import (
	"fmt"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
)

// overBudget answers a request whose body (what: the request's, or the
// engine's answer) found limits.body_memory_mb held by other large bodies.
func (s *Server) overBudget(ctx *fasthttp.RequestCtx, what string) {
	s.unavailable(ctx, whyBodyMemory, fmt.Sprintf("kvproxy holds its limit of memory for bodies over 1 MiB (limits.body_memory_mb: %d MiB) and has no room for %s; retry", s.bodyMem.Limit()>>20, what))
}

// heldBodies is what the answers a request read whole, and its body
// decompressed, hold of the server's budget for large bodies: given back
// when fasthttp resets the request, after the answer (which may be a copy
// of one) went out.
type heldBodies struct {
	mem *backends.Budget
	n   int64
}

type heldBodiesKey struct{}

func (h *heldBodies) Close() error {
	h.mem.Give(h.n)
	h.n = 0
	return nil
}

// hold keeps n bytes of the budget, taken by an engine's answer read whole
// (DoWhole) or a request body decompressed, until the request is reset.
func (s *Server) hold(ctx *fasthttp.RequestCtx, n int64) {
	if n == 0 {
		return
	}
	if h, ok := ctx.UserValue(heldBodiesKey{}).(*heldBodies); ok {
		h.n += n
		return
	}
	ctx.SetUserValue(heldBodiesKey{}, &heldBodies{mem: s.bodyMem, n: n})
}

// letGoBodies gives back what the request's bodies hold of the budget
// ahead of the request's reset, before its connection is hijacked: when
// the hijack fails (the flush of an answer before it, to a client that
// reset the connection), fasthttp never resets the request, and its share
// stayed taken for good (the review). The buffers go with the request.
func letGoBodies(ctx *fasthttp.RequestCtx) { bodiesOf(ctx).Close() }

// requestBodies is what a request's bodies hold of the budget, to give
// back (Close) at a moment of kvproxy's choosing. Giving back twice, here
// and at the request's reset, gives back once.
type requestBodies struct {
	buffer *bodyBuffer
	held   *heldBodies
}

func bodiesOf(ctx *fasthttp.RequestCtx) requestBodies {
	bb, _ := ctx.UserValue(bodyBufferKey{}).(*bodyBuffer)
	h, _ := ctx.UserValue(heldBodiesKey{}).(*heldBodies)
	return requestBodies{bb, h}
}

func (r requestBodies) Close() error {
	if r.buffer != nil {
		r.buffer.giveBack()
	}
	if r.held != nil {
		r.held.Close()
	}
	return nil
}

// heldBy is what the request's bodies hold of the budget now.
func heldBy(ctx *fasthttp.RequestCtx) int64 {
	var n int64
	if bb, ok := ctx.UserValue(bodyBufferKey{}).(*bodyBuffer); ok {
		n += bb.held
	}
	if h, ok := ctx.UserValue(heldBodiesKey{}).(*heldBodies); ok {
		n += h.n
	}
	return n
}
