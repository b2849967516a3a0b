package proxy

import (
	"bytes"
	"compress/flate"
	"errors"
	"fmt"
	"io"

	"github.com/klauspost/compress/zstd"
	"github.com/valyala/fasthttp"
)

// requestBody is the request's body, decompressed when the client sent it
// with a Content-Encoding (gzip, deflate, br or zstd: what the SDKs and
// HTTP clients send), and no larger than max once decompressed. When it
// fails it has written the error and returns ok false.
func requestBody(ctx *fasthttp.RequestCtx, max int) (body []byte, ok bool) {
	enc := ctx.Request.Header.ContentEncoding()
	if len(enc) == 0 || string(enc) == "identity" {
		return ctx.PostBody(), true
	}
	// Content codings are case-insensitive; fasthttp matches lowercase.
	lower := bytes.ToLower(bytes.TrimSpace(enc))
	ctx.Request.Header.SetContentEncodingBytes(lower)
	if string(lower) == "identity" {
		return ctx.PostBody(), true
	}
	body, err := uncompressed(lower, ctx.PostBody(), max, ctx.Request.BodyUncompressedWithLimit)
	if err != nil && string(lower) == "deflate" && !errors.Is(err, fasthttp.ErrBodyTooLarge) {
		// "deflate" is zlib-wrapped by the standard; some clients send the
		// raw stream.
		body, err = inflateRaw(ctx.PostBody(), max)
	}
	switch {
	case err == nil:
		return body, true
	case errors.Is(err, fasthttp.ErrContentEncodingUnsupported):
		writeError(ctx, fasthttp.StatusUnsupportedMediaType,
			fmt.Sprintf("unsupported Content-Encoding %q: send the body uncompressed or as gzip, deflate, br or zstd", enc),
			"invalid_request_error", "", "unsupported_content_encoding")
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		writeError(ctx, fasthttp.StatusRequestEntityTooLarge,
			fmt.Sprintf("the request body is larger than %d bytes once decompressed", max),
			"invalid_request_error", "", "request_too_large")
	default:
		badRequest(ctx, "", fmt.Sprintf("the request body is not valid %s data: %v", lower, err))
	}
	return nil, false
}

// inflateRaw decompresses a raw DEFLATE stream of at most max bytes.
func inflateRaw(b []byte, max int) ([]byte, error) {
	r := flate.NewReader(bytes.NewReader(b))
	defer r.Close()
	return readAtMost(r, max)
}

// readAtMost reads r to its end, failing with ErrBodyTooLarge past max bytes.
func readAtMost(r io.Reader, max int) ([]byte, error) {
	out, err := io.ReadAll(io.LimitReader(r, int64(max)+1))
	if err != nil {
		return nil, err
	}
	if len(out) > max {
		return nil, fasthttp.ErrBodyTooLarge
	}
	return out, nil
}

// uncompressed is body decompressed from coding, no larger than max:
// fasthttp's decoding (decode), but for zstd, which kvproxy decodes itself.
func uncompressed(coding, body []byte, max int, decode func(max int) ([]byte, error)) ([]byte, error) {
	if string(coding) == "zstd" {
		return unzstd(body, max)
	}
	return decode(max)
}

// zstdMaxWindow bounds the window a zstd body may need: what the zstd tool
// uses up to level 19 is 8 MiB; --long and --ultra ask for up to 2 GiB, which
// a request body has no use for.
const zstdMaxWindow = 64 << 20

// unzstd decompresses a zstd body of at most max bytes, with a decoder of
// its own that it closes. fasthttp's (v1.74) puts its pooled decoder back
// mid-stream when the limit stops it, never closed: every body over the
// limit leaked the decoder's goroutines and window for good (a 10 KB bomb
// held 125 MB; found by the twelfth session's abuse trial).
func unzstd(b []byte, max int) ([]byte, error) {
	d, err := zstd.NewReader(bytes.NewReader(b), zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(zstdMaxWindow), zstd.WithDecoderLowmem(true))
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return readAtMost(d, max)
}
