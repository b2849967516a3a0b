package proxy

import (
	"bytes"
	"slices"
	"strconv"

	"github.com/valyala/fasthttp"
)

var (
	hdrOrigin        = []byte("Origin")
	corsExposed      = []byte("X-Request-Id, Request-Id, X-Kvproxy-Worker, X-Kvproxy-Prefill-Worker, X-Kvproxy-Overloaded, X-Should-Retry, Retry-After, Retry-After-Ms, X-Ratelimit-Limit-Requests, X-Ratelimit-Remaining-Requests, X-Ratelimit-Reset-Requests, X-Ratelimit-Limit-Tokens, X-Ratelimit-Remaining-Tokens, X-Ratelimit-Reset-Tokens")
	corsAllowMethods = []byte("GET, POST, DELETE, OPTIONS") // DELETE: /v1/responses/{id}
	corsAllowHeaders = []byte("Authorization, Content-Type, Content-Encoding, X-Request-Id, Traceparent, Tracestate")
)

// cors answers a browser's request from another origin (cors.allowed_origins):
// it marks the response as readable there, and answers a preflight (an
// OPTIONS naming the method to come) itself, before any key is checked, as
// browsers send no Authorization with it; a preflight from an origin not
// allowed gets a 400 that says so. It reports whether the request has been
// answered.
func (s *Server) cors(ctx *fasthttp.RequestCtx, st *state) bool {
	origins := st.cfg.CORS.AllowedOrigins
	if len(origins) == 0 || operatorPath(ctx.Path()) {
		return false
	}
	every := slices.Contains(origins, "*")
	h := &ctx.Response.Header
	if !every {
		h.Add("Vary", "Origin") // the answer depends on it, for caches
	}
	origin := ctx.Request.Header.PeekBytes(hdrOrigin)
	if len(origin) == 0 {
		return false
	}
	preflight := ctx.IsOptions() && len(ctx.Request.Header.Peek("Access-Control-Request-Method")) > 0
	if !every && !slices.Contains(origins, string(origin)) {
		if preflight {
			writeError(ctx, fasthttp.StatusBadRequest, "origin "+strconv.Quote(string(origin))+" may not call kvproxy from a browser (cors.allowed_origins)",
				"invalid_request_error", "", "cors_origin_not_allowed")
			return true
		}
		return false // the browser keeps the answer from the page
	}
	if every {
		h.Set("Access-Control-Allow-Origin", "*")
	} else {
		h.SetBytesV("Access-Control-Allow-Origin", origin)
	}
	if !preflight {
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

// operatorPath reports whether path is one of the operator's endpoints
// (admin, metrics, health, KV event pushes): not for browsers, so no web
// page may read them, even where they are open (found by the twelfth
// session's abuse trial: with no keys, any page could read the backends'
// URLs from /admin/backends through its visitors' browsers).
func operatorPath(path []byte) bool {
	switch string(path) {
	case "/metrics", "/health", "/healthz", "/live", "/livez", "/v1/kv_events":
		return true
	}
	return bytes.HasPrefix(path, adminPrefix)
}

var adminPrefix = []byte("/admin/")
