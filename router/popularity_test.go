package router

import (
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

// 200 conversations began with a system prompt of 64 blocks. Worker a holds
// it and 12 blocks of one conversation's history (76: no sampled depth lies
// between 64 and 76), b the system prompt alone. The conversation's next
// turn stays on a, though a is busier: b is credited nothing for the
// history, which only a holds, and no worker is credited past the prompt.
func TestHistoryPastAPopularPromptIsNotCredited(t *testing.T) {
	r := eightWorkers()
	system := seq(64, 1)
	for i := range 200 {
		r.pop.record(append(slices.Clone(system), seq(4, uint64(1000+i))...))
	}
	history := append(slices.Clone(system), seq(12, 77)...)
	r.Index().Store(0, history, kv.TierDevice, 0)
	r.Index().Store(1, system, kv.TierDevice, 0)
	_, a, _ := r.Route(&Request{Hashes: seq(8, 99), PromptTokens: 128, Pinned: true, Pin: 0})
	a.PrefillDone() // a decodes a short request
	defer a.Free()
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
	r.Index().Store(0, system, kv.TierDevice, 0)
	d, _ := r.Select(&Request{Hashes: append(slices.Clone(system), seq(4, 78)...), PromptTokens: 68 * 16})
	x := d.Candidates[1].CostMs - d.Candidates[0].CostMs // idle both: the prompt's prefill
	if c := d.Candidates[1]; c.ReplicaMs < x*200/201-1e-9 || c.ReplicaMs > x {
		t.Fatalf("b, lacking the prompt (%.2f ms of it), credited %.2f ms, want %.2f", x, c.ReplicaMs, x*200/201)
	}
}

// One user's conversation on an idle fleet: it is all the traffic, so its
// history counts as popular, but only the few turns that reached a depth
// count for it. The next turn does not leave its history for a short queue
// on the worker holding it: the credit is a part of the miss, not all of it.
func TestOneConversationStaysWithItsHistory(t *testing.T) {
	r := eightWorkers()
	var history []kv.BlockHash
	var holder WorkerID
	for turn := range 10 {
		history = append(history, seq(50, uint64(500+turn))...) // 800 tokens a turn
		d, a, err := r.Route(&Request{Hashes: slices.Clone(history), PromptTokens: len(history) * 16})
		if err != nil {
			t.Fatal(err)
		}
		a.PrefillDone()
		a.Free()
		holder = d.Worker
	}
	_, a, _ := r.Route(&Request{Hashes: seq(25, 9), PromptTokens: 400, Pinned: true, Pin: holder})
	defer a.Free() // 400 tokens queued on the holder
	next := append(slices.Clone(history), seq(50, 600)...)
	d, _ := r.Select(&Request{Hashes: next, PromptTokens: len(next) * 16})
	if d.Worker != holder {
		t.Fatalf("400 tokens queued on the holder (%.1f ms predicted): the turn left for %s (%.1f ms)",
			d.Candidates[candIndex(d.Candidates, holder)].CostMs, d.Name, d.PredictedTTFTms)
	}
	for _, c := range d.Candidates {
		if c.Worker != holder && c.ReplicaMs > 0.8*(c.CostMs-d.PredictedTTFTms) {
			t.Fatalf("%s credited %.1f ms of a %.1f ms miss", c.Name, c.ReplicaMs, c.CostMs-d.PredictedTTFTms)
		}
	}
}

// Three system prompts in equal shares on four workers: each is a third of
// the traffic, 4/3 of a worker's share, so two holders are enough and a
// third worker is credited nothing, however busy the two are.
func TestReplicatedPrefixIsNotCredited(t *testing.T) {
	r, _ := New(DefaultConfig())
	for _, n := range []string{"a", "b", "c", "d"} {
		r.AddWorker(n)
	}
	prompts := [3][]kv.BlockHash{seq(64, 1), seq(64, 2), seq(64, 3)}
	for i := range 300 {
		r.pop.record(conversation(prompts[i%3], uint64(1000+i)).Hashes)
	}
	r.Index().Store(0, prompts[0], kv.TierDevice, 0)
	r.Index().Store(1, prompts[0], kv.TierDevice, 0)
	for w := WorkerID(0); w < 2; w++ {
		_, a, _ := r.Route(&Request{Hashes: seq(400, uint64(50+w)), PromptTokens: 6400, Pinned: true, Pin: w})
		defer a.Free() // 6,400 tokens queued on each holder
	}
	d, _ := r.Select(conversation(prompts[0], 7))
	for _, c := range d.Candidates {
		if c.ReplicaMs != 0 {
			t.Fatalf("%s credited %.1f ms for a prompt two of four workers hold at a third of the traffic", c.Name, c.ReplicaMs)
		}
	}
	if d.Worker < 2 {
		t.Fatalf("went to %s, behind 6,400 queued tokens, rather than compute 1,024 elsewhere", d.Name)
	}
	// The same prompt at two thirds of the traffic: 8/3 > 2 holders.
	for i := range 300 {
		r.pop.record(conversation(prompts[0], uint64(2000+i)).Hashes)
	}
	if d, _ = r.Select(conversation(prompts[0], 8)); d.Candidates[2].ReplicaMs <= 0 {
		t.Fatalf("at two thirds of the traffic on two of four workers, c credited %.1f ms", d.Candidates[2].ReplicaMs)
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
