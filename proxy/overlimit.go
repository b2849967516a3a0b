package proxy

import (
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/valyala/fasthttp"
)

// overLimitBody notes a request whose body was declared over its limit
// (HeaderReceived), by its header: fasthttp resets the request before it
// reports the wait for its first byte timing out.
type overLimitBody struct {
	at     time.Time
	known  bool                    // its key is one kvproxy knows: a 413, not the 401
	header *fasthttp.RequestHeader // a copy: the answer's shape, CORS and request id come from it
}

// overLimitNotes holds those notes until the request is answered, for
// declaredBodyWait and a second at most. A request whose client hangs up
// before its body, or that an Expect: 100-continue answer refuses, is never
// answered through a note: notes older than that are swept, at most once a
// second, and there are at most maxOverLimitNotes. A note is filed under
// its header's address, not a pointer to it, so that it does not keep
// fasthttp's pooled request alive (the soak trial: 35 KB a hang-up, without
// end, reachable without a key).
type overLimitNotes struct {
	mu    sync.Mutex
	notes map[uintptr]overLimitBody
	swept time.Time
	held  atomic.Int32 // len(notes), read without the lock (pending)
}

// maxOverLimitNotes bounds the notes kept at once: beyond it a request
// waiting to send an over-limit body gets the body timeout's answer.
const maxOverLimitNotes = 4096

// noteTTL is how long a note is of use.
const noteTTL = declaredBodyWait + time.Second

func headerKey(h *fasthttp.RequestHeader) uintptr { return uintptr(unsafe.Pointer(h)) }

// add files a note for h.
func (n *overLimitNotes) add(h *fasthttp.RequestHeader, note overLimitBody) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.notes == nil {
		n.notes = make(map[uintptr]overLimitBody)
	}
	if note.at.Sub(n.swept) > time.Second {
		n.swept = note.at
		for k, v := range n.notes {
			if note.at.Sub(v.at) > noteTTL {
				delete(n.notes, k)
			}
		}
	}
	if len(n.notes) < maxOverLimitNotes {
		n.notes[headerKey(h)] = note
	}
	n.held.Store(int32(len(n.notes)))
}

// pending reports whether h has a note: every request's question, answered
// without the lock while there is none.
func (n *overLimitNotes) pending(h *fasthttp.RequestHeader) bool {
	if n.held.Load() == 0 {
		return false
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	_, ok := n.notes[headerKey(h)]
	return ok
}

// take removes h's note and returns it, if there is one of use.
func (n *overLimitNotes) take(h *fasthttp.RequestHeader) (overLimitBody, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	note, ok := n.notes[headerKey(h)]
	if ok {
		delete(n.notes, headerKey(h))
		n.held.Store(int32(len(n.notes)))
	}
	return note, ok && time.Since(note.at) <= noteTTL
}

// clear drops h's note, if any, with one atomic load when there is none.
func (n *overLimitNotes) clear(h *fasthttp.RequestHeader) {
	if n.held.Load() > 0 {
		n.drop(h)
	}
}

// drop removes h's note: its request was answered otherwise.
func (n *overLimitNotes) drop(h *fasthttp.RequestHeader) {
	n.mu.Lock()
	delete(n.notes, headerKey(h))
	n.held.Store(int32(len(n.notes)))
	n.mu.Unlock()
}

// len is how many notes are kept.
func (n *overLimitNotes) len() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.notes)
}
