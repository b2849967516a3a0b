package proxy

import (
	"sync"
	"testing"
)

// Concurrent signals close every channel handed out before them, each once.
func TestWaitQueueSignals(t *testing.T) {
	q := newWaitQueue()
	q.waiters.Add(1)
	first := q.changed()
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				ch := q.changed()
				q.signal()
				<-ch // closed by this signal or a concurrent one
			}
		}()
	}
	wg.Wait()
	select {
	case <-first:
	default:
		t.Fatal("a signal did not close the channel taken before it")
	}
	select {
	case <-q.changed():
		t.Fatal("the current channel is closed with no signal after it")
	default:
	}
	q.waiters.Add(-1)
	ch := q.changed()
	q.signal() // no waiters: nothing to wake
	if ch != q.changed() {
		t.Fatal("a signal with no waiters replaced the channel")
	}
}
