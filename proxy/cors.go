package proxy

import (
	"bytes"

	"github.com/valyala/fasthttp"
)

var (
	hdrOrigin        = []byte("Origin")
	corsExposed      = []byte("X-Request-Id, X-Kvproxy-Worker, Retry-After")
	corsAllowMethods = []byte("GET, POST, OPTIONS")
	corsAllowHeaders = []byte("Authorization, Content-Type, Content-Encoding, X-Request-Id, Traceparent, Tracestate")
)

// cors answers a browser's request from another origin (cors.allowed_origins):
// it marks the response as readable there, and answers a preflight (an
// OPTIONS naming the method to come) itself, before any key is checked, as
// browsers send no Authorization with it. It reports whether the request
// has been answered.
func (s *Server) cors(ctx *fasthttp.RequestCtx, st *state) bool {
	origin := ctx.Request.Header.PeekBytes(hdrOrigin)
	if len(origin) == 0 {
		return false
	}
	allowed, every := false, false
	for _, o := range st.cfg.CORS.AllowedOrigins {
		if o == "*" {
			allowed, every = true, true
			break
		}
		allowed = allowed || string(origin) == o
	}
	if !allowed {
		return false // the browser keeps the answer from the page
	}
	h := &ctx.Response.Header
	if every {
		h.Set("Access-Control-Allow-Origin", "*")
	} else {
		h.SetBytesV("Access-Control-Allow-Origin", origin)
		h.Add("Vary", "Origin")
	}
	if !ctx.IsOptions() || len(ctx.Request.Header.Peek("Access-Control-Request-Method")) == 0 {
		h.SetBytesV("Access-Control-Expose-Headers", corsExposed)
		return false
	}
	h.SetBytesV("Access-Control-Allow-Methods", corsAllowMethods)
	if asked := ctx.Request.Header.Peek("Access-Control-Request-Headers"); len(bytes.TrimSpace(asked)) > 0 {
		h.SetBytesV("Access-Control-Allow-Headers", asked)
	} else {
		h.SetBytesV("Access-Control-Allow-Headers", corsAllowHeaders)
	}
	h.Set("Access-Control-Max-Age", "600")
	ctx.SetStatusCode(fasthttp.StatusNoContent)
	return true
}
