package proxy

import "time"

// Servers shut down by a test are let go within this (see
// maxIdleWorkerDuration).
func init() { maxIdleWorkerDuration = 200 * time.Millisecond }

// settledHeap is the heap's live bytes once what is already garbage is
// gone: servers earlier tests shut down (their worker pools' cleaners let
// them go within maxIdleWorkerDuration), and objects with finalizers or
// cleanups, which a collection only queues (their goroutine runs them
// later, and the next collection frees them). A single reading after
// runtime.GC counted up to 10 MB that the next one did not.
func settledHeap() int64 {
	time.Sleep(2 * maxIdleWorkerDuration)
	prev := liveHeap()
	for range 20 {
		time.Sleep(20 * time.Millisecond) // finalizers and cleanups run
		h := liveHeap()
		if prev-h < 256<<10 {
			return h
		}
		prev = h
	}
	return prev
}
