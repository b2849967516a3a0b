package proxy

import (
	"bytes"
	"strconv"

	"github.com/valyala/fasthttp"
)

// adminMaxConns caps the connections open on admin_listen: probes, scrapes
// and operators' tools need few, and the cap keeps whoever else reaches it
// from taking every file descriptor.
const adminMaxConns = 64

var adminFullAnswers = refusalAnswers("kvproxy's listener for operators (admin_listen) has as many connections open as it takes (" + strconv.Itoa(adminMaxConns) + "); try again")

// operatorOnly reports whether path is served on admin_listen only, when
// kvproxy has one: /metrics and /admin/*. (/v1/kv_events is engines'
// traffic: served on both, so that pushers holding connections open do not
// take admin_listen's from the probes.)
func operatorOnly(path []byte) bool {
	return string(path) == "/metrics" || bytes.HasPrefix(path, adminPrefix)
}

// wrongListener answers 404 to a request the listener it came on does not
// serve: the API on admin_listen, and, with admin_listen configured, the
// operators' endpoints on listen (/live, /health and /v1/kv_events are
// served on both).
func (s *Server) wrongListener(ctx *fasthttp.RequestCtx, cc *countedConn) bool {
	path := ctx.Path()
	if cc != nil && cc.admin {
		if operatorPath(path) {
			return false
		}
		writeError(ctx, fasthttp.StatusNotFound, "this is kvproxy's listener for operators (admin_listen): it serves /live, /health, /metrics, /admin/* and /v1/kv_events; the API is served on listen", "invalid_request_error", "", "not_found")
		s.logUnrouted(ctx, "API request on admin_listen")
		return true
	}
	if s.started.AdminListen == "" || !operatorOnly(path) {
		return false
	}
	writeError(ctx, fasthttp.StatusNotFound, strconv.Quote(string(path))+" is served on kvproxy's listener for operators (admin_listen), not on this one", "invalid_request_error", "", "not_found")
	s.logUnrouted(ctx, "operators' endpoint requested on listen, not admin_listen")
	return true
}
