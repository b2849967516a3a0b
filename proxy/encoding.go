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
	// Decompressed, it holds memory of its own, counted as it grows, with
	// its compressed copy (before, only once whole: a request without a
	// tenant's max_concurrency decompressed up to twice the body limit
	// uncounted; the review).
	share := budgetShare{s.bodyMem, heldBy(ctx)}
	var held int64
	body, held, err = decoded(lower, raw, max, share)
	if err != nil && string(lower) == "deflate" && !errors.Is(err, fasthttp.ErrBodyTooLarge) && !overBudget(err) {
		// "deflate" is zlib-wrapped by the standard; some clients send the
		// raw stream.
		body, held, err = inflateRaw(raw, max, share)
	}
	switch {
	case err == nil:
		s.hold(ctx, held)
		return body, true
	case overBudget(err):
		s.unreadBody(ctx, err, max)
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

// bodyRefusal is the log's reason for a request whose body requestBody
// refused with status (the log said "undecodable body" of a 413).
func bodyRefusal(status int) string {
	switch status {
	case fasthttp.StatusRequestEntityTooLarge:
		return "body too large"
	case fasthttp.StatusServiceUnavailable:
		return "no room for the body in limits.body_memory_mb"
	case fasthttp.StatusRequestTimeout:
		return "body not received in time"
	case fasthttp.StatusUnsupportedMediaType:
		return "unsupported Content-Encoding"
	}
	return "undecodable body"
}

// unreadBody answers a request whose body rawBody could not read, or
// could not decompress for want of room; what the body holds goes now,
// not once the rest of it is drained.
func (s *Server) unreadBody(ctx *fasthttp.RequestCtx, err error, max int) {
	if bb, ok := ctx.UserValue(bodyBufferKey{}).(*bodyBuffer); ok {
		bb.drop()
	}
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
				if n > 0 && len(b) == max {
					// Over the limit: no array grown (and charged) for a
					// byte past it (the review).
					return nil, fasthttp.ErrBodyTooLarge
				}
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

// drop lets go of a refused body's array past maxPooledBody, and its
// share of the budget.
func (bb *bodyBuffer) drop() {
	bb.giveBack()
	if cap(bb.b) > maxPooledBody {
		bb.b = nil
	}
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

// inflateRaw decompresses a raw DEFLATE stream of at most max bytes, as
// decoded does.
func inflateRaw(b []byte, max int, share budgetShare) ([]byte, int64, error) {
	r := flate.NewReader(bytes.NewReader(b))
	defer r.Close()
	w := newCappedBuffer(len(b), max, share)
	if _, err := io.Copy(w, r); err != nil {
		w.giveBack()
		return nil, 0, err
	}
	return w.joined()
}

// budgetShare is where a body's memory past backends.Untracked is charged
// (a nil mem: nowhere), and what its request holds there besides.
type budgetShare struct {
	mem *backends.Budget
	own int64
}

// overBudget reports whether err is the budget's refusal.
func overBudget(err error) bool {
	return errors.Is(err, backends.ErrOverBudget) || errors.Is(err, backends.ErrBeyondBudget)
}

// cappedBuffer collects what is written to it, up to max bytes: a write
// past them fails with ErrBodyTooLarge. It collects in chunks that double
// in size (to 4 MiB), joined once at the end, so a decompression bomb costs
// the limit and nothing more (fasthttp's pooled buffers and io.ReadAll
// double past the limit: a body at a 32 MiB limit took 64 MiB, and the
// buffers before it 64 more), and a whole body twice its size while it is
// joined. Once its chunks pass backends.Untracked they are charged to its
// share of the budget as they are made (its errors).
type cappedBuffer struct {
	full  [][]byte // filled chunks, n bytes
	n     int
	cur   []byte
	max   int
	first int // the first chunk's size

	share     budgetShare
	allocated int   // the chunks' sizes
	held      int64 // what they took of share.mem
}

// newCappedBuffer is a cappedBuffer for what in bytes of compressed input
// decompress to: its first chunk is a few times that, up to
// backends.Untracked (a larger one, charged whole before a byte was
// written, refused a body of random bytes that fit: the review).
func newCappedBuffer(in, max int, share budgetShare) *cappedBuffer {
	return &cappedBuffer{max: max, first: min(max, 4*in+512, backends.Untracked), share: share}
}

// newChunk makes cur an empty chunk of size bytes, charged if need be.
func (c *cappedBuffer) newChunk(size int) error {
	if total := c.allocated + size; total > backends.Untracked {
		if err := c.take(total); err != nil {
			return err
		}
	}
	c.allocated += size
	c.cur = make([]byte, 0, size)
	return nil
}

// take makes the buffer's share of the budget size bytes.
func (c *cappedBuffer) take(size int) error {
	if err := c.share.mem.Reserve(int64(size)-c.held, c.share.own+int64(size)); err != nil {
		return err
	}
	c.held = int64(size)
	return nil
}

// giveBack returns what the buffer took of the budget.
func (c *cappedBuffer) giveBack() {
	c.share.mem.Give(c.held)
	c.held = 0
}

func (c *cappedBuffer) Write(p []byte) (int, error) {
	if len(p) > c.max-c.n-len(c.cur) {
		return 0, fasthttp.ErrBodyTooLarge
	}
	written := len(p)
	for len(p) > 0 {
		if len(c.cur) == cap(c.cur) {
			size := c.first
			if c.allocated > 0 {
				c.full = append(c.full, c.cur)
				c.n += len(c.cur)
				size = min(max(2*cap(c.cur), 4<<10), 4<<20, c.max-c.n)
			}
			if err := c.newChunk(size); err != nil {
				return written - len(p), err
			}
		}
		k := copy(c.cur[len(c.cur):cap(c.cur)], p)
		c.cur = c.cur[:len(c.cur)+k]
		p = p[k:]
	}
	return written, nil
}

// joined is what was written, in one slice no larger than it needs (the
// first chunk, sized before the output was known, may be four times what
// filled it: the review, 3 MiB of incompressible data held a 12 MiB
// array), and what it holds of the budget: its array's size past
// backends.Untracked, else nothing. The chunks are let go; the join is
// charged while both are held (ErrOverBudget: nothing is held then).
func (c *cappedBuffer) joined() ([]byte, int64, error) {
	n := c.n + len(c.cur)
	if c.n == 0 && (cap(c.cur)-len(c.cur) <= 64<<10 || cap(c.cur)-len(c.cur) <= len(c.cur)/8) {
		if c.cur == nil {
			return []byte{}, 0, nil
		}
		return c.cur, c.held, nil // the chunk itself
	}
	if n > backends.Untracked {
		if err := c.take(c.allocated + n); err != nil {
			c.giveBack()
			return nil, 0, err
		}
	}
	b := make([]byte, 0, n)
	for _, f := range c.full {
		b = append(b, f...)
	}
	b = append(b, c.cur...)
	c.full, c.cur = nil, nil
	if n > backends.Untracked {
		c.share.mem.Give(c.held - int64(n))
		return b, int64(n), nil
	}
	c.giveBack()
	return b, 0, nil
}

// decoded is body decompressed from coding, no larger than max. fasthttp's
// decoders write into a cappedBuffer (its own ...WithLimit ones collect
// into a buffer that doubles past the limit); zstd kvproxy decodes itself.
//
// Its memory is charged to share (as cappedBuffer's): held is what the
// body holds of it, on success; on failure it holds nothing.
func decoded(coding, body []byte, max int, share budgetShare) (out []byte, held int64, err error) {
	w := newCappedBuffer(len(body), max, share)
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
		return nil, 0, fasthttp.ErrContentEncodingUnsupported
	}
	if err != nil {
		w.giveBack()
		return nil, 0, err
	}
	return w.joined()
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
