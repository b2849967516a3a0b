package router

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

// worker is one engine (or engine rank) as the router tracks it. Counters are
// atomics so Select reads them without locks (advisory); they change only
// under mu, together with the prompt-block reference counts.
type worker struct {
	id       WorkerID
	name     string
	instance uint64

	available atomic.Bool
	removed   atomic.Bool
	approx    atomic.Bool

	inflight atomic.Int64 // requests between Commit and Free
	pending  atomic.Int64 // requests between Commit and PrefillDone (or Free)
	prefill  atomic.Int64 // predicted uncached prompt tokens not yet computed
	active   atomic.Int64 // distinct prompt blocks of live requests + output blocks

	// Load other routers report on the worker (SetRemoteLoad).
	remInflight, remPending, remPrefill, remActive atomic.Int64

	mu   sync.Mutex
	gen  uint64                 // bumped by reset; Actives of older generations are inert
	refs map[kv.BlockHash]int32 // prompt blocks of live requests, reference-counted
	// due are the unstreamed requests whose prefill ends at their predicted
	// TTFT (no first token is seen), a min-heap on that time; nextDue is the
	// earliest, 0 = none.
	due     []dueAt
	nextDue atomic.Int64

	cal   calibrator
	group atomic.Uint32 // peer group (SetPeerGroup), < peerGroups

	// Engine-reported load (SetEngineLoad).
	engWaiting, engRunning atomic.Int64
	engKVUsage             atomic.Uint64 // float64 bits; NaN = never set
	avgUncached            atomic.Uint64 // float64 bits: EWMA of uncached tokens per request

	// KV memory (see memoryWaitMs): the engine's capacity in blocks,
	// reported by the engine (SetEngineCapacity) or estimated from its usage, and the EWMA of request lifetimes
	// (Commit to Free) in ms; float64 bits, 0 = unknown.
	capBlocks   atomic.Uint64
	capReported atomic.Bool // capBlocks is the engine's own figure (SetEngineCapacity)
	lifeMs      atomic.Uint64
	now         func() time.Time
}

func newWorker(id WorkerID, name string, now func() time.Time) *worker {
	w := &worker{id: id, name: name, instance: InstanceID(name), refs: make(map[kv.BlockHash]int32), now: now}
	w.available.Store(true)
	w.approx.Store(true)
	w.engKVUsage.Store(math.Float64bits(math.NaN()))
	w.cal.init()
	return w
}

func (w *worker) engUsage() float64 {
	u := math.Float64frombits(w.engKVUsage.Load())
	if math.IsNaN(u) {
		return -1
	}
	return u
}

// engineQueue estimates queued prefill tokens from the engine's waiting
// count: waiting requests × the mean uncached tokens of this worker's
// requests (0 when the engine never reported).
func (w *worker) engineQueue(blockSize int) int64 {
	n := w.engWaiting.Load()
	if n <= 0 {
		return 0
	}
	avg := math.Float64frombits(w.avgUncached.Load())
	if avg < float64(blockSize) {
		avg = float64(blockSize)
	}
	return int64(float64(n) * avg)
}

// memoryWaitMs predicts how long a request adding need blocks waits for KV
// memory on w: when the blocks of the live requests plus its own exceed the
// engine's capacity, the engine admits it only after requests holding the
// excess have finished. Requests release their blocks over about one
// lifetime, so freeing d of the active blocks takes d/active lifetimes, and
// the wait is at most one lifetime.
// It is 0 while the capacity or the lifetime is unknown.
func (w *worker) memoryWaitMs(active int64, need int) float64 {
	capacity := math.Float64frombits(w.capBlocks.Load())
	life := math.Float64frombits(w.lifeMs.Load())
	deficit := float64(active+int64(need)) - capacity
	if capacity <= 0 || life <= 0 || deficit <= 0 {
		return 0
	}
	// Once every live request has finished (one lifetime) nothing more is
	// freed: a deficit beyond the active blocks (a request larger than the
	// capacity, or an under-estimated capacity) waits no longer than that.
	return min(deficit, float64(active)) / float64(max(active, 1)) * life
}

// observeCapacity takes one sample of the engine's KV capacity in blocks:
// the router's active blocks over the engine's usage, when nothing waits
// (every live request is running and holds its blocks) and the usage is
// large enough for the ratio to be accurate. The blocks are this router's
// and those other replicas report (SetRemoteLoad): with clients that
// bypass every kvproxy the capacity is underestimated by their share, and
// the predicted wait for memory is too high.
func (w *worker) observeCapacity(waiting int, usage float64) {
	active := w.active.Load() + w.remActive.Load() // other replicas' blocks are in the usage too
	if w.capReported.Load() || waiting > 0 || active <= 0 || !(usage >= 0.25 && usage <= 1) {
		return
	}
	sample := float64(active) / usage
	old := math.Float64frombits(w.capBlocks.Load())
	if old > 0 {
		sample = old + 0.1*(sample-old)
	}
	w.capBlocks.Store(math.Float64bits(sample))
}

// observeLifetime folds one request's Commit-to-Free time into the EWMA.
func (w *worker) observeLifetime(ms float64) {
	if !(ms > 0) {
		return
	}
	old := math.Float64frombits(w.lifeMs.Load())
	if old > 0 {
		ms = old + 0.05*(ms-old)
	}
	w.lifeMs.Store(math.Float64bits(ms))
}

// liveRequests is how many of the worker's live requests hold the block h
// in their prompt.
func (w *worker) liveRequests(h kv.BlockHash) int32 {
	w.mu.Lock()
	n := w.refs[h]
	w.mu.Unlock()
	return n
}

// add registers a on w; false if w was removed.
func (w *worker) add(a *Active) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.removed.Load() {
		return false
	}
	newBlocks := a.partial
	for _, h := range *a.hashes {
		n := w.refs[h]
		if n == 0 {
			newBlocks++
		}
		w.refs[h] = n + 1
	}
	a.gen = w.gen
	w.inflight.Add(1)
	if !a.unstreamed {
		w.pending.Add(1)
		a.pending = true
	}
	w.prefill.Add(a.prefill)
	if a.dueNs > 0 && a.prefill > 0 {
		w.pushDue(dueAt{a.dueNs, a})
		w.nextDue.Store(w.due[0].ns)
	}
	w.active.Add(newBlocks)
	if !a.aux {
		avg := math.Float64frombits(w.avgUncached.Load())
		w.avgUncached.Store(math.Float64bits(avg + 0.1*(float64(a.uncached)-avg)))
	}
	return true
}

// dueAt is when an unstreamed request's prefill is taken to end.
type dueAt struct {
	ns int64 // Unix ns
	a  *Active
}

// endDuePrefills ends the prefill of every unstreamed request whose
// predicted TTFT is before now (Unix ns). It runs where the counters are
// read, not on a timer per request: a timer would wake a thread of the
// runtime for every non-streamed request.
func (w *worker) endDuePrefills(now int64) {
	if next := w.nextDue.Load(); next == 0 || now < next {
		return
	}
	var buf [16]*Active
	ended := buf[:0]
	w.mu.Lock()
	for len(w.due) > 0 && w.due[0].ns <= now {
		ended = append(ended, w.popDue().a)
	}
	next := int64(0)
	if len(w.due) > 0 {
		next = w.due[0].ns
	}
	w.nextDue.Store(next)
	w.mu.Unlock()
	for _, a := range ended {
		a.PrefillDone() // a no-op for a request freed meanwhile
	}
}

// pushDue and popDue keep w.due a binary min-heap on ns (w.mu held): a
// Route pays O(log n) for the prefills it ends, not a scan of all n.
func (w *worker) pushDue(d dueAt) {
	h := append(w.due, d)
	for i := len(h) - 1; i > 0; {
		p := (i - 1) / 2
		if h[p].ns <= h[i].ns {
			break
		}
		h[p], h[i] = h[i], h[p]
		i = p
	}
	w.due = h
}

func (w *worker) popDue() dueAt {
	h := w.due
	top, n := h[0], len(h)-1
	h[0], h[n] = h[n], dueAt{}
	h = h[:n]
	for i := 0; ; {
		m, l := i, 2*i+1
		if l < n && h[l].ns < h[m].ns {
			m = l
		}
		if r := l + 1; r < n && h[r].ns < h[m].ns {
			m = r
		}
		if m == i {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	w.due = h
	return top
}

// reset zeroes every counter and makes all open Actives inert.
func (w *worker) reset() {
	w.mu.Lock()
	w.gen++
	clear(w.due)
	w.due = w.due[:0]
	w.nextDue.Store(0)
	w.inflight.Store(0)
	w.pending.Store(0)
	w.prefill.Store(0)
	w.active.Store(0)
	clear(w.refs)
	w.mu.Unlock()
}

func (w *worker) idle() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.inflight.Load() == 0 && w.pending.Load() == 0 && w.prefill.Load() == 0 && w.active.Load() == 0 && len(w.refs) == 0
}

// Active is one in-flight request. All methods are safe for concurrent use;
// after Free the others are no-ops, and Free's effect happens exactly once.
type Active struct {
	mu      sync.Mutex
	w       *worker
	gen     uint64
	hashes  *[]kv.BlockHash // a copy of the prompt's hashes, pooled after Free
	partial int64           // 1 if the prompt ends in a partial block
	prefill int64           // uncached tokens still counted in w.prefill
	out     int64           // output blocks counted in w.active
	pending bool            // counted in w.pending
	freed   bool
	// unstreamed: not counted in w.pending (Request.Unstreamed); started:
	// PrefillDone was called, so the request held KV memory on the engine.
	unstreamed, started bool
	aux                 bool // Request.Auxiliary

	start    int64   // Commit time, Unix ns (0: unknown)
	dueNs    int64   // unstreamed: the predicted end of prefill, Unix ns (0: none)
	uncached int64   // predicted uncached prompt tokens
	observed bool    // ObserveTTFT already counted
	fetchMs  float64 // predicted at Commit: fetch time and wait for KV memory
	computMs float64 // predicted at Commit: compute time at the configured speed
}

// live locks a and w and reports whether a still acts on w's counters; the
// caller unlocks both when it returns true, nothing otherwise.
func (a *Active) live() bool {
	a.mu.Lock()
	if a.freed || a.w == nil {
		a.mu.Unlock()
		return false
	}
	a.w.mu.Lock()
	if a.w.gen != a.gen {
		a.w.mu.Unlock()
		a.freed = true
		a.mu.Unlock()
		return false
	}
	return true
}

func (a *Active) unlock() {
	a.w.mu.Unlock()
	a.mu.Unlock()
}

// PrefillDone records the first token: the request's uncached prompt tokens
// leave the worker's prefill queue.
func (a *Active) PrefillDone() {
	if !a.live() {
		return
	}
	a.w.prefill.Add(-a.prefill)
	a.prefill = 0
	a.started = true
	if a.pending {
		a.w.pending.Add(-1)
		a.pending = false
	}
	a.unlock()
}

// OutputBlock records block_size more output tokens: one more active block.
func (a *Active) OutputBlock() {
	if !a.live() {
		return
	}
	a.out++
	a.w.active.Add(1)
	a.unlock()
}

// Free ends the request: every counter it raised goes back down. Idempotent.
func (a *Active) Free() {
	if !a.live() {
		return
	}
	w := a.w
	gone := a.partial + a.out
	for _, h := range *a.hashes {
		n := w.refs[h] - 1
		if n <= 0 {
			delete(w.refs, h)
			gone++
		} else {
			w.refs[h] = n
		}
	}
	w.inflight.Add(-1)
	if a.pending {
		w.pending.Add(-1)
	}
	w.prefill.Add(-a.prefill)
	w.active.Add(-gone)
	a.prefill, a.out, a.pending, a.freed = 0, 0, false, true
	// Only requests the engine ran have a lifetime: one freed before its
	// first token (a retry elsewhere, a lost slot race) held no memory.
	if a.start != 0 && a.started && !a.aux {
		w.observeLifetime(float64(w.now().UnixNano()-a.start) / 1e6)
	}
	hashPool.Put(a.hashes)
	a.hashes = nil
	a.unlock()
}

// ObserveTTFT reports the request's measured time to first token; with
// Config.Calibrate it refits the worker's slowdown factor. Only the first
// observation of an Active counts; it is a no-op after Free.
func (a *Active) ObserveTTFT(d time.Duration) {
	a.mu.Lock()
	if a.freed || a.w == nil || a.observed {
		a.mu.Unlock()
		return
	}
	a.observed = true
	y, p, w := float64(d)/float64(time.Millisecond)-a.fetchMs, a.computMs, a.w
	a.mu.Unlock()
	w.cal.observe(y, p, w.now().UnixNano())
}
