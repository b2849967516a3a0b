package proxy

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

func woken(w *waiter) bool {
	select {
	case <-w.wake:
		return true
	default:
		return false
	}
}

// A freed slot wakes the oldest waiter not yet woken, and only it.
func TestWaitQueueWakesInOrder(t *testing.T) {
	var q waitQueue
	a, b, c := q.join(), q.join(), q.join()
	q.signal()
	if !woken(a) || woken(b) || woken(c) {
		t.Fatal("the first signal must wake the first waiter alone")
	}
	q.signal() // a has not routed yet: the next slot is b's
	if !woken(b) || woken(c) {
		t.Fatal("a second signal must wake the second waiter")
	}
	// a lost its slot to someone else and waits again, in its place: the
	// next slot is its.
	q.rest(a, false)
	q.signal()
	if !woken(a) || woken(c) {
		t.Fatal("a waiter that rested keeps its place")
	}
	// a cannot use what is free (pass): the wake-up goes behind it, to c
	// (b is woken already).
	q.rest(a, true)
	if !woken(c) || woken(a) {
		t.Fatal("rest with pass must wake the first waiter behind, not woken")
	}
	q.leave(a, false)
	q.leave(b, false)
	q.leave(c, false)
	if len(q.list) != 0 {
		t.Fatalf("%d waiters left", len(q.list))
	}
}

// A wake-up its waiter left without using goes to the next one, and so does
// one when the waiter routed while backends stay available.
func TestWaitQueueLeavePassesOn(t *testing.T) {
	var q waitQueue
	a, b, c := q.join(), q.join(), q.join()
	q.signal()        // a's
	q.leave(a, false) // timed out with the wake-up unread
	if !woken(b) {
		t.Fatal("an unused wake-up must go to the next waiter")
	}
	q.leave(b, true) // routed; backends still available
	if !woken(c) {
		t.Fatal("a waiter that routed with capacity left must wake the next")
	}
	q.leave(c, false)
	q.wakeAll() // nobody: nothing happens
	d, e := q.join(), q.join()
	q.wakeAll()
	if !woken(d) || !woken(e) {
		t.Fatal("wakeAll must wake every waiter")
	}
}

// Concurrent joins, signals and leaves keep the list consistent (-race).
func TestWaitQueueConcurrent(t *testing.T) {
	var q waitQueue
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 300; i++ {
				w := q.join()
				q.signal()
				<-w.wake // this signal's, or another goroutine's
				q.rest(w, i%2 == 0)
				q.leave(w, i%3 == 0)
			}
		}()
	}
	wg.Wait()
	if len(q.list) != 0 {
		t.Fatalf("%d waiters left", len(q.list))
	}
}

// Requests waiting for a backend slot get it in the order they came: each
// freed slot went to whichever of the waiters, all woken, routed first, and
// under overload some waited until queue_timeout while later ones passed.
func TestQueuedRequestsAreServedInOrder(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 60 * time.Millisecond })
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]\n", e)
	const n = 8
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, body := post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"request %d"}`, i))
			if resp.StatusCode != 200 {
				t.Errorf("request %d: %d %s", i, resp.StatusCode, body)
			}
		}()
		if i == 0 {
			waitFor(t, "the first request at the engine", func() bool { return e.requests.Load() == 1 })
		} else {
			waitFor(t, "the request in the queue", func() bool { return p.s.queued.Load() == int64(i) })
		}
	}
	wg.Wait()
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, b := range e.bodies {
		if want := fmt.Sprintf("request %d", i); b["prompt"] != want {
			var got []any
			for _, b := range e.bodies {
				got = append(got, b["prompt"])
			}
			t.Fatalf("the engine got %v, want them in the order they came", got)
		}
	}
	p.waitIdle(t)
}
