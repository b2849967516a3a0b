package mockengine

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

func toks(n int, seed uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = seed*100003 + uint32(i)*7 + 1
	}
	return t
}

// run steps m until it is idle and returns the total simulated time.
func run(t testing.TB, m *Model) time.Duration {
	var total time.Duration
	for i := 0; !m.Idle(); i++ {
		if i > 1e6 {
			t.Fatal("model never went idle")
		}
		d, _ := m.Step()
		total += d
	}
	return total
}

func mustAdd(t testing.TB, m *Model, s *Seq) *Seq {
	t.Helper()
	if err := m.Add(s); err != nil {
		t.Fatal(err)
	}
	return s
}

func near(a, b time.Duration) bool { return math.Abs(float64(a-b)) <= float64(time.Microsecond) }

func TestTimingFormula(t *testing.T) {
	for _, c := range []struct {
		tok  int
		want float64
	}{{0, 16.50142}, {1000, 4.209989e-7*1e6 + 15.18344 + 16.50142}, {8192, 4.209989e-7*8192*8192 + 0.01518344*8192 + 16.50142}} {
		if got := PrefillMs(c.tok); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("PrefillMs(%d) = %v, want %v", c.tok, got, c.want)
		}
	}
	if got := DecodeMs(0.5); math.Abs(got-(-25.74*0.25+54.01*0.5+5.74)) > 1e-9 {
		t.Errorf("DecodeMs(0.5) = %v", got)
	}
	if got := DecodeMs(5); got != 1 {
		t.Errorf("DecodeMs floors at 1 ms, got %v", got)
	}
	if StepTime(0, 0, 0) != 0 {
		t.Error("an empty step takes no time")
	}
	mixed := StepTime(100, 3, 0.2)
	want := time.Duration((PrefillMs(100) + DecodeMs(0.2)) * float64(time.Millisecond))
	if mixed != want {
		t.Errorf("mixed step = %v, want prefill+decode %v", mixed, want)
	}
}

// The Model's step durations follow the formula for what it scheduled.
func TestStepTimingMatchesFormula(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 1000, MaxNumBatchedTokens: 8192})
	s := mustAdd(t, m, &Seq{ID: 1, Prompt: toks(100, 1), MaxTokens: 3})
	d, out := m.Step()
	if !near(d, StepTime(100, 0, 0)) {
		t.Fatalf("prefill step %v, want %v", d, StepTime(100, 0, 0))
	}
	if len(out) != 1 || out[0].Generated != 1 || out[0].Seq != s {
		t.Fatalf("prefill step must produce the first token: %+v", out)
	}
	d, out = m.Step()
	// 101 tokens need 7 blocks of 16.
	if u := 7.0 / 1000; !near(d, StepTime(0, 1, u)) {
		t.Fatalf("decode step %v, want %v", d, StepTime(0, 1, u))
	}
	if len(out) != 1 || out[0].Generated != 2 {
		t.Fatalf("decode step: %+v", out)
	}
	_, out = m.Step()
	if len(out) != 1 || !out[0].Finished || !s.Finished() || !m.Idle() {
		t.Fatalf("third token finishes: %+v", out)
	}
	if m.Usage() != 0 {
		t.Fatalf("finished sequence still holds blocks: usage %v", m.Usage())
	}
}

func TestChunkedPrefill(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 4000, MaxNumBatchedTokens: 8192})
	mustAdd(t, m, &Seq{ID: 1, Prompt: toks(20000, 1), MaxTokens: 1})
	for i, chunk := range []int{8192, 8192, 20000 - 2*8192} {
		d, out := m.Step()
		if !near(d, StepTime(chunk, 0, 0)) {
			t.Fatalf("chunk %d: %v want %v", i, d, StepTime(chunk, 0, 0))
		}
		if (len(out) == 1) != (i == 2) {
			t.Fatalf("chunk %d: first token only after the last chunk, got %+v", i, out)
		}
	}
	if !m.Idle() {
		t.Fatal("one-token sequence must be done")
	}
}

// Decodes share the token budget with a chunked prefill in a mixed step.
func TestMixedStep(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 4000, MaxNumBatchedTokens: 1000})
	mustAdd(t, m, &Seq{ID: 1, Prompt: toks(10, 1), MaxTokens: 10})
	m.Step()
	mustAdd(t, m, &Seq{ID: 2, Prompt: toks(5000, 2), MaxTokens: 10})
	d, out := m.Step()
	u := float64(1+63) / 4000 // seq 1: 11 tokens → 1 block; seq 2: 999 tokens → 63 blocks
	if !near(d, StepTime(999, 1, u)) {
		t.Fatalf("mixed step %v, want %v", d, StepTime(999, 1, u))
	}
	if len(out) != 1 || out[0].Seq.ID != 1 {
		t.Fatalf("only the decode produced a token: %+v", out)
	}
}

func TestPrefixCacheHit(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 100})
	p := toks(64, 1)
	a := mustAdd(t, m, &Seq{ID: 1, Prompt: p, MaxTokens: 4})
	run(t, m)
	if a.CachedTokens() != 0 {
		t.Fatalf("cold prompt reported %d cached tokens", a.CachedTokens())
	}
	b := mustAdd(t, m, &Seq{ID: 2, Prompt: p, MaxTokens: 4})
	d, _ := m.Step()
	// 64 tokens = 4 full blocks, but one token is always computed: 3 blocks hit.
	if b.CachedTokens() != 48 {
		t.Fatalf("repeated prompt: %d cached tokens, want 48", b.CachedTokens())
	}
	if !near(d, StepTime(16, 0, 0)) {
		t.Fatalf("only the uncached tokens cost prefill time: %v", d)
	}
	run(t, m)
	c := mustAdd(t, m, &Seq{ID: 3, Prompt: toks(64, 2), MaxTokens: 4})
	run(t, m)
	if c.CachedTokens() != 0 {
		t.Fatalf("different prompt: %d cached tokens", c.CachedTokens())
	}
	// Shared first block only.
	q := append(append([]uint32(nil), p[:20]...), toks(44, 3)...)
	e := mustAdd(t, m, &Seq{ID: 4, Prompt: q, MaxTokens: 1})
	run(t, m)
	if e.CachedTokens() != 16 {
		t.Fatalf("one shared block: %d cached tokens", e.CachedTokens())
	}
	ctr := m.Counters()
	if ctr.PrefixQueries != 4*64 || ctr.PrefixHits != 48+16 {
		t.Fatalf("counters %+v", ctr)
	}
}

// Output blocks are cached as vLLM does: a follow-up prompt made of the
// previous prompt and its output hits them.
func TestOutputBlocksCached(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 100})
	p := toks(40, 1)
	out := toks(30, 9)
	mustAdd(t, m, &Seq{ID: 1, Prompt: p, MaxTokens: 30, Output: out})
	run(t, m)
	next := append(append(append([]uint32(nil), p...), out...), toks(20, 5)...)
	s := mustAdd(t, m, &Seq{ID: 2, Prompt: next, MaxTokens: 1})
	run(t, m)
	// 69 tokens of the first sequence had KV (the last sampled token never
	// does): 4 full blocks = 64 tokens.
	if s.CachedTokens() != 64 {
		t.Fatalf("follow-up turn: %d cached tokens, want 64", s.CachedTokens())
	}
}

func TestSaltSeparatesCaches(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 100})
	p := toks(64, 1)
	mustAdd(t, m, &Seq{ID: 1, Prompt: p, MaxTokens: 1, Salt: "a"})
	run(t, m)
	same := mustAdd(t, m, &Seq{ID: 2, Prompt: p, MaxTokens: 1, Salt: "a"})
	run(t, m)
	other := mustAdd(t, m, &Seq{ID: 3, Prompt: p, MaxTokens: 1, Salt: "b"})
	run(t, m)
	none := mustAdd(t, m, &Seq{ID: 4, Prompt: p, MaxTokens: 1})
	run(t, m)
	if same.CachedTokens() != 48 || other.CachedTokens() != 0 || none.CachedTokens() != 0 {
		t.Fatalf("same salt %d, other salt %d, no salt %d", same.CachedTokens(), other.CachedTokens(), none.CachedTokens())
	}
}

func TestEvictionLRU(t *testing.T) {
	// 10 blocks; each 64-token prompt with one output token holds 4.
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 10})
	for i := uint32(1); i <= 3; i++ {
		mustAdd(t, m, &Seq{ID: uint64(i), Prompt: toks(64, i), MaxTokens: 1})
		run(t, m)
	}
	if m.CachedBlocks() > 10 {
		t.Fatalf("cache holds %d blocks over capacity", m.CachedBlocks())
	}
	// Prompt 3 evicted prompt 1's two tail blocks (least recently used,
	// tail first).
	s1 := mustAdd(t, m, &Seq{ID: 10, Prompt: toks(64, 1), MaxTokens: 1})
	run(t, m)
	if s1.CachedTokens() != 32 {
		t.Fatalf("oldest prompt should keep its first 2 blocks, %d cached", s1.CachedTokens())
	}
	s3 := mustAdd(t, m, &Seq{ID: 11, Prompt: toks(64, 3), MaxTokens: 1})
	run(t, m)
	if s3.CachedTokens() != 48 {
		t.Fatalf("newest prompt should be fully cached, %d", s3.CachedTokens())
	}
}

func TestAbortReleasesBlocks(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 1000, MaxNumBatchedTokens: 256})
	a := mustAdd(t, m, &Seq{ID: 1, Prompt: toks(1000, 1), MaxTokens: 5})
	b := mustAdd(t, m, &Seq{ID: 2, Prompt: toks(1000, 2), MaxTokens: 5})
	m.Step() // a mid-prefill, b waiting
	if m.Running() != 1 || m.Waiting() != 1 || m.Usage() == 0 {
		t.Fatalf("running %d waiting %d usage %v", m.Running(), m.Waiting(), m.Usage())
	}
	if !m.Abort(a) || !m.Abort(b) {
		t.Fatal("abort of held sequences must succeed")
	}
	if m.Abort(a) {
		t.Fatal("second abort must report false")
	}
	if m.Running() != 0 || m.Waiting() != 0 || m.Usage() != 0 {
		t.Fatalf("after abort: running %d waiting %d usage %v", m.Running(), m.Waiting(), m.Usage())
	}
	// The computed full blocks of a stay cached.
	c := mustAdd(t, m, &Seq{ID: 3, Prompt: toks(1000, 1), MaxTokens: 1})
	run(t, m)
	if c.CachedTokens() != 256 {
		t.Fatalf("aborted prefix: %d cached, want 256", c.CachedTokens())
	}
}

func TestMaxNumSeqs(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 1000, MaxNumSeqs: 2})
	for i := uint32(1); i <= 3; i++ {
		mustAdd(t, m, &Seq{ID: uint64(i), Prompt: toks(10, i), MaxTokens: 4})
	}
	m.Step()
	if m.Running() != 2 || m.Waiting() != 1 {
		t.Fatalf("running %d waiting %d", m.Running(), m.Waiting())
	}
	run(t, m)
}

// Decodes that outgrow the cache preempt the newest sequence, which later
// recomputes and still finishes; nothing leaks.
func TestPreemption(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 4, CacheBlocks: 10})
	a := mustAdd(t, m, &Seq{ID: 1, Prompt: toks(8, 1), MaxTokens: 20})
	b := mustAdd(t, m, &Seq{ID: 2, Prompt: toks(8, 2), MaxTokens: 20})
	got := map[uint64]int{}
	for i := 0; !m.Idle(); i++ {
		if i > 10000 {
			t.Fatal("stuck")
		}
		_, out := m.Step()
		for _, r := range out {
			if r.Generated != got[r.Seq.ID]+1 {
				t.Fatalf("seq %d token %d after %d", r.Seq.ID, r.Generated, got[r.Seq.ID])
			}
			got[r.Seq.ID] = r.Generated
		}
	}
	if !a.Finished() || !b.Finished() || m.Counters().Preemptions == 0 {
		t.Fatalf("a %v b %v preemptions %d", a.Finished(), b.Finished(), m.Counters().Preemptions)
	}
	if m.Usage() != 0 {
		t.Fatal("blocks leaked")
	}
	if err := m.Add(&Seq{ID: 3, Prompt: toks(30, 3), MaxTokens: 20}); err != ErrTooLong {
		t.Fatalf("a sequence larger than the cache must be refused, got %v", err)
	}
}

// The same inputs give the same steps, durations and cache contents.
func TestDeterminism(t *testing.T) {
	trace := func() (uint64, []ResidentBlock) {
		m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 600, MaxNumSeqs: 8, MaxNumBatchedTokens: 512})
		r := rand.New(rand.NewPCG(1, 2))
		var sum uint64
		var live []*Seq
		for step := 0; step < 3000; step++ {
			if r.IntN(3) == 0 {
				p := toks(16+r.IntN(400), uint32(r.IntN(20)))
				s := &Seq{ID: uint64(step), Prompt: p, MaxTokens: 1 + r.IntN(50)}
				if err := m.Add(s); err == nil {
					live = append(live, s)
				}
			}
			if len(live) > 0 && r.IntN(40) == 0 {
				m.Abort(live[r.IntN(len(live))])
			}
			d, out := m.Step()
			sum = sum*31 + uint64(d)
			for _, o := range out {
				sum = sum*31 + o.Seq.ID*7 + uint64(o.Generated) + uint64(o.CachedTokens)<<20
			}
		}
		return sum, m.AppendResident(nil)
	}
	s1, r1 := trace()
	s2, r2 := trace()
	if s1 != s2 || len(r1) != len(r2) {
		t.Fatalf("two identical runs differ: %x %x, %d %d blocks", s1, s2, len(r1), len(r2))
	}
	for i := range r1 {
		if r1[i] != r2[i] {
			t.Fatalf("resident block %d differs", i)
		}
	}
}

func TestResidentUsesRouterHashes(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 100})
	p := toks(50, 1)
	mustAdd(t, m, &Seq{ID: 1, Prompt: p, MaxTokens: 1, Salt: "x"})
	run(t, m)
	want := kv.HashBlocks(nil, p, 16, 0)
	res := m.AppendResident(nil)
	if len(res) != len(want) {
		t.Fatalf("%d resident blocks, want %d", len(res), len(want))
	}
	for i := range want {
		if res[i].Hash != want[i] {
			t.Fatalf("block %d: router hash %x want %x", i, res[i].Hash, want[i])
		}
		if res[i].EngineHash == want[i] {
			t.Fatal("engine hashes must differ from the router's")
		}
	}
}

func TestEvents(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 4, CacheBlocks: 6, RecordEvents: true})
	p := toks(12, 1)
	mustAdd(t, m, &Seq{ID: 1, Prompt: p, MaxTokens: 1})
	run(t, m)
	ev := m.DrainEvents(nil)
	if len(ev) != 1 || ev[0].Kind != kv.BlockStored || len(ev[0].EngineHashes) != 3 || ev[0].HasParent {
		t.Fatalf("one stored event of 3 blocks expected: %+v", ev)
	}
	for i := range p {
		if ev[0].Tokens[i] != p[i] {
			t.Fatal("event tokens must be the prompt's")
		}
	}
	stored := ev[0].EngineHashes
	mustAdd(t, m, &Seq{ID: 2, Prompt: toks(16, 2), MaxTokens: 1})
	run(t, m)
	ev = m.DrainEvents(nil)
	var removed, added int
	for _, e := range ev {
		switch e.Kind {
		case kv.BlockRemoved:
			removed += len(e.EngineHashes)
			for _, h := range e.EngineHashes {
				if h != stored[0] && h != stored[1] && h != stored[2] {
					t.Fatalf("removed unknown hash %x", h)
				}
			}
		case kv.BlockStored:
			added += len(e.EngineHashes)
		}
	}
	// 4 blocks needed, 3 free: the first prompt's tail block goes.
	if removed != 1 || added != 4 {
		t.Fatalf("removed %d added %d: %+v", removed, added, ev)
	}
	if stored[0] == 0 {
		t.Fatal("drained events must stay intact")
	}
}

// BenchmarkStep64 measures one step with 64 sequences decoding (sequences
// are replaced as they finish), the simulator's unit of work.
func BenchmarkStep64(b *testing.B) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 30000, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192})
	prompts := make([][]uint32, 64)
	for i := range prompts {
		prompts[i] = toks(1024, uint32(i))
	}
	pool := make([]Seq, 64)
	for i := range pool {
		pool[i] = Seq{ID: uint64(i), Prompt: prompts[i], MaxTokens: 256}
		if err := m.Add(&pool[i]); err != nil {
			b.Fatal(err)
		}
	}
	for m.Running() < 64 || m.Waiting() > 0 {
		m.Step()
	}
	next := uint64(64)
	b.ReportAllocs()
	cpu0 := cpuTime()
	var simulated time.Duration
	for b.Loop() {
		d, out := m.Step()
		simulated += d
		for _, r := range out {
			if r.Finished {
				s := r.Seq
				*s = Seq{ID: next, Prompt: prompts[next%64], MaxTokens: 256, hashes: s.hashes, blocks: s.blocks}
				next++
				if err := m.Add(s); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	// CPU time, not wall time: the machine may be shared.
	if cpu := cpuTime() - cpu0; cpu0 >= 0 && cpu > 0 {
		b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/step")
		b.ReportMetric(float64(b.N)/cpu.Seconds(), "steps/cpu-s")
	}
	b.ReportMetric(float64(simulated.Milliseconds())/float64(b.N), "sim-ms/step")
}

func TestSeqQueue(t *testing.T) {
	var q seqQueue
	seqs := make([]Seq, 3000)
	for i := range seqs {
		seqs[i].ID = uint64(i)
		q.pushBack(&seqs[i])
	}
	for i := 0; i < 2000; i++ {
		if q.front().ID != uint64(i) {
			t.Fatalf("pop %d got %d", i, q.front().ID)
		}
		q.popFront()
	}
	q.pushFront(&seqs[1999])
	q.remove(&seqs[2500])
	if q.len() != 1000 || q.front().ID != 1999 {
		t.Fatalf("len %d front %d", q.len(), q.front().ID)
	}
	want := []uint64{1999}
	for i := 2000; i < 3000; i++ {
		if i != 2500 {
			want = append(want, uint64(i))
		}
	}
	for _, w := range want {
		if q.front().ID != w {
			t.Fatalf("got %d want %d", q.front().ID, w)
		}
		q.popFront()
	}
	if q.len() != 0 {
		t.Fatal("queue must be empty")
	}
}

func TestResetPrefixCache(t *testing.T) {
	m := NewModel(ModelConfig{BlockSize: 16, CacheBlocks: 100, HostCacheBlocks: 10, RecordEvents: true})
	p := toks(64, 1)
	mustAdd(t, m, &Seq{ID: 1, Prompt: p, MaxTokens: 3})
	m.Step()
	if m.ResetPrefixCache() {
		t.Fatal("reset must refuse while a sequence runs")
	}
	run(t, m)
	m.DrainEvents(nil)
	if !m.ResetPrefixCache() || m.CachedBlocks() != 0 || len(m.AppendResident(nil)) != 0 {
		t.Fatal("reset of an idle model must empty the cache")
	}
	if ev := m.DrainEvents(nil); len(ev) != 1 || ev[0].Kind != kv.AllBlocksCleared {
		t.Fatalf("want one AllBlocksCleared event, got %+v", ev)
	}
	s := mustAdd(t, m, &Seq{ID: 2, Prompt: p, MaxTokens: 1})
	run(t, m)
	if s.CachedTokens() != 0 {
		t.Fatalf("after reset %d cached", s.CachedTokens())
	}
}
