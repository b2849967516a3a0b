package proxy

import (
	"math/rand/v2"
	"strconv"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"
)

// apiError is OpenAI's error object.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

type errorBody struct {
	Error apiError `json:"error"`
}

func errorJSON(msg, typ, param, code string) []byte {
	e := errorBody{Error: apiError{Message: msg, Type: typ}}
	if param != "" {
		e.Error.Param = &param
	}
	if code != "" {
		e.Error.Code = &code
	}
	b, _ := json.Marshal(e)
	return b
}

// writeError answers with an OpenAI error object.
func writeError(ctx *fasthttp.RequestCtx, status int, msg, typ, param, code string) {
	ctx.Response.Header.SetContentType("application/json")
	ctx.SetStatusCode(status)
	ctx.SetBody(errorJSON(msg, typ, param, code))
}

func badRequest(ctx *fasthttp.RequestCtx, param, msg string) {
	writeError(ctx, fasthttp.StatusBadRequest, msg, "invalid_request_error", param, "")
}

func (s *Server) unavailable(ctx *fasthttp.RequestCtx, why unavailableReason, msg string) {
	s.metrics.unavailable.WithLabelValues(string(why)).Inc()
	retryAfterASecond(ctx)
	code := "no_backend_available"
	switch why {
	case whyQueueFull, whyQueueTimeout, whyRemoved, whyNoFiles, whyBodyMemory:
		// Saturation, which a client backs off from, or a reload, past
		// which a retry is served at once: not an outage.
		code = string(why)
	}
	writeError(ctx, fasthttp.StatusServiceUnavailable, msg, "service_unavailable", "", code)
}

// unavailableReason is why kvproxy answered a 503 itself, as
// kvproxy_unavailable_total counts it: saturation (the queue) told apart
// from an outage (no healthy backend) without reading the log.
type unavailableReason string

const (
	whyQueueFull    unavailableReason = "queue_full"                   // every backend at max_concurrency, limits.max_queue waiting
	whyQueueTimeout unavailableReason = "queue_timeout"                // waited limits.queue_timeout for a slot
	whyNoBackend    unavailableReason = "no_healthy_backend"           // the model has none
	whyPinned       unavailableReason = "pinned_backend_unavailable"   // nvext.backend_instance_id's is down or full
	whyOwner        unavailableReason = "response_backend_unavailable" // the backend that holds a previous response is down
	whyRemoved      unavailableReason = "backend_removed"              // a reload removed the chosen one
	whyShuttingDown unavailableReason = "shutting_down"                // draining, or cut at the drain deadline
	whyNoFiles      unavailableReason = "out_of_file_descriptors"      // an engine connection could not be opened: kvproxy's open files limit
	whyBodyMemory   unavailableReason = "body_memory_full"             // a large body found limits.body_memory_mb held by others
)

// unavailableReasons are all of them, for the metric to start at zero.
var unavailableReasons = []unavailableReason{whyQueueFull, whyQueueTimeout, whyNoBackend, whyPinned, whyOwner, whyRemoved, whyShuttingDown, whyNoFiles, whyBodyMemory}

// shuttingDown answers a request kvproxy will not serve because it is
// shutting down (draining, or cut at the drain deadline), in the shape of a
// cut stream's error event: service_unavailable, code shutting_down.
func (s *Server) shuttingDown(ctx *fasthttp.RequestCtx, msg string) {
	s.metrics.unavailable.WithLabelValues(string(whyShuttingDown)).Inc()
	ctx.Response.Header.Set("Connection", "close")
	retryAfterASecond(ctx)
	writeError(ctx, fasthttp.StatusServiceUnavailable, msg, "service_unavailable", "", "shutting_down")
}

// retryAfterASecond says when to retry a 503 of kvproxy's own: Retry-After
// 1, and Retry-After-Ms from 500 to 1,500. The SDKs wait exactly what
// retry-after-ms says, and clients refused together came back together,
// each second (the twenty-ninth session's SDK trial).
func retryAfterASecond(ctx *fasthttp.RequestCtx) {
	ctx.Response.Header.Set("Retry-After", "1")
	ctx.Response.Header.Set("Retry-After-Ms", strconv.Itoa(500+rand.IntN(1001)))
}
