package proxy

import (
	"sync"
	"testing"
	"time"
)

// A backend's full flag follows its slots whatever the order in which a
// release and an acquire reach the lock (found by the eighth session's
// review: a release that freed the only slot, which another request took
// again before the release got the lock, cleared the flag with the slot
// held). A backend left selectable with every slot taken made a request
// re-route in a loop (138,497 Route calls in 2 s) instead of queueing.
func TestFullFlagFollowsTheSlots(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1}]\nlimits: {queue_timeout: 300ms}\n", e)
	b := p.s.st.Load().backends["e0"]
	check := func(when string) {
		t.Helper()
		b.mu.Lock()
		defer b.mu.Unlock()
		if held := b.slots.full(); b.full != held || b.available == held {
			t.Fatalf("%s: slot held %v, full %v, available %v", when, held, b.full, b.available)
		}
	}
	for range 2000 { // a release racing an acquire that takes the freed slot
		if !b.acquire() {
			t.Fatal("acquire")
		}
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); b.release() }()
		go func() {
			defer wg.Done()
			for !b.acquire() {
			}
		}()
		wg.Wait()
		check("after the race")
		b.release()
		check("after the last release")
	}

	// The state the lost update left, made on purpose: the slot held, the
	// flag cleared. The next request's failed acquire restores the flag,
	// and the request queues and times out instead of spinning.
	if !b.acquire() {
		t.Fatal("acquire")
	}
	b.mu.Lock()
	b.full = false
	b.applyLocked()
	b.mu.Unlock()
	start := time.Now()
	resp, body := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 503 || time.Since(start) > 5*time.Second {
		t.Fatalf("a request to a backend whose only slot is held: %d after %v: %s, want 503 after the 300 ms queue timeout",
			resp.StatusCode, time.Since(start), body)
	}
	check("after the refused acquire")
	b.release()
	check("after the release")
	if resp, body := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
		t.Fatalf("after the slot is free: %d %s", resp.StatusCode, body)
	}
	p.waitIdle(t)
}
