package proxy

import (
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

func unavailable(ctx *fasthttp.RequestCtx, retryAfter int, msg string) {
	ctx.Response.Header.Set("Retry-After", strconv.Itoa(retryAfter))
	writeError(ctx, fasthttp.StatusServiceUnavailable, msg, "service_unavailable", "", "no_backend_available")
}

// shuttingDown answers a request kvproxy will not serve because it is
// shutting down (draining, or cut at the drain deadline), in the shape of a
// cut stream's error event: service_unavailable, code shutting_down.
func shuttingDown(ctx *fasthttp.RequestCtx, msg string) {
	ctx.Response.Header.Set("Connection", "close")
	ctx.Response.Header.Set("Retry-After", "1")
	writeError(ctx, fasthttp.StatusServiceUnavailable, msg, "service_unavailable", "", "shutting_down")
}
