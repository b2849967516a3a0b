package router

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kvproxy/kvproxy/kv"
)

func conversation(prefix []kv.BlockHash, salt uint64) *Request {
	h := append(slices.Clone(prefix), seq(16, salt)...) // a question of 256 tokens
	return &Request{Hashes: h, PromptTokens: len(h) * 16}
}

// A prefix every request begins with, held by one of two workers, is copied
// to the other once the holder is busier by more than the miss amortised
// over the requests that began with it; after that, requests go to either
// worker with a hit. The copy's predicted TTFT still counts the miss.
func TestPopularPrefixIsCopiedToAnIdleWorker(t *testing.T) {
	r, _ := New(DefaultConfig())
	r.AddWorker("a")
	r.AddWorker("b")
	system := seq(64, 1) // 1,024 tokens: ≈ 16 ms of prefill
	var holder WorkerID
	copied := -1
	for i := range 30 {
		d, a, err := r.Route(conversation(system, uint64(100+i)))
		if err != nil {
			t.Fatal(err)
		}
		a.PrefillDone() // decoding until the test ends: the holders get busier
		defer a.Free()
		if i == 0 {
			holder = d.Worker
			continue
		}
		if d.Worker != holder && copied < 0 {
			copied = i
			c := d.Candidates[candIndex(d.Candidates, d.Worker)]
			if c.Overlap != 0 || c.ReplicaMs <= 0 || c.ReplicaMs >= c.CostMs || d.PredictedTTFTms != c.CostMs || c.CostMs < 16 {
				t.Fatalf("the copy's candidate %+v, predicted %.1f ms: want a priced miss of the 64 blocks, credited in part", c, d.PredictedTTFTms)
			}
		}
		if copied > 0 && i > copied && d.Overlap < len(system) {
			t.Fatalf("request %d went to %s with %d blocks cached, after the copy to both", i, d.Name, d.Overlap)
		}
	}
	if copied < 0 {
		t.Fatal("30 requests beginning with one prompt all went to its holder, the other worker idle")
	}
	t.Logf("copied at request %d", copied)
}

// A conversation's own history is begun by few requests: it is not copied,
// its next turn goes back to the worker that holds it though that worker is
// the busier.
func TestConversationHistoryIsNotCopied(t *testing.T) {
	r, _ := New(DefaultConfig())
	r.AddWorker("a")
	r.AddWorker("b")
	var firsts []*Request
	var holder [4]WorkerID
	for i := range 4 {
		q := conversation(seq(64, uint64(10+i)), uint64(200+i))
		d, a, err := r.Route(q)
		if err != nil {
			t.Fatal(err)
		}
		a.PrefillDone()
		defer a.Free()
		firsts, holder[i] = append(firsts, q), d.Worker
	}
	// One more decoding request on conversation 0's worker.
	_, a, _ := r.Route(&Request{Hashes: seq(8, 99), PromptTokens: 128, Pinned: true, Pin: holder[0]})
	a.PrefillDone()
	defer a.Free()
	next := conversation(firsts[0].Hashes, 300)
	d, err := r.Select(next)
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker != holder[0] {
		t.Fatalf("turn two went to %s, away from its history: candidates %+v", d.Name, d.Candidates)
	}
	for _, c := range d.Candidates {
		if c.ReplicaMs != 0 {
			t.Fatalf("candidate %s credited %.2f ms for a conversation's history", c.Name, c.ReplicaMs)
		}
	}
}

// Shares are over the last one to two windows of requests: a prefix no
// longer asked for stops being popular.
func TestPopularityForgets(t *testing.T) {
	p := newPopularity()
	hot := seq(20, 1)
	for range 100 {
		p.record(hot)
	}
	p.mu.Lock()
	s := p.countLocked(hot[0])
	p.mu.Unlock()
	if s != 100 || p.n != 100 {
		t.Fatalf("count %d of %d, want 100 of 100", s, p.n)
	}
	for i := range 2 * popWindow {
		p.record(seq(20, uint64(1000+i)))
	}
	p.mu.Lock()
	s, ok := p.countLocked(hot[0]), len(p.cur)+len(p.prev) <= 2*popWindow*len(sampled(20))
	p.mu.Unlock()
	if s != 0 || !ok {
		t.Fatalf("count %d after two windows of other prefixes (want 0); %d entries kept", s, len(p.cur)+len(p.prev))
	}
}

func sampled(n int) []int {
	var ds []int
	for d := 1; d <= n; d = nextDepth(d) {
		ds = append(ds, d)
	}
	return ds
}

func eightWorkers() *Router {
	r, _ := New(DefaultConfig())
	for _, n := range []string{"a", "b", "c", "d", "e", "f", "g", "h"} {
		r.AddWorker(n)
	}
	return r
}

// live routes requests with the given prompt to worker w, past their first
// token and not ended (the caller frees them).
func live(t *testing.T, r *Router, w WorkerID, prompts ...[]kv.BlockHash) (as []*Active) {
	for _, h := range prompts {
		_, a, err := r.Route(&Request{Hashes: h, PromptTokens: len(h) * 16, Pinned: true, Pin: w})
		if err != nil {
			t.Fatal(err)
		}
		a.PrefillDone()
		as = append(as, a)
	}
	return as
}

func freeAll(as []*Active) {
	for _, a := range as {
		a.Free()
	}
}

// 200 requests began with a system prompt of 64 blocks. Worker a runs a
// conversation that holds it and 12 blocks of history (76: no sampled
// depth lies between 64 and 76), b two that share the prompt alone. The
// conversation's next turn stays on a: b is credited nothing for the
// history, which only a holds, and no worker is credited past the prompt.
func TestHistoryPastAPopularPromptIsNotCredited(t *testing.T) {
	r := eightWorkers()
	system := seq(64, 1)
	for i := range 200 {
		r.pop.record(append(slices.Clone(system), seq(4, uint64(1000+i))...))
	}
	history := append(slices.Clone(system), seq(12, 77)...)
	defer freeAll(live(t, r, 0, history))
	defer freeAll(live(t, r, 1, append(slices.Clone(system), seq(4, 5)...), append(slices.Clone(system), seq(4, 6)...)))
	d, err := r.Select(&Request{Hashes: append(slices.Clone(history), seq(4, 78)...), PromptTokens: 80 * 16})
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker != 0 || d.Candidates[1].ReplicaMs != 0 {
		t.Fatalf("turn went to %s; a %+v; b %+v", d.Name, d.Candidates[0], d.Candidates[1])
	}
	x := d.Candidates[2].CostMs - d.Candidates[1].CostMs // c's miss of the system prompt
	if c := d.Candidates[2]; c.ReplicaMs <= 0 || c.ReplicaMs > x {
		t.Fatalf("c, lacking the prompt (%.2f ms of it), credited %.2f ms", x, c.ReplicaMs)
	}
}

// A worker lacking a popular prompt is credited all of its blocks, though
// the deepest sampled depth (63) falls short of its end (64), amortised over
// the 200 requests that began with it.
func TestWholePopularPromptIsCredited(t *testing.T) {
	r := eightWorkers()
	system := seq(64, 1)
	for i := range 200 {
		r.pop.record(append(slices.Clone(system), seq(4, uint64(1000+i))...))
	}
	defer freeAll(live(t, r, 0, append(slices.Clone(system), seq(4, 5)...), append(slices.Clone(system), seq(4, 6)...)))
	d, _ := r.Select(&Request{Hashes: append(slices.Clone(system), seq(4, 78)...), PromptTokens: 68 * 16})
	a, b := d.Candidates[0], d.Candidates[1]
	x := b.CostMs - (a.CostMs - 0.002*float64(a.ActiveBlocks)) // b's miss: a's cost less its decode pressure
	if b.ReplicaMs < x*0.99 || b.ReplicaMs > x {
		t.Fatalf("b, lacking the prompt (%.2f ms of it), credited %.2f ms, want %.2f", x, b.ReplicaMs, x*202/203)
	}
}

// tenTurns runs ten turns of one conversation, 800 tokens more each, on r,
// one after the other: its history and the worker that holds it.
func tenTurns(t *testing.T, r *Router) (history []kv.BlockHash, holder WorkerID) {
	for turn := range 10 {
		history = append(history, seq(50, uint64(500+turn))...)
		d, a, err := r.Route(&Request{Hashes: slices.Clone(history), PromptTokens: len(history) * 16})
		if err != nil {
			t.Fatal(err)
		}
		a.PrefillDone()
		a.Free()
		holder = d.Worker
	}
	return history, holder
}

// One user's conversation on an idle fleet: it is all the traffic, but no
// other live request holds its history when its next turn is routed, so
// nothing is credited. The turn stays with its history while the holder's
// queue costs less than computing it elsewhere (8,000 tokens, ≈ 197 ms).
func TestOneConversationStaysWithItsHistory(t *testing.T) {
	for _, queued := range []int{400, 4400} {
		r := eightWorkers()
		history, holder := tenTurns(t, r)
		_, a, _ := r.Route(&Request{Hashes: seq(queued/16, 9), PromptTokens: queued, Pinned: true, Pin: holder})
		next := append(slices.Clone(history), seq(50, 600)...)
		d, _ := r.Select(&Request{Hashes: next, PromptTokens: len(next) * 16})
		a.Free()
		if d.Worker != holder {
			t.Fatalf("%d tokens queued on the holder (%.1f ms predicted): the turn left for %s (%.1f ms)",
				queued, d.Candidates[candIndex(d.Candidates, holder)].CostMs, d.Name, d.PredictedTTFTms)
		}
		for _, c := range d.Candidates {
			if c.ReplicaMs != 0 {
				t.Fatalf("%d tokens queued: %s credited %.1f ms for the history", queued, c.Name, c.ReplicaMs)
			}
		}
	}
}

// The same conversation with an earlier request of its own still running
// on the holder (a parallel tool call, say): one live request holds the
// history, which makes it no shared prefix, and the next turn stays.
func TestConversationWithARequestInFlightStaysWithItsHistory(t *testing.T) {
	r := eightWorkers()
	history, holder := tenTurns(t, r)
	defer freeAll(live(t, r, holder, append(slices.Clone(history), seq(10, 800)...)))
	_, a, _ := r.Route(&Request{Hashes: seq(4400/16, 9), PromptTokens: 4400, Pinned: true, Pin: holder})
	defer a.Free()
	next := append(slices.Clone(history), seq(10, 600)...)
	d, _ := r.Select(&Request{Hashes: next, PromptTokens: len(next) * 16})
	if d.Worker != holder {
		t.Fatalf("the turn left its history for %s (%.1f ms predicted against %.1f)", d.Name, d.PredictedTTFTms, d.Candidates[candIndex(d.Candidates, holder)].CostMs)
	}
	for _, c := range d.Candidates {
		if c.ReplicaMs != 0 {
			t.Fatalf("%s credited %.1f ms for the history", c.Name, c.ReplicaMs)
		}
	}
}

// More busy holders than the list of workers with live requests holds
// (64): the count falls back to asking every holder, deeper too.
func TestLiveRequestsCountedOnManyHolders(t *testing.T) {
	r, _ := New(DefaultConfig())
	for i := 0; i < 128; i++ {
		r.AddWorker(fmt.Sprintf("w%d", i))
	}
	system := seq(300, 1)
	var as []*Active
	for w := WorkerID(0); w < 100; w++ {
		as = append(as, live(t, r, w, append(slices.Clone(system), seq(4, uint64(w)+100)...))...)
	}
	defer freeAll(as)
	for i := range 300 {
		r.pop.record(append(slices.Clone(system), seq(4, uint64(1000+i))...))
	}
	d, _ := r.Select(conversation(system, 5))
	holder := d.Candidates[0]
	x := d.Candidates[120].CostMs - (holder.CostMs - 0.002*float64(holder.ActiveBlocks))
	if c := d.Candidates[120]; c.ReplicaMs < 0.9*x {
		t.Fatalf("a worker lacking the prompt that 100 of 128 hold and all live requests share credited %.2f of %.2f ms", c.ReplicaMs, x)
	}
}

// Three system prompts on four workers, the first held by two of them.
// Live, it is a quarter of the requests, one worker's share, so its two
// holders are enough and the others are credited nothing, however busy the
// two are. At five eighths of the live requests they are not.
func TestReplicatedPrefixIsNotCredited(t *testing.T) {
	r, _ := New(DefaultConfig())
	for _, n := range []string{"a", "b", "c", "d"} {
		r.AddWorker(n)
	}
	prompts := [3][]kv.BlockHash{seq(64, 1), seq(64, 2), seq(64, 3)}
	for i := range 300 {
		r.pop.record(conversation(prompts[i%3], uint64(1000+i)).Hashes)
	}
	var as []*Active
	for w := WorkerID(0); w < 2; w++ {
		as = append(as, live(t, r, w, conversation(prompts[0], uint64(10+w)).Hashes, seq(400, uint64(50+w)))...) // and 6,400 tokens
	}
	as = append(as, live(t, r, 2, conversation(prompts[1], 12).Hashes, conversation(prompts[1], 13).Hashes)...)
	as = append(as, live(t, r, 3, conversation(prompts[2], 14).Hashes, conversation(prompts[2], 15).Hashes)...)
	defer func() { freeAll(as) }()
	d, _ := r.Select(conversation(prompts[0], 7))
	for _, c := range d.Candidates {
		if c.ReplicaMs != 0 {
			t.Fatalf("%s credited %.1f ms for a prompt two of four workers hold at a quarter of the live requests", c.Name, c.ReplicaMs)
		}
	}
	for w := WorkerID(0); w < 2; w++ {
		for i := range 4 {
			as = append(as, live(t, r, w, conversation(prompts[0], uint64(100+4*int(w)+i)).Hashes)...)
		}
	}
	if d, _ = r.Select(conversation(prompts[0], 8)); d.Candidates[2].ReplicaMs <= 0 {
		t.Fatalf("at five eighths of the live requests on two of four workers, c credited %.1f ms", d.Candidates[2].ReplicaMs)
	}
}

// A request routed again (a retry, a moved stream, a prefill stage) or an
// auxiliary one is not counted again.
func TestRepeatsAreCountedOnce(t *testing.T) {
	r, _ := New(DefaultConfig())
	r.AddWorker("a")
	r.AddWorker("b")
	q := conversation(seq(64, 1), 2)
	for _, repeat := range []bool{false, true, true} {
		q.Repeat = repeat
		_, a, err := r.Route(q)
		if err != nil {
			t.Fatal(err)
		}
		a.Free()
	}
	_, a, _ := r.Route(&Request{Hashes: q.Hashes, PromptTokens: 1280, Auxiliary: true})
	a.Free()
	r.pop.mu.Lock()
	c, n := r.pop.countLocked(q.Hashes[0]), r.pop.n
	r.pop.mu.Unlock()
	if c != 1 || n != 1 {
		t.Fatalf("counted %d requests beginning with the prompt, %d in all; want 1 and 1", c, n)
	}
}

// A copy is amortised over the requests that began with the prompt: two
// did, so a worker lacking it is credited two thirds of the miss, and the
// next request stays with the holder, busier by two decoding requests only.
func TestFewUsesAreNotWorthACopy(t *testing.T) {
	r, _ := New(DefaultConfig())
	r.AddWorker("a")
	r.AddWorker("b")
	system := seq(64, 1)
	defer freeAll(live(t, r, 0, conversation(system, 2).Hashes, conversation(system, 3).Hashes))
	d, _ := r.Select(conversation(system, 4))
	b := d.Candidates[1]
	if d.Worker != 0 || b.ReplicaMs <= 0 {
		t.Fatalf("went to %s; b %+v", d.Name, b)
	}
	x := b.CostMs - (d.Candidates[0].CostMs - 0.002*float64(d.Candidates[0].ActiveBlocks))
	if got, want := b.ReplicaMs, x*2/3; got < want*0.98 || got > want {
		t.Fatalf("b credited %.2f ms of a %.2f ms miss, want about %.2f", got, x, want)
	}
}
