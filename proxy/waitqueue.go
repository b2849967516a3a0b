package proxy

import (
	"slices"
	"sync"
)

// waitQueue holds a model's requests waiting for a backend slot (every
// backend they may use is at its max_concurrency), in arrival order. A slot
// that frees wakes the oldest waiter not already woken, and only it: waking
// every waiter at each freed slot had them all route again, hundreds of
// route calls per slot under overload, and served them in no order, so a
// waiter could lose every race until queue_timeout while later arrivals
// went first.
//
// A waiter that wakes and cannot route keeps its place. If a backend is
// available all the same (one it may not use: another adapter's, a shorter
// context), it hands the wake-up to the waiter behind it (rest), and one
// that routes wakes the next while backends stay available (leave), so
// capacity that frees at once (a backend back up) is taken in order too.
type waitQueue struct {
	mu   sync.Mutex
	list []*waiter
}

type waiter struct {
	wake  chan struct{} // a wake-up, buffered: none is lost before the waiter waits
	woken bool          // woken and not yet back to waiting (under mu)
}

// join appends a new waiter.
func (q *waitQueue) join() *waiter {
	w := &waiter{wake: make(chan struct{}, 1)}
	q.mu.Lock()
	q.list = append(q.list, w)
	q.mu.Unlock()
	return w
}

// leave removes w. A wake-up it got and did not use goes to the next
// waiter, and so does one when it leaves with a slot while available
// backends remain (more).
func (q *waitQueue) leave(w *waiter, more bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i, o := range q.list {
		if o == w {
			q.list = slices.Delete(q.list, i, i+1)
			break
		}
	}
	unused := false
	select {
	case <-w.wake:
		unused = true
	default:
	}
	if unused || more {
		q.wakeLocked(0)
	}
}

// rest returns a woken waiter that could not route to waiting, in its
// place; with pass set (a backend is available that it may not use), the
// first waiter behind it that is not woken is.
func (q *waitQueue) rest(w *waiter, pass bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	w.woken = false
	if !pass {
		return
	}
	for i, o := range q.list {
		if o == w {
			q.wakeLocked(i + 1)
			return
		}
	}
}

// signal wakes the oldest waiter not already woken: a slot freed.
func (q *waitQueue) signal() {
	q.mu.Lock()
	q.wakeLocked(0)
	q.mu.Unlock()
}

// wakeAll wakes every waiter: the backends changed (a reload).
func (q *waitQueue) wakeAll() {
	q.mu.Lock()
	for range q.list {
		if !q.wakeLocked(0) {
			break
		}
	}
	q.mu.Unlock()
}

// wakeLocked wakes the first waiter from list[from] on that is not woken,
// and reports whether there was one.
func (q *waitQueue) wakeLocked(from int) bool {
	for _, w := range q.list[min(from, len(q.list)):] {
		if !w.woken {
			w.woken = true
			select {
			case w.wake <- struct{}{}:
			default:
			}
			return true
		}
	}
	return false
}
