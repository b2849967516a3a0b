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
