package proxy

import (
	"bytes"

	"github.com/valyala/fasthttp"
)

// honourConnectionClose closes the connection after this request when the
// client asked for it in any case or list ("Connection: Close",
// "keep-alive, close": RFC 9110 §7.6.1); fasthttp hears only a bare
// lowercase close.
func honourConnectionClose(ctx *fasthttp.RequestCtx) {
	h := &ctx.Request.Header
	if !h.ConnectionClose() {
		if v := h.Peek(fasthttp.HeaderConnection); len(v) > 0 && hasToken(v, "close") {
			ctx.SetConnectionClose()
		}
	}
}

// refuseAmbiguousFraming refuses a request that declares both
// Content-Length and Transfer-Encoding with a 400 and a closed connection,
// as nginx does: RFC 9112 §6.1 has the server close the connection after
// one, since a front proxy that reads the other header would take the
// bytes after the chunked body for a request of its own (request
// smuggling). fasthttp reads such a body as chunked and kept the
// connection open.
//
// A Transfer-Encoding fasthttp did not read as chunked (identity, which it
// ignores) is refused with a 400 and a closed connection, as RFC 9112 §6.3
// has a request whose last coding is not chunked refused: its body, of no
// length fasthttp heeds, was read as the next request.
func refuseAmbiguousFraming(ctx *fasthttp.RequestCtx) bool {
	h := &ctx.Request.Header
	if h.ContentLength() != -1 { // -1: chunked
		if !hasHeaderLine(h.RawHeaders(), "transfer-encoding") {
			return false
		}
		ctx.SetConnectionClose()
		writeError(ctx, fasthttp.StatusBadRequest, "the request's Transfer-Encoding is not chunked: send its body with Content-Length or chunked",
			"invalid_request_error", "", "unsupported_transfer_encoding")
		return true
	}
	if !hasHeaderLine(h.RawHeaders(), "content-length") {
		return false
	}
	ctx.SetConnectionClose()
	writeError(ctx, fasthttp.StatusBadRequest, "the request declares both Content-Length and Transfer-Encoding: send one of them",
		"invalid_request_error", "", "ambiguous_framing")
	return true
}

// hasToken reports whether a comma-separated header value lists token, in
// any case.
func hasToken(v []byte, token string) bool {
	for item := range bytes.SplitSeq(v, comma) {
		if bytes.EqualFold(bytes.TrimSpace(item), []byte(token)) {
			return true
		}
	}
	return false
}

var comma = []byte(",")

// hasHeaderLine reports whether raw header lines (as received) hold a
// header of this lowercase name, in any case.
func hasHeaderLine(raw []byte, name string) bool {
	for line := range bytes.Lines(raw) {
		if len(line) > len(name) && line[len(name)] == ':' && bytes.EqualFold(line[:len(name)], []byte(name)) {
			return true
		}
	}
	return false
}

// dotSegments reports whether the request target's path has a "." or ".."
// segment, percent-encoded or not. fasthttp resolves them (and decodes
// "%2f" into a separator first), so "/v1/%2e%2e/metrics" and
// "/v1/..%2fadmin/backends" were served as /metrics and /admin/backends:
// past a proxy in front that lets only /v1/ through (the twenty-sixth
// session's security review). No client of the API sends one.
func dotSegments(target []byte) bool {
	if i := bytes.IndexByte(target, '?'); i >= 0 {
		target = target[:i]
	}
	if bytes.IndexByte(target, '.') < 0 && bytes.IndexByte(target, '%') < 0 {
		return false
	}
	dots, start := 0, true // dots in the segment so far, only dots
	for i := 0; i <= len(target); i++ {
		c := byte('/')
		if i < len(target) {
			c = target[i]
			if c == '%' && i+2 < len(target) {
				switch hi, lo := target[i+1], target[i+2]|0x20; {
				case hi == '2' && lo == 'e':
					c, i = '.', i+2
				case hi == '2' && lo == 'f':
					c, i = '/', i+2
				case hi == '5' && lo == 'c':
					c, i = '\\', i+2
				}
			}
		}
		switch {
		case c == '/' || c == '\\':
			if start && (dots == 1 || dots == 2) {
				return true
			}
			dots, start = 0, true
		case c == '.' && start:
			dots++
		default:
			start = false
		}
	}
	return false
}
