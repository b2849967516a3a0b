package router

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

const (
	benchWorkers = 64
	benchPrompt  = 512 // blocks: an 8k-token prompt at 16 tokens per block
	benchShared  = 32  // a system prompt every worker holds
)

// fillIndex loads about 1,000,000 (block, worker) entries: a shared
// 32-block system prompt on all 64 workers, then 512-block conversations
// continuing it, each on one worker. It returns one resident conversation.
func fillIndex(x Index, entries int) []kv.BlockHash {
	system := seq(benchShared, 1<<30)
	for w := WorkerID(0); w < benchWorkers; w++ {
		x.Store(w, system, kv.TierDevice, 0)
	}
	conv := make([]kv.BlockHash, benchPrompt)
	copy(conv, system)
	var last []kv.BlockHash
	for c := 0; x.Len() < entries; c++ {
		tail := seq(benchPrompt-benchShared, uint64(c))
		copy(conv[benchShared:], tail)
		x.Store(WorkerID(c%benchWorkers), conv, kv.TierDevice, 0)
		last = append(last[:0], conv...)
	}
	return last
}

func BenchmarkIndexMatch(b *testing.B) {
	x := NewMemIndex(MemIndexConfig{})
	h := fillIndex(x, 1_000_000)
	buf := make([]Overlap, 0, benchWorkers)
	b.ReportAllocs()
	t := startCPU(b)
	for i := 0; i < b.N; i++ {
		buf = x.Match(h, buf)
	}
	t.stop()
	if len(buf) != benchWorkers {
		b.Fatalf("matched %d workers", len(buf))
	}
}

func BenchmarkIndexStore(b *testing.B) {
	x := NewMemIndex(MemIndexConfig{MaxEntries: 1_000_000})
	fillIndex(x, 1_000_000)
	convs := make([][]kv.BlockHash, 64)
	for i := range convs {
		convs[i] = seq(benchPrompt, uint64(1_000_000+i))
	}
	b.ReportAllocs()
	t := startCPU(b)
	for i := 0; i < b.N; i++ {
		x.Store(WorkerID(i%benchWorkers), convs[i%len(convs)], kv.TierDevice, time.Minute)
	}
	t.stop()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchPrompt), "ns/block")
}

// TestIndexMemoryPerEntry checks issue 3's memory goal: at most 64 heap
// bytes per resident (block, worker) entry, with 1,000,000 entries over 64
// workers.
func TestIndexMemoryPerEntry(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a 1M-entry index")
	}
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	x := NewMemIndex(MemIndexConfig{})
	fillIndex(x, 1_000_000)
	runtime.GC()
	runtime.ReadMemStats(&m1)
	per := float64(m1.HeapAlloc-m0.HeapAlloc) / float64(x.Len())
	t.Logf("%.1f bytes per resident entry (%d entries)", per, x.Len())
	if per > 64 {
		t.Fatalf("%.1f bytes per entry, want <= 64", per)
	}
	runtime.KeepAlive(x)
}

// benchSelect measures r.Select(q), CPU time included.
func benchSelect(b *testing.B, r *Router, q *Request) {
	b.ReportAllocs()
	t := startCPU(b)
	for i := 0; i < b.N; i++ {
		if _, err := r.Select(q); err != nil {
			b.Fatal(err)
		}
	}
	t.stop()
}

func BenchmarkSelect8k64Workers(b *testing.B) {
	for _, p := range []string{"kv", "kv_dynamo", "round_robin", "least_load", "prefix_hash", "cache_aware"} {
		b.Run(p, func(b *testing.B) {
			cfg := DefaultConfig()
			cfg.Policy = p
			r, err := New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			for i := 0; i < benchWorkers; i++ {
				r.AddWorker(fmt.Sprintf("worker-%d", i))
			}
			h := fillIndex(r.Index(), 1_000_000)
			q := &Request{Hashes: h, PromptTokens: benchPrompt * 16, CandidateBuf: make([]Candidate, 0, benchWorkers)}
			for i := 0; i < 256; i++ { // some load everywhere
				_, a, _ := r.Route(&Request{Hashes: seq(8, uint64(i)), PromptTokens: 130})
				if i%2 == 0 {
					a.PrefillDone()
				}
			}
			benchSelect(b, r, q)
		})
	}
}

// BenchmarkSelectPopularPrefix: the most the replica pricing costs a
// Select. An 8k-token prompt held by 8 of 64 workers. "unknown": no request
// was counted; "popular": every counted and every live request began with
// it, so every sampled depth is looked up, with its live requests on each
// holder, and every other worker is credited a copy; "busy": the same, and
// 24 other workers run a request of their own each (the prompt is then a
// quarter of the live requests, on an eighth of the workers).
func BenchmarkSelectPopularPrefix(b *testing.B) {
	for _, bc := range []struct {
		name            string
		popular, others bool
	}{{"unknown", false, false}, {"popular", true, false}, {"busy", true, true}} {
		b.Run(bc.name, func(b *testing.B) {
			r, _ := New(DefaultConfig())
			for i := 0; i < benchWorkers; i++ {
				r.AddWorker(fmt.Sprintf("worker-%d", i))
			}
			h := seq(benchPrompt, 7)
			for w := WorkerID(0); w < 8; w++ {
				r.Index().Store(w, h, kv.TierDevice, 0)
			}
			if bc.popular {
				for w := WorkerID(0); w < 8; w++ { // live on every holder
					_, a, _ := r.Route(&Request{Hashes: h, PromptTokens: benchPrompt * 16, Pinned: true, Pin: w})
					a.PrefillDone()
				}
				for range 100 {
					r.pop.record(h)
				}
			}
			if bc.others {
				for w := WorkerID(8); w < 32; w++ {
					_, a, _ := r.Route(&Request{Hashes: seq(64, uint64(w)), PromptTokens: 1024, Pinned: true, Pin: w})
					a.PrefillDone()
				}
			}
			q := &Request{Hashes: h, PromptTokens: benchPrompt * 16, CandidateBuf: make([]Candidate, 0, benchWorkers)}
			if d, _ := r.Select(q); (d.Candidates[20].ReplicaMs > 0) != bc.popular {
				b.Fatalf("%s: credited %+v", bc.name, d.Candidates[20])
			}
			benchSelect(b, r, q)
		})
	}
}

func BenchmarkCommitFree(b *testing.B) {
	r, _ := New(DefaultConfig())
	for i := 0; i < benchWorkers; i++ {
		r.AddWorker(fmt.Sprintf("worker-%d", i))
	}
	h := fillIndex(r.Index(), 1_000_000)
	q := &Request{Hashes: h, PromptTokens: benchPrompt * 16, CandidateBuf: make([]Candidate, 0, benchWorkers)}
	d, err := r.Select(q)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	t := startCPU(b)
	for i := 0; i < b.N; i++ {
		a := r.Commit(q, d)
		a.PrefillDone()
		a.OutputBlock()
		a.Free()
	}
	t.stop()
}

// BenchmarkRouteUnstreamed: Route + Free of short unstreamed requests on a
// clock that moves 4 µs a Route, so that thousands await their predicted end
// of prefill (metric "awaiting") and about one is due per Route: what ending
// due prefills costs a Route.
func BenchmarkRouteUnstreamed(b *testing.B) {
	var now atomic.Int64
	now.Store(time.Unix(1_700_000_000, 0).UnixNano())
	cfg := DefaultConfig()
	cfg.Now = func() time.Time { return time.Unix(0, now.Add(4_000)) } // one read per Route
	r, _ := New(cfg)
	r.AddWorker("worker-0")
	// No full block: nothing is ever cached, every request has a prefill.
	q := &Request{PromptTokens: 15, Unstreamed: true, CandidateBuf: make([]Candidate, 0, 1)}
	route := func() {
		_, a, err := r.Route(q)
		if err != nil {
			b.Fatal(err)
		}
		a.Free() // answered before its predicted TTFT: the entry stays until due
	}
	for i := 0; i < 20_000; i++ { // to the steady state
		route()
	}
	w := (*r.workers.Load())[0]
	b.ReportAllocs()
	t := startCPU(b)
	for i := 0; i < b.N; i++ {
		route()
	}
	t.stop()
	w.mu.Lock()
	b.ReportMetric(float64(len(w.due)), "awaiting")
	w.mu.Unlock()
}

// BenchmarkCommitFreeEventMode is BenchmarkCommitFree on event-mode workers:
// a Commit stores nothing, and touches the 512 blocks the request hits.
func BenchmarkCommitFreeEventMode(b *testing.B) {
	r, _ := New(DefaultConfig())
	for i := 0; i < benchWorkers; i++ {
		r.SetApproximate(r.AddWorker(fmt.Sprintf("worker-%d", i)), false)
	}
	h := fillIndex(r.Index(), 1_000_000)
	q := &Request{Hashes: h, PromptTokens: benchPrompt * 16, CandidateBuf: make([]Candidate, 0, benchWorkers)}
	d, err := r.Select(q)
	if err != nil {
		b.Fatal(err)
	}
	if d.Overlap != benchPrompt {
		b.Fatalf("overlap %d", d.Overlap)
	}
	b.ReportAllocs()
	t := startCPU(b)
	for i := 0; i < b.N; i++ {
		a := r.Commit(q, d)
		a.PrefillDone()
		a.OutputBlock()
		a.Free()
	}
	t.stop()
}

// BenchmarkSelectAfterChurn: a Select among 8 workers after "retired" ones
// were added and removed (backends a discovery or reloads took away: their
// ids stay for good). A decision walks the workers still there, so its
// cost does not grow with those that left.
func BenchmarkSelectAfterChurn(b *testing.B) {
	for _, retired := range []int{0, 10_000} {
		b.Run(fmt.Sprintf("retired=%d", retired), func(b *testing.B) {
			r, err := New(DefaultConfig())
			if err != nil {
				b.Fatal(err)
			}
			for i := 0; i < retired; i++ {
				r.RemoveWorker(r.AddWorker(fmt.Sprintf("gone-%d", i)))
			}
			for i := 0; i < 8; i++ {
				r.AddWorker(fmt.Sprintf("worker-%d", i))
			}
			q := &Request{Hashes: seq(64, 1), PromptTokens: 64 * 16, CandidateBuf: make([]Candidate, 0, 8)}
			benchSelect(b, r, q)
		})
	}
}
