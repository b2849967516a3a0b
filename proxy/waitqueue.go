package proxy

import (
	"slices"
	"sync"
)

// waitQueue holds a model's requests waiting for a backend slot (every
// backend they may use is at its max_concurrency), by priority (lower
// first, as vLLM orders its own queue), then in arrival order. A slot
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
//
// When limits.max_queue is reached, a request takes the place of the least
// urgent waiter, if that one is less urgent (evict): batch traffic queued
// first does not turn interactive traffic away.
type waitQueue struct {
	mu   sync.Mutex
	list []*waiter
}

type waiter struct {
	wake    chan struct{} // a wake-up, buffered: none is lost before the waiter waits
	prio    int
	woken   bool // woken and not yet back to waiting (under mu)
	evicted bool // taken out of the queue by a more urgent request (under mu)
	// again: a wake-up came while it was woken already and found no
	// waiter to wake (it routed, and may lose its slot to a newcomer): it
	// routes again when it rests, as does every waiter woken then, since
	// the capacity may be one only some of them can use (under mu).
	again bool
}

// join adds a waiter of priority prio, behind those of the same or lower.
func (q *waitQueue) join(prio int) *waiter {
	w := &waiter{wake: make(chan struct{}, 1), prio: prio}
	q.mu.Lock()
	i := len(q.list)
	for i > 0 && q.list[i-1].prio > prio {
		i--
	}
	q.list = slices.Insert(q.list, i, w)
	q.mu.Unlock()
	return w
}

// evict takes the last waiter out of the queue, if it is less urgent than
// prio, and wakes it to find itself evicted; it reports whether it did.
func (q *waitQueue) evict(prio int) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := len(q.list)
	if n == 0 || q.list[n-1].prio <= prio {
		return false
	}
	w := q.list[n-1]
	q.list = slices.Delete(q.list, n-1, n)
	w.evicted = true
	if w.woken {
		q.wakeLocked(0) // the wake-up it has, or is routing on, may be a slot's
	}
	w.wakeUp()
	return true
}

// wasEvicted reports whether evict took w out.
func (q *waitQueue) wasEvicted(w *waiter) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return w.evicted
}

// leave removes w. A wake-up it got and did not use goes to the next
// waiter, and so does one when it leaves with a slot while available
// backends remain (more).
func (q *waitQueue) leave(w *waiter, more bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if w.evicted {
		return // out already; its wake-up was the eviction's
	}
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
// first waiter behind it that is not woken is. A wake-up that came while
// it routed and found no one to wake (again) has it route again.
func (q *waitQueue) rest(w *waiter, pass bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	w.woken = false
	if w.evicted {
		return // its wake-up is the eviction's
	}
	if w.again {
		w.again = false
		w.wakeUp()
		return
	}
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
	for _, w := range q.list {
		if !w.woken {
			w.wakeUp()
		}
	}
	q.mu.Unlock()
}

// wakeLocked wakes the first waiter from list[from] on that is not woken,
// and reports whether there was one. A wake-up from the front that finds
// every waiter woken already is kept by each of them (again).
func (q *waitQueue) wakeLocked(from int) bool {
	for _, w := range q.list[min(from, len(q.list)):] {
		if !w.woken {
			w.wakeUp()
			return true
		}
	}
	if from == 0 {
		for _, w := range q.list {
			w.again = true
		}
	}
	return false
}

// wakeUp marks w woken and gives it a wake-up unless it has one waiting
// (under mu).
func (w *waiter) wakeUp() {
	w.woken = true
	select {
	case w.wake <- struct{}{}:
	default:
	}
}
