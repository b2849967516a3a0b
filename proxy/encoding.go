package proxy

import (
	"bytes"
	"compress/flate"
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"strings"
	"sync"

	"github.com/klauspost/compress/zstd"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
)

// requestBody is the request's body, decompressed when the client sent it
// with a Content-Encoding (gzip, deflate, br or zstd: what the SDKs and
// HTTP clients send), and no larger than max once decompressed. When it
// fails it has written the error and returns ok false.
func (s *Server) requestBody(ctx *fasthttp.RequestCtx, max int) (body []byte, ok bool) {
	raw, err := rawBody(ctx, max, s.bodyMem)
	if err != nil {
		s.unreadBody(ctx, err, max)
		return nil, false
	}
	enc := ctx.Request.Header.ContentEncoding()
	if len(enc) == 0 || string(enc) == "identity" {
		return raw, true
	}
	// Content codings are case-insensitive.
	lower := bytes.ToLower(bytes.TrimSpace(enc))
	if string(lower) == "identity" {
		return raw, true
	}
	body, err = decoded(lower, raw, max)
	if err != nil && string(lower) == "deflate" && !errors.Is(err, fasthttp.ErrBodyTooLarge) {
		// "deflate" is zlib-wrapped by the standard; some clients send the
		// raw stream.
		body, err = inflateRaw(raw, max)
	}
	switch {
	case err == nil && len(body) > backends.Untracked:
		// Decompressed, it holds memory of its own: counted once it is
		// (the decoder stops at max).
		if err := s.bodyMem.Reserve(int64(len(body)), heldBy(ctx)+int64(len(body))); err != nil { // with its compressed copy
			s.unreadBody(ctx, err, max)
			return nil, false
		}
		s.hold(ctx, int64(len(body)))
		return body, true
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
	case string(lower) == "zstd" && strings.Contains(err.Error(), "exceed"):
		// klauspost's words for a frame whose window is over the bound
		// ("window size exceeded", or "decompressed size exceeds
		// configured limit" for a single-segment frame), which read as
		// the body's size (the review).
		badRequest(ctx, "", fmt.Sprintf("the zstd body needs a window over %d MiB (RFC 9659's limit): compress it without --long or --ultra", zstdMaxWindow>>20))
	default:
		badRequest(ctx, "", fmt.Sprintf("the request body is not valid %s data: %v", lower, err))
	}
	return nil, false
}

// unreadBody answers a request whose body rawBody could not read.
func (s *Server) unreadBody(ctx *fasthttp.RequestCtx, err error, max int) {
	var ne net.Error
	switch {
	case errors.Is(err, backends.ErrOverBudget):
		ctx.SetConnectionClose() // the rest of the body is not read
		s.overBudget(ctx, "the request body")
	case errors.Is(err, backends.ErrBeyondBudget):
		ctx.SetConnectionClose()
		writeError(ctx, fasthttp.StatusRequestEntityTooLarge, fmt.Sprintf("request body larger than kvproxy holds at once (limits.body_memory_mb: %d MiB)", s.bodyMem.Limit()>>20), "invalid_request_error", "", "request_too_large")
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		writeError(ctx, fasthttp.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds the limit of %d bytes", max), "invalid_request_error", "", "request_too_large")
	case errors.As(err, &ne) && ne.Timeout():
		ctx.SetConnectionClose()
		writeError(ctx, fasthttp.StatusRequestTimeout, "the request was not received in time", "invalid_request_error", "", "request_timeout")
	default: // the client went away mid-body, or sent a malformed chunk
		ctx.SetConnectionClose()
		badRequest(ctx, "", "the request body was not received whole")
	}
}

// prefetchedBody is how much of a streamed body fasthttp reads with its
// headers (StreamRequestBody): a body of a declared length up to this is
// whole in the request's pooled buffer when the handler runs.
const prefetchedBody = 8 << 10

// rawBody reads the request's body as it came, failing with
// ErrBodyTooLarge past max bytes. Bodies are streamed (the server's
// StreamRequestBody): fasthttp reading them before the handler allocated
// the declared Content-Length at once, so a tenant's connections, each
// declaring the limit and sending a byte a second, held 32 MB each. Here
// the buffer grows as bytes arrive, to the declared length at most, and
// the handler reads the body once its checks have passed (admit: the key,
// the tenant's rate and max_concurrency). A buffer over backends.Untracked
// takes its size from mem as it grows (ErrOverBudget when it cannot).
func rawBody(ctx *fasthttp.RequestCtx, max int, mem *backends.Budget) ([]byte, error) {
	req := &ctx.Request
	cl := req.Header.ContentLength()
	if cl > max {
		return nil, fasthttp.ErrBodyTooLarge
	}
	if !req.IsBodyStream() || (cl >= 0 && cl <= prefetchedBody) {
		// Read already, or small enough to be (the common case): fasthttp's
		// own buffer, with nothing more from the connection.
		if b := req.Body(); len(b) <= max {
			return b, nil
		}
		return nil, fasthttp.ErrBodyTooLarge
	}
	if beyondBudget(cl, mem) {
		// Refused before any of it is read: read, it would have taken the
		// whole budget from every other body first.
		return nil, backends.ErrBeyondBudget
	}
	end := max + 1 // chunked: one byte past the limit says it is over
	if cl >= 0 {
		end = cl // the stream stops there
	}
	bb := newBodyBuffer(0)
	ctx.SetUserValue(bodyBufferKey{}, bb) // back to its pool when the request is reset
	b := bb.b
	r := req.BodyStream()
	for len(b) < end {
		if len(b) == cap(b) {
			if cl < 0 {
				// Chunked, the array full: a byte more, or the end? Grown
				// to read the end, the array held, and was charged, up to
				// twice the body: a body the budget's size was refused
				// (the review).
				var probe [1]byte
				n, err := r.Read(probe[:])
				if n > 0 {
					var gerr error
					if b, gerr = bb.grown(b, end, mem); gerr != nil {
						return nil, gerr
					}
					b = append(b, probe[0])
				}
				if err == io.EOF {
					break
				}
				if err != nil {
					return nil, err
				}
				continue
			}
			var err error
			if b, err = bb.grown(b, end, mem); err != nil {
				return nil, err
			}
		}
		n, err := r.Read(b[len(b):min(cap(b), end)])
		b = b[:len(b)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	if len(b) > max {
		return nil, fasthttp.ErrBodyTooLarge // the rest is drained (finishBody)
	}
	if cl >= 0 && len(b) < cl {
		return nil, io.ErrUnexpectedEOF
	}
	if cl < 0 {
		// Chunked: the array doubled as the body came, and once more to
		// read its end, up to twice its length (the review: a waiting
		// stream's chunked 300 KB prompt held a 512 KiB array).
		b = bb.fit(b)
	}
	req.SetBodyRaw(b) // closes the stream: the body was read whole
	return b, nil
}

// beyondBudget reports whether a body declared cl bytes long (fasthttp's
// Content-Length: negative when chunked or none) could never fit in mem.
func beyondBudget(cl int, mem *backends.Budget) bool {
	return cl > backends.Untracked && int64(cl) > mem.Limit()
}

// bodyBuffer holds a body rawBody read. Its array is pooled: a body over
// the prefetch took about twice its size in new memory per request, where
// fasthttp's own buffer is reused. fasthttp closes a request's io.Closer
// user values when it resets the request, as it releases its own body:
// the body lives exactly as long as before.
type bodyBuffer struct {
	b []byte
	// mem and held: what the buffer took of the server's budget for large
	// bodies, given back with it.
	mem  *backends.Budget
	held int64
}

// take makes the buffer's share of mem size bytes (mem.Reserve's errors).
func (bb *bodyBuffer) take(mem *backends.Budget, size int) error {
	if err := mem.Reserve(int64(size)-bb.held, int64(size)); err != nil {
		return err
	}
	bb.mem, bb.held = mem, int64(size)
	return nil
}

// giveBack returns the buffer's share of the budget; the buffer itself
// goes back to its pool when the request is reset (Close).
func (bb *bodyBuffer) giveBack() {
	bb.mem.Give(bb.held)
	bb.mem, bb.held = nil, 0
}

type bodyBufferKey struct{}

// Body arrays are pooled by size class, from minPooledBody to
// maxPooledBody in quarter steps of each power of two (16, 20, 24, 28, 32,
// 40 KiB...), each class a pool of buffers holding an empty array of its
// size, so a body holds an array at most a quarter over its length (or
// minPooledBody), whatever bodies came before it. With one pool, small
// bodies took the arrays large ones left, and held up to 1 MiB each,
// uncharged, for their whole request; with classes a power of two apart,
// a waiting stream's 300 KB prompt held a 512 KiB array.
//
// Arrays over maxPooledBody, where the budget starts counting, go to the
// garbage collector. Pooled, they went wrong whichever body took them:
// charged whole, a body of half their size held twice its room (503s, and
// 502s for requests that fit alone); charged as the body grew into them, a
// small body pinned them uncharged (the soak and two reviews). Bodies that
// large are rare, and their prompts cost far more to tokenize than to
// allocate.
const (
	minPooledBody = 2 * prefetchedBody
	maxPooledBody = backends.Untracked
)

var (
	bodyClassSizes []int // ascending, from minPooledBody to maxPooledBody
	bodyBuffers    []sync.Pool
)

func init() {
	for size := minPooledBody; size < maxPooledBody; size *= 2 {
		for q := 4; q < 8; q++ {
			bodyClassSizes = append(bodyClassSizes, size/4*q)
		}
	}
	bodyClassSizes = append(bodyClassSizes, maxPooledBody)
	if bodyClassSizes[len(bodyClassSizes)-2] >= maxPooledBody {
		panic("proxy: maxPooledBody is not minPooledBody times a power of two")
	}
	bodyBuffers = make([]sync.Pool, len(bodyClassSizes))
	for c, size := range bodyClassSizes {
		bodyBuffers[c].New = func() any { return &bodyBuffer{b: make([]byte, 0, size)} }
	}
}

// bodyClass is the class of the smallest pooled array of at least n
// bytes (n ≤ maxPooledBody).
func bodyClass(n int) int {
	return sort.SearchInts(bodyClassSizes, n)
}

// newBodyBuffer is a pooled buffer with an empty array of at least n
// bytes (n ≤ maxPooledBody).
func newBodyBuffer(n int) *bodyBuffer {
	return bodyBuffers[bodyClass(n)].Get().(*bodyBuffer)
}

// regrown is b moved into a pooled array of at least size bytes
// (size ≤ maxPooledBody); the buffer's old array goes back to its pool.
func (bb *bodyBuffer) regrown(b []byte, size int) []byte {
	nb := newBodyBuffer(size)
	bb.b, nb.b = append(nb.b, b...), bb.b
	nb.Close()
	return bb.b
}

// grown is b, the buffer's body, in an array about twice its size (up to
// end bytes, and what mem has room for): pooled up to maxPooledBody, past
// it charged to mem (its errors).
func (bb *bodyBuffer) grown(b []byte, end int, mem *backends.Budget) ([]byte, error) {
	size := mem.Grown(len(b), min(end, 2*cap(b)), 0)
	if size <= maxPooledBody { // not charged
		return bb.regrown(b, size), nil
	}
	if err := bb.take(mem, size); err != nil {
		return nil, err
	}
	nb := make([]byte, len(b), size)
	copy(nb, b)
	if cap(bb.b) <= maxPooledBody { // the pooled array goes back
		(&bodyBuffer{b: bb.b}).Close()
	}
	bb.b = nb
	return nb, nil
}

// fit moves b, the buffer's body, into the pooled array of its class, or
// past maxPooledBody into one of its length, whose room is all the buffer
// keeps of the budget, if its array is larger.
func (bb *bodyBuffer) fit(b []byte) []byte {
	n := len(b)
	if n > maxPooledBody {
		if cap(b) > n {
			b = append(make([]byte, 0, n), b...)
			bb.b = b
			bb.mem.Give(bb.held - int64(n))
			bb.held = int64(n)
		}
		return b
	}
	if cap(b) <= bodyClassSizes[bodyClass(n)] {
		return b
	}
	bb.giveBack() // an array past maxPooledBody, charged, goes
	return bb.regrown(b, n)
}

func (bb *bodyBuffer) Close() error {
	bb.giveBack()
	if c := cap(bb.b); c <= maxPooledBody {
		if k := bodyClass(c); bodyClassSizes[k] == c { // only an array of its class's size
			bb.b = bb.b[:0]
			bodyBuffers[k].Put(bb)
		}
	}
	return nil
}

// inflateRaw decompresses a raw DEFLATE stream of at most max bytes.
func inflateRaw(b []byte, max int) ([]byte, error) {
	r := flate.NewReader(bytes.NewReader(b))
	defer r.Close()
	w := newCappedBuffer(len(b), max)
	if _, err := io.Copy(w, r); err != nil {
		return nil, err
	}
	return w.bytes(), nil
}

// cappedBuffer collects what is written to it, up to max bytes: a write
// past them fails with ErrBodyTooLarge. It collects in chunks that double
// in size (to 4 MiB), joined once at the end, so a decompression bomb costs
// the limit and nothing more (fasthttp's pooled buffers and io.ReadAll
// double past the limit: a body at a 32 MiB limit took 64 MiB, and the
// buffers before it 64 more), and a whole body twice its size while it is
// joined.
type cappedBuffer struct {
	full [][]byte // filled chunks, n bytes
	n    int
	cur  []byte
	max  int
}

// newCappedBuffer is a cappedBuffer for what in bytes of compressed input
// decompress to: its first chunk is a few times that.
func newCappedBuffer(in, max int) *cappedBuffer {
	return &cappedBuffer{cur: make([]byte, 0, min(max, 4*in+512)), max: max}
}

func (c *cappedBuffer) Write(p []byte) (int, error) {
	if len(p) > c.max-c.n-len(c.cur) {
		return 0, fasthttp.ErrBodyTooLarge
	}
	written := len(p)
	for len(p) > 0 {
		if len(c.cur) == cap(c.cur) {
			c.full = append(c.full, c.cur)
			c.n += len(c.cur)
			c.cur = make([]byte, 0, min(max(2*cap(c.cur), 4<<10), 4<<20, c.max-c.n))
		}
		k := copy(c.cur[len(c.cur):cap(c.cur)], p)
		c.cur = c.cur[:len(c.cur)+k]
		p = p[k:]
	}
	return written, nil
}

// bytes is what was written, in one slice no larger than it needs: the
// first chunk, sized before the output was known, may be four times what
// filled it, and the budget charges a body its length (the review: 3 MiB
// of incompressible data held a 12 MiB array, charged 3).
func (c *cappedBuffer) bytes() []byte {
	if c.n == 0 {
		if spare := cap(c.cur) - len(c.cur); spare > 64<<10 && spare > len(c.cur)/8 {
			return bytes.Clone(c.cur)
		}
		return c.cur
	}
	b := make([]byte, 0, c.n+len(c.cur))
	for _, f := range c.full {
		b = append(b, f...)
	}
	return append(b, c.cur...)
}

// decoded is body decompressed from coding, no larger than max. fasthttp's
// decoders write into a cappedBuffer (its own ...WithLimit ones collect
// into a buffer that doubles past the limit); zstd kvproxy decodes itself.
func decoded(coding, body []byte, max int) ([]byte, error) {
	w := newCappedBuffer(len(body), max)
	var err error
	switch string(coding) {
	case "gzip", "x-gzip": // RFC 9110 section 8.4.1.3: x-gzip is gzip
		_, err = fasthttp.WriteGunzip(w, body)
	case "deflate":
		_, err = fasthttp.WriteInflate(w, body)
	case "br":
		_, err = fasthttp.WriteUnbrotli(w, body)
	case "zstd":
		err = unzstd(w, body)
	default:
		return nil, fasthttp.ErrContentEncodingUnsupported
	}
	if err != nil {
		return nil, err
	}
	return w.bytes(), nil
}

// zstdMaxWindow bounds the window a zstd body may need: 8 MiB, RFC 9659's
// limit for the zstd content coding, and what the zstd tool uses up to
// level 19 (--long and --ultra ask for up to 2 GiB). The decoder allocates
// the window a frame declares: at 64 MiB a 10-byte body took 64 MiB, at
// any body limit (the fuzzing trial).
const zstdMaxWindow = 8 << 20

// unzstd decompresses a zstd body into w, with a decoder of its own that
// it closes. fasthttp's (v1.74) puts its pooled decoder back mid-stream
// when the limit stops it, never closed: every body over the limit leaked
// the decoder's goroutines and window for good (a 10 KB bomb held 125 MB;
// found by the twelfth session's abuse trial).
func unzstd(w io.Writer, b []byte) error {
	d, err := zstd.NewReader(bytes.NewReader(b), zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(zstdMaxWindow), zstd.WithDecoderLowmem(true))
	if err != nil {
		return err
	}
	defer d.Close()
	_, err = io.Copy(w, d)
	return err
}
