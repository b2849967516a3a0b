package proxy

import (
	"fmt"
	"slices"
	"strings"
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
	a, b, c := q.join(0), q.join(0), q.join(0)
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
	a, b, c := q.join(0), q.join(0), q.join(0)
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
	d, e := q.join(0), q.join(0)
	q.wakeAll()
	if !woken(d) || !woken(e) {
		t.Fatal("wakeAll must wake every waiter")
	}
}

// A slot freed while the only waiter routes (it was woken, and a newcomer
// took the slot it woke for) is not lost: the waiter, back to waiting,
// routes again at once (the review: it slept with a backend free).
func TestWaitQueueKeepsAWakeUpNobodyTook(t *testing.T) {
	var q waitQueue
	a := q.join(0)
	q.signal()
	if !woken(a) {
		t.Fatal("the first signal must wake the waiter")
	}
	q.signal() // a routes meanwhile: nobody to wake
	q.rest(a, true)
	if !woken(a) {
		t.Fatal("the wake-up nobody took must go to the waiter that rests")
	}
	q.rest(a, false)
	if woken(a) {
		t.Fatal("a wake-up is kept once only")
	}
	q.leave(a, false)
	b := q.join(0)
	q.rest(b, false)
	if woken(b) {
		t.Fatal("a wake-up with no waiter was kept")
	}
	q.leave(b, false)

	// Two waiters routing when a slot only the first can use frees: the
	// one behind rests first and routes in vain; the first must route
	// again too (review: it slept with the slot free).
	front, behind := q.join(0), q.join(0)
	q.signal()
	q.signal()
	woken(front)
	woken(behind)
	q.signal() // both are routing
	q.rest(behind, true)
	if !woken(behind) {
		t.Fatal("the waiter behind must route again")
	}
	q.rest(behind, true) // in vain: nobody behind it
	q.rest(front, true)
	if !woken(front) {
		t.Fatal("the front waiter slept with the wake-up it could use")
	}
	// An evicted waiter does not take a kept wake-up with it.
	q.signal() // both woken (front routing, behind not): behind is woken
	woken(behind)
	q.signal() // nobody to wake: both keep it
	if !q.evict(-1) {
		t.Fatal("no waiter evicted")
	}
	q.rest(behind, false) // it routed in vain: it finds its eviction when it waits
	if !woken(behind) || !q.wasEvicted(behind) {
		t.Fatal("the evicted waiter does not learn of it")
	}
	q.rest(front, false)
	if !woken(front) {
		t.Fatal("the kept wake-up was lost with the evicted waiter")
	}
	q.leave(front, false)
	q.leave(behind, false)
	if len(q.list) != 0 {
		t.Fatalf("%d waiters left", len(q.list))
	}
}

// Waiters are ordered by priority, lower first, then by arrival; a full
// queue gives the least urgent waiter's place to a more urgent request.
func TestWaitQueuePriorities(t *testing.T) {
	var q waitQueue
	batch1, batch2 := q.join(10), q.join(10)
	chat := q.join(0)
	urgent := q.join(-5)
	chat2 := q.join(0)
	var order []*waiter
	for range 5 {
		q.signal()
		for _, w := range []*waiter{batch1, batch2, chat, urgent, chat2} {
			if woken(w) {
				order = append(order, w)
			}
		}
	}
	if want := []*waiter{urgent, chat, chat2, batch1, batch2}; !slices.Equal(order, want) {
		t.Fatalf("woken in the wrong order")
	}
	for _, w := range order {
		q.leave(w, false)
	}

	a, b := q.join(10), q.join(10)
	if q.evict(10) {
		t.Fatal("evicted a waiter as urgent as the newcomer")
	}
	if !q.evict(0) || !q.wasEvicted(b) || q.wasEvicted(a) || !woken(b) {
		t.Fatal("the newest of the least urgent must make room")
	}
	q.leave(b, false) // out already: nothing to hand on
	if woken(a) {
		t.Fatal("an eviction's wake-up was handed on as a slot's")
	}
	q.signal()
	if !woken(a) {
		t.Fatal("the remaining waiter is first in line")
	}
	q.leave(a, false)
	if len(q.list) != 0 {
		t.Fatalf("%d waiters left", len(q.list))
	}
}

// An engine that does not schedule by priority (vLLM refuses any priority
// but 0 then) gets none for a tenant with a priority, whatever the client
// sent, on every endpoint; a tenant without one sends what it likes.
func TestPriorityOfCappedTenantsStaysOffFCFSEngines(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}'}]
auth: {keys: [{key: key-batch-1234, tenant: batch}, {key: key-free-12345, tenant: free}]}
tenants: [{name: batch, priority: 10}, {name: free}]
`, e)
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"m","priority":-100,"messages":[{"role":"user","content":"hi"}]}`},
		{"/v1/completions", `{"model":"m","priority":5.0,"prompt":"hi"}`},
		{"/v1/embeddings", `{"model":"m","priority":-100,"input":"hi"}`},
		{"/v1/responses", `{"model":"m","priority":-100,"input":"hi"}`},
	} {
		if resp, b := postAuth(t, p.url+c.path, "key-batch-1234", c.body); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", c.path, resp.StatusCode, b)
		}
		if got, ok := e.lastBody()["priority"]; ok {
			t.Fatalf("%s: the engine got priority %v from a capped tenant", c.path, got)
		}
	}
	postAuth(t, p.url+"/v1/chat/completions", "key-free-12345", `{"model":"m","priority":-100,"messages":[{"role":"user","content":"hi"}]}`)
	if got := e.lastBody()["priority"]; got != float64(-100) {
		t.Fatalf("an uncapped tenant's priority reached the engine as %v", got)
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
				w := q.join(0)
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

// A tenant's priority orders its requests in the queue for a slot (lower
// first, as vLLM's priority does), bounds the urgency its requests may ask
// for, is what an engine that schedules by priority is sent for them
// (asked or not: vLLM's default 0 would be more urgent), and lets them take
// the place of a less urgent waiter when the queue is full.
func TestQueuePriorities(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 60 * time.Millisecond })
	p := startProxyYAML(t, `models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}', max_concurrency: 1, priority_scheduling: true}]
auth: {keys: [{key: key-batch-1234, tenant: batch}, {key: key-chat-12345, tenant: chat}]}
tenants: [{name: batch, priority: 10}, {name: chat, priority: 0}]
limits: {max_queue: 4}
`, e)
	type req struct{ name, key, extra string }
	reqs := []req{
		{"hold", "key-batch-1234", ""},
		{"b1", "key-batch-1234", ""},
		{"b2", "key-batch-1234", ""},
		{"b50", "key-batch-1234", `,"priority":50`},
		{"c1", "key-chat-12345", ""},
		{"c2", "key-chat-12345", `,"priority":-20`}, // more urgent than chat may be: 0
	}
	status := make(map[string]int)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, _ := postAuth(t, p.url+"/v1/completions", r.key, `{"model":"m","prompt":"`+r.name+`"`+r.extra+`}`)
			mu.Lock()
			status[r.name] = resp.StatusCode
			mu.Unlock()
		}()
		switch {
		case i == 0:
			waitFor(t, "the first request at the engine", func() bool { return e.requests.Load() == 1 })
		case i < 5:
			waitFor(t, "the request in the queue", func() bool { return p.s.queued.Load() == int64(i) })
		}
	}
	wg.Wait()
	if status["b50"] != 503 || len(status) != 6 {
		t.Fatalf("statuses %v: want b50, the least urgent, displaced by c2 from the full queue", status)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	var order []string
	sent := map[string]any{}
	for _, b := range e.bodies {
		order = append(order, b["prompt"].(string))
		sent[b["prompt"].(string)] = b["priority"]
	}
	if want := []string{"hold", "c1", "c2", "b1", "b2"}; !slices.Equal(order, want) {
		t.Fatalf("the engine got %v, want %v", order, want)
	}
	if sent["c2"] != float64(0) || sent["c1"] != float64(0) || sent["b1"] != float64(10) || sent["hold"] != float64(10) {
		t.Fatalf("priorities sent: %v; want the tenants' (c2's -20 capped to 0)", sent)
	}
	if !strings.Contains(p.logs.String(), "a more urgent request took this one's place") {
		t.Fatalf("the displaced request's log line is missing:\n%s", p.logs.String())
	}
	p.waitIdle(t)
}
