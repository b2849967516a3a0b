package proxy

import (
	"bytes"

	"github.com/kvproxy/kvproxy/backends"
)

// sseFramer cuts a byte stream into Server-Sent Events: the bytes up to and
// including the blank line that ends each event. Lines may end in \n, \r\n or
// \r (the SSE grammar). Events come out the same however the stream is split
// into reads; a \r at the end of the data waits for the next byte, which may
// make it \r\n.
//
// Use: read into free(), commit(n), then next() until it reports false.
type sseFramer struct {
	buf        []byte
	start, end int
	scanned    int // from start: the first line not yet ended (earlier ones hold no blank line)
	// mem is where a buffer grown past backends.Untracked is charged:
	// twice its size, for it and the batch's copy of its events (six
	// streams of one large event each held 550 MB uncounted: the chaos
	// trial). held is what it took; refused is mem's refusal of a
	// growth (Budget.Reserve's errors), the buffer left as it was.
	mem     *backends.Budget
	held    int64
	refused error
	// own is what the stream's exchange holds of mem besides (a whole
	// answer's events), so that a growth that can never fit is refused
	// as beyond the budget, not as room others hold.
	own *int64
}

// maxSSEEvent bounds one event, as backends.Upstream bounds a whole answer:
// a stream that never ends its event must not be buffered without limit.
// An engine's largest, a first chunk with the prompt logprobs of a long
// prompt, can reach megabytes.
const maxSSEEvent = 64 << 20

// tooLarge reports whether the event being read has reached maxSSEEvent.
func (f *sseFramer) tooLarge() bool { return f.end-f.start >= maxSSEEvent }

func newSSEFramer(buf []byte) *sseFramer { return &sseFramer{buf: buf[:cap(buf)]} }

// reset empties the framer for another stream; its buffer, and what that
// holds of mem, stay.
func (f *sseFramer) reset() {
	*f = sseFramer{buf: f.buf[:cap(f.buf)], mem: f.mem, held: f.held, own: f.own}
}

// free returns space to read into, compacting or growing the buffer; nil
// when mem refused its growth (refused).
func (f *sseFramer) free() []byte {
	if f.start > 0 {
		f.end = copy(f.buf, f.buf[f.start:f.end])
		f.start = 0
	}
	if f.end == len(f.buf) {
		size := 2*len(f.buf) + 512 // one event larger than the buffer
		if size > backends.Untracked {
			// Charged twice, a buffer grows to half the budget at most:
			// doubled past it, an event of a quarter was refused (the
			// review).
			if half := f.mem.Limit() / 2; int64(size) > half && half > int64(len(f.buf)) {
				size = int(half)
			}
			need, own := 2*int64(size), int64(0)
			if f.own != nil {
				own = *f.own
			}
			if err := f.mem.Reserve(need-f.held, need+own); err != nil {
				f.refused = err
				return nil
			}
			f.held = need
		}
		nb := make([]byte, size)
		copy(nb, f.buf[:f.end])
		f.buf = nb
	}
	return f.buf[f.end:]
}

func (f *sseFramer) commit(n int) { f.end += n }

// release gives back what the buffer took of mem.
func (f *sseFramer) release() {
	f.mem.Give(f.held)
	f.held = 0
}

// next returns the next complete event with its terminating blank line
// (raw) and without it (content).
func (f *sseFramer) next() (raw, content []byte, ok bool) {
	b := f.buf[f.start:f.end]
	contentEnd, total := eventEnd(b, f.scanned)
	if contentEnd < 0 {
		f.scanned = total // resume there: a large event is not scanned again from its start
		return nil, nil, false
	}
	f.start += total
	f.scanned = 0
	return b[:total], b[:contentEnd], true
}

// atEOF tells the framer the stream is over: a \r at its very end ends a
// line, as it cannot become \r\n any more (an engine framing with \r alone
// ends its last event with one).
func (f *sseFramer) atEOF() {
	if f.end > f.start && f.buf[f.end-1] == '\r' {
		if b := f.free(); b != nil {
			b[0] = '\n' // \r\n: the same line end
			f.commit(1)
		}
	}
}

// endEvent ends the event being read (the stream is over): its blank line
// is added, and next returns it.
func (f *sseFramer) endEvent() {
	p := f.pending()
	if len(p) == 0 {
		return
	}
	end := "\n\n"
	if p[len(p)-1] == '\n' {
		end = "\n"
	}
	for i := range len(end) {
		b := f.free()
		if b == nil {
			return // refused: the event stays incomplete
		}
		b[0] = end[i]
		f.commit(1)
	}
}

// hasSSEField reports whether event holds a line of an SSE field (data,
// event, id, retry) or a comment, leading blanks aside.
func hasSSEField(event []byte) bool {
	for len(event) > 0 {
		line := event
		if i := bytes.IndexAny(event, "\r\n"); i >= 0 {
			line, event = event[:i], event[i+1:]
		} else {
			event = nil
		}
		line = bytes.TrimLeft(line, " \t") // as some servers indent them (a stream typed as JSON)
		if len(line) > 0 && line[0] == ':' {
			return true
		}
		name := line
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			name = line[:i]
		}
		switch string(name) {
		case "data", "event", "id", "retry":
			return true
		}
	}
	return false
}

// commentsOnly reports whether every line of event is a comment or blank
// (a ping). It reads no further than the first line that is neither: an
// event's data is not scanned.
func commentsOnly(event []byte) bool {
	for len(event) > 0 {
		switch event[0] {
		case ' ', '\t', '\r', '\n':
			event = event[1:]
		case ':':
			i := bytes.IndexAny(event, "\r\n")
			if i < 0 {
				return true
			}
			event = event[i+1:]
		default:
			return false
		}
	}
	return true
}

// lastEventWhole reports whether p, what a stream that ended cleanly left
// after its last blank line, is an event that lacks only that blank line:
// its last line ended, or a data: [DONE] line without its end.
func lastEventWhole(p []byte) bool {
	if len(bytes.TrimSpace(p)) == 0 {
		return false
	}
	if p[len(p)-1] == '\n' {
		return true
	}
	line := p[bytes.LastIndexByte(p, '\n')+1:]
	return bytes.HasPrefix(line, dataPrefix) && bytes.Equal(bytes.TrimLeft(line[len(dataPrefix):], " "), doneData)
}

// pending is the start of an event not yet complete.
func (f *sseFramer) pending() []byte { return f.buf[f.start:f.end] }

// eventEnd finds the blank line ending the first event of b, scanning from
// from, the start of a line (the lines before it are known not to be
// blank): the length of the event's content and of the event with its blank
// line, or -1 and the start of the line not yet ended when b holds no
// complete event yet.
func eventEnd(b []byte, from int) (contentEnd, total int) {
	pos := from // start of the current line
	for pos < len(b) {
		end, n := lineEnd(b[pos:])
		if end < 0 {
			return -1, pos
		}
		if end == 0 { // an empty line: the event ends
			return pos, pos + n
		}
		pos += end + n
	}
	return -1, pos
}

// lineEnd finds the first line terminator of b: where it starts and its
// length (\n, \r\n or \r), or -1 when there is none yet (a final \r may still
// become \r\n). The common \n-only case takes two vectorised scans.
func lineEnd(b []byte) (int, int) {
	i := bytes.IndexByte(b, '\n')
	limit := len(b)
	if i >= 0 {
		limit = i
	}
	if j := bytes.IndexByte(b[:limit], '\r'); j >= 0 {
		if j+1 == len(b) {
			return -1, 0
		}
		if b[j+1] == '\n' {
			return j, 2
		}
		return j, 1
	}
	if i < 0 {
		return -1, 0
	}
	return i, 1
}
