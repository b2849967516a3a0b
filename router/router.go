package router

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/zeebo/xxh3"
)

// WorkerID is a worker's dense index, assigned by the router. A name keeps
// its WorkerID for the router's lifetime, across RemoveWorker and AddWorker.
type WorkerID uint32

var (
	// ErrNoWorker: no worker is available.
	ErrNoWorker = errors.New("router: no available worker")
	// ErrWorkerUnavailable: the pinned worker is unknown, removed or unavailable.
	ErrWorkerUnavailable = errors.New("router: pinned worker unavailable")
)

// Config configures a Router. Start from DefaultConfig.
type Config struct {
	Policy         string        // "kv" (default), "kv_dynamo", "round_robin", "least_load", "prefix_hash", "cache_aware"
	BlockSize      int           // tokens per block, default kv.DefaultBlockSize
	IndexTTL       time.Duration // approximate-mode entry lifetime, default 120s
	MaxIndexBlocks int           // bound on resident (block, worker) entries, LRU pruned; default 4_000_000
	Temperature    float64       // 0 = argmin; >0 softmax sampling over -cost/T (costs normalised to [0,1])
	Seed           int64
	Cost           CostConfig       // kv policy coefficients (ms)
	Dynamo         DynamoConfig     // kv_dynamo
	PrefixHash     PrefixHashConfig // prefix_hash
	CacheAware     CacheAwareConfig // cache_aware
	// Calibrate fits each worker's slowdown factor online from ObserveTTFT
	// (it scales the worker's predicted compute time; WorkerStatus shows it
	// and the resulting PrefillMsPerToken and QueueMsPerToken). DefaultConfig
	// turns it on.
	Calibrate bool
	// Now is the clock of index TTLs (nil: time.Now).
	Now func() time.Time
}

// DynamoConfig configures kv_dynamo.
type DynamoConfig struct {
	OverlapWeight float64 // weight of prefill blocks against decode blocks, default 1.0
}

// PrefixHashConfig configures prefix_hash (consistent hashing with bounded loads).
type PrefixHashConfig struct {
	VirtualNodes int     // ring points per worker, default 256
	LoadBound    float64 // a worker takes a request while inflight+1 <= ceil(LoadBound × mean), default 1.25
	PrefixBlocks int     // leading blocks hashed into the key, default 4
}

// DefaultConfig returns the defaults documented on Config's fields.
func DefaultConfig() Config {
	return Config{
		Policy:         "kv",
		BlockSize:      kv.DefaultBlockSize,
		IndexTTL:       120 * time.Second,
		MaxIndexBlocks: 4_000_000,
		Cost:           DefaultCostConfig(),
		Dynamo:         DynamoConfig{OverlapWeight: 1.0},
		PrefixHash:     PrefixHashConfig{VirtualNodes: 256, LoadBound: 1.25, PrefixBlocks: 4},
		CacheAware:     DefaultCacheAwareConfig(),
		Calibrate:      true,
	}
}

// Request is what the router needs to know about one request.
type Request struct {
	Hashes       []kv.BlockHash // prompt block hashes (full blocks only)
	PromptTokens int            // all prompt tokens incl. the partial block
	Pin          WorkerID       // used when Pinned
	Pinned       bool
	// Unstreamed marks a request whose first token the caller cannot see
	// (a non-streamed answer: PrefillDone comes with the whole answer). It
	// is not counted as awaiting its first token (Candidate.Pending), which
	// would otherwise last its whole decode, and its prefill is taken to
	// end at its predicted TTFT (Decision.PredictedTTFTms) if PrefillDone
	// has not come by then.
	Unstreamed bool
	// Auxiliary marks a request that is no generation (embeddings, scores,
	// tokenizing): it counts in flight and as prefill work like any other,
	// but stays out of the worker's per-request statistics (the mean
	// uncached tokens, which sizes the engine's reported queue, and the mean
	// lifetime, which prices the wait for KV memory). A client tokenizing
	// before every chat request would otherwise halve both.
	Auxiliary bool
	// Repeat marks a request routed before (a retry on the next engine, a
	// moved stream, a prefill stage of a request routed to its decode
	// engine): the prefixes' popularity (see priceReplicas) counts each
	// request once, and auxiliary ones not at all.
	Repeat bool
	// CandidateBuf, if its capacity is at least the number of workers, is
	// reused for Decision.Candidates instead of allocating.
	CandidateBuf []Candidate
	// Avoid lists workers not to choose, though available: those that
	// already refused this request (a retry goes to the next best). Ignored
	// when Pinned. ErrNoWorker when it leaves none.
	Avoid []WorkerID
}

// Candidate is one available worker as the router saw it for a request.
type Candidate struct {
	Worker  WorkerID
	Name    string
	Overlap int                // leading prompt blocks the worker holds, any tier
	Tiers   [kv.NumTiers]int32 // of those, how many at best in each tier
	CostMs  float64            // predicted TTFT (kv cost model), whatever the policy
	Score   float64            // the policy's own score, lower wins (= CostMs + ExternalMs for kv)
	// Load as read (advisory).
	Inflight      int64
	Pending       int64 // requests still waiting for their first token
	PrefillTokens int64
	ActiveBlocks  int64
	// MemoryMs is the predicted wait for KV memory on the worker, part of
	// CostMs (see worker.memoryWaitMs).
	MemoryMs float64
	// ExternalMs is what the request's prefill on the worker costs the
	// requests after it (see CostConfig.externality); kv adds it to CostMs
	// to score the worker.
	ExternalMs float64
	// ReplicaMs is the prefill time of the popular prefix blocks the worker
	// lacks while too few workers hold them (see Router.priceReplicas); kv
	// subtracts it from the score: the copy it makes serves later requests.
	ReplicaMs float64
}

// Decision is the outcome of Select.
type Decision struct {
	Worker          WorkerID
	Name            string
	InstanceID      uint64
	Overlap         int // blocks of the prompt the chosen worker holds (leading prefix)
	Total           int // len(Hashes)
	PredictedTTFTms float64
	Candidates      []Candidate // every available worker, in WorkerID order (backed by Request.CandidateBuf when given)
}

// WorkerStatus is an advisory snapshot of one worker.
type WorkerStatus struct {
	Name          string
	ID            WorkerID
	InstanceID    uint64
	Available     bool
	Removed       bool
	Approximate   bool
	Inflight      int64
	PrefillTokens int64
	ActiveBlocks  int64
	IndexedBlocks int
	// Slowdown is the fitted speed factor (1 = as configured; 2 = twice as
	// slow), and the coefficients below are the configured ones times it.
	Slowdown          float64
	PrefillMsPerToken float64
	QueueMsPerToken   float64
	TTFTSamples       int64
	PeerGroup         int // SetPeerGroup
	// Engine-reported load (SetEngineLoad); EngineKVUsage < 0 when never set.
	EngineWaiting, EngineRunning int64
	EngineKVUsage                float64
	// Pending counts requests awaiting their first token. CacheBlocks is
	// the engine's KV capacity in blocks as estimated from its reported
	// usage, LifetimeMs the mean Commit-to-Free time of its requests; both
	// 0 until known (they price the wait for KV memory).
	Pending     int64
	CacheBlocks float64
	LifetimeMs  float64
	// Remote is the load other kvproxy replicas report on the worker
	// (SetRemoteLoad); the fields above are this router's own.
	Remote Load
}

// Load is the load requests put on a worker, as one router counts it.
type Load struct {
	Inflight      int64 `json:"inflight"`
	Pending       int64 `json:"pending"` // awaiting their first token
	PrefillTokens int64 `json:"prefill_tokens"`
	ActiveBlocks  int64 `json:"active_blocks"`
}

// Router selects workers and tracks their load. Safe for concurrent use.
type Router struct {
	cfg    Config
	policy Policy
	index  *MemIndex
	pop    *popularity

	mu      sync.Mutex                // serialises Commit (and Route's Select+Commit)
	dec     Decision                  // under mu: the copy policy.Commit sees, so callers' Decisions stay on the stack
	wmu     sync.Mutex                // membership changes
	workers atomic.Pointer[[]*worker] // copy-on-write, indexed by WorkerID
	// live are the workers not removed, in id order: what a decision
	// walks. A removed worker keeps its id (and its place in workers) for
	// good, and backends that come and go (discovery, reloads) would
	// otherwise cost every decision a little more for the life of the
	// process.
	live    atomic.Pointer[[]*worker]
	byName  sync.Map      // string → WorkerID
	byInst  sync.Map      // uint64 → WorkerID
	commits atomic.Uint64 // advanced by Commit only: tie-break epoch
	version atomic.Uint64 // membership / availability changes
	seed    uint64
	now     func() time.Time
}

// New validates cfg (zero fields take defaults) and returns a Router.
func New(cfg Config) (*Router, error) {
	def := DefaultConfig()
	if cfg.Policy == "" {
		cfg.Policy = def.Policy
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = def.BlockSize
	}
	if cfg.BlockSize < 0 {
		return nil, fmt.Errorf("router: block size %d must be positive", cfg.BlockSize)
	}
	if cfg.IndexTTL == 0 {
		cfg.IndexTTL = def.IndexTTL
	}
	if cfg.MaxIndexBlocks == 0 {
		cfg.MaxIndexBlocks = def.MaxIndexBlocks
	}
	if cfg.IndexTTL < 0 || cfg.MaxIndexBlocks < 0 || !finiteNonNeg(cfg.Temperature) {
		return nil, fmt.Errorf("router: index_ttl, max_index_blocks and temperature must not be negative (temperature finite)")
	}
	if cfg.Cost == (CostConfig{}) {
		cfg.Cost = def.Cost
	}
	if err := cfg.Cost.validate(); err != nil {
		return nil, err
	}
	mk, ok := policies[cfg.Policy]
	if !ok {
		return nil, fmt.Errorf("router: unknown policy %q (want one of %s)", cfg.Policy, PolicyNames())
	}
	r := &Router{cfg: cfg, seed: mix64(uint64(cfg.Seed) ^ 0x9e3779b97f4a7c15), now: cfg.Now}
	if r.now == nil {
		r.now = time.Now
	}
	r.pop = newPopularity()
	r.index = NewMemIndex(MemIndexConfig{MaxEntries: cfg.MaxIndexBlocks, Now: cfg.Now})
	p, err := mk(&r.cfg)
	if err != nil {
		return nil, fmt.Errorf("router: policy %s: %w", cfg.Policy, err)
	}
	r.policy = p
	empty, none := []*worker{}, []*worker{}
	r.workers.Store(&empty)
	r.live.Store(&none)
	return r, nil
}

// Config returns the effective configuration.
func (r *Router) Config() Config { return r.cfg }

// Index is the prefix index, for engine-event feeds (ttl 0) and inspection.
func (r *Router) Index() Index { return r.index }

// InstanceID is the stable numeric id of a worker name shown to clients
// (53 bits of xxh3, so it survives JSON numbers in any language).
func InstanceID(name string) uint64 {
	return xxh3.HashString(name) & (1<<53 - 1)
}

// AddWorker registers a worker by name (its backend id) and returns its id.
// It is idempotent; a removed worker comes back under the same id. New
// workers, and removed ones coming back, are available and in approximate
// mode.
func (r *Router) AddWorker(name string) WorkerID {
	if id, ok := r.byName.Load(name); ok {
		w := r.worker(id.(WorkerID))
		if w.removed.Load() {
			r.wmu.Lock()
			if w.removed.Load() { // not revived meanwhile (and maybe set to event mode since)
				w.approx.Store(true) // as a new worker: an event feed sets it again
				w.group.Store(0)     // and in group 0, its fit forgotten: the engine may be another
				w.cal.forget()
				w.removed.Store(false)
				w.available.Store(true)
				r.updateLive()
				r.version.Add(1)
			}
			r.wmu.Unlock()
		}
		return w.id
	}
	r.wmu.Lock()
	defer r.wmu.Unlock()
	if id, ok := r.byName.Load(name); ok {
		return id.(WorkerID)
	}
	old := *r.workers.Load()
	w := newWorker(WorkerID(len(old)), name, r.now)
	w.cal.enabled.Store(r.cfg.Calibrate)
	ws := make([]*worker, len(old)+1)
	copy(ws, old)
	ws[w.id] = w
	r.workers.Store(&ws)
	r.updateLive()
	r.byName.Store(name, w.id)
	r.byInst.Store(w.instance, w.id)
	r.version.Add(1)
	return w.id
}

// updateLive lists the workers not removed; the caller holds wmu.
func (r *Router) updateLive() {
	var live []*worker
	for _, w := range *r.workers.Load() {
		if !w.removed.Load() {
			live = append(live, w)
		}
	}
	r.live.Store(&live)
}

// IndexCapacity is the bound on the index's (block, worker) entries
// (Config.MaxIndexBlocks).
func (r *Router) IndexCapacity() int { return r.cfg.MaxIndexBlocks }

// RemoveWorker makes a worker unselectable, drops its index entries (and
// any routing history its policy keeps) and zeroes its load; Actives still
// open on it become no-ops.
func (r *Router) RemoveWorker(id WorkerID) {
	w := r.worker(id)
	if w == nil {
		return
	}
	r.wmu.Lock()
	r.mu.Lock() // no Commit in between: it would store the worker's blocks again
	w.removed.Store(true)
	w.available.Store(false)
	r.updateLive()
	w.reset()
	r.index.ClearWorker(id)
	if f, ok := r.policy.(workerForgetter); ok {
		f.forgetWorker(id)
	}
	r.version.Add(1)
	r.mu.Unlock()
	r.wmu.Unlock()
}

// SetAvailable marks a worker (un)available; unavailable workers are never
// selected, and pinning one gives ErrWorkerUnavailable.
func (r *Router) SetAvailable(id WorkerID, ok bool) {
	w := r.worker(id)
	if w == nil || w.removed.Load() {
		return
	}
	if w.available.Swap(ok) != ok {
		r.version.Add(1)
	}
}

// SetApproximate chooses how a worker's index entries arise: approximate
// workers (the default) get the prompt blocks of each Commit stored with
// Config.IndexTTL; event-mode workers get entries only from engine events
// applied through Index with ttl 0.
func (r *Router) SetApproximate(id WorkerID, approx bool) {
	if w := r.worker(id); w != nil {
		w.approx.Store(approx)
	}
}

// WorkerByName looks a worker up by name.
func (r *Router) WorkerByName(name string) (WorkerID, bool) {
	id, ok := r.byName.Load(name)
	if !ok {
		return 0, false
	}
	return id.(WorkerID), true
}

// WorkerByInstance looks a worker up by InstanceID.
func (r *Router) WorkerByInstance(instanceID uint64) (WorkerID, bool) {
	id, ok := r.byInst.Load(instanceID)
	if !ok {
		return 0, false
	}
	return id.(WorkerID), true
}

func (r *Router) worker(id WorkerID) *worker {
	ws := *r.workers.Load()
	if int(id) >= len(ws) {
		return nil
	}
	return ws[id]
}

// Workers returns an advisory snapshot of every known worker, in id order.
func (r *Router) Workers() []WorkerStatus {
	ws := *r.workers.Load()
	out := make([]WorkerStatus, len(ws))
	now := r.now().UnixNano()
	priors := fittedPriors(ws, now)
	for i, w := range ws {
		w.endDuePrefills(now)
		w.cal.relax(now, priors[w.group.Load()])
		sc := w.cal.factor()
		out[i] = WorkerStatus{
			Name: w.name, ID: w.id, InstanceID: w.instance,
			Available: w.available.Load(), Removed: w.removed.Load(), Approximate: w.approx.Load(),
			Inflight: w.inflight.Load(), PrefillTokens: w.prefill.Load(), ActiveBlocks: w.active.Load(),
			IndexedBlocks:     r.index.WorkerBlocks(w.id),
			Slowdown:          sc,
			PrefillMsPerToken: sc * r.cfg.Cost.PrefillMsPerToken, QueueMsPerToken: sc * r.cfg.Cost.QueueMsPerToken,
			TTFTSamples: w.cal.samples.Load(), PeerGroup: int(w.group.Load()),
			EngineWaiting: w.engWaiting.Load(), EngineRunning: w.engRunning.Load(),
			EngineKVUsage: w.engUsage(),
			Pending:       w.pending.Load(),
			CacheBlocks:   math.Float64frombits(w.capBlocks.Load()),
			LifetimeMs:    math.Float64frombits(w.lifeMs.Load()),
			Remote: Load{Inflight: w.remInflight.Load(), Pending: w.remPending.Load(),
				PrefillTokens: w.remPrefill.Load(), ActiveBlocks: w.remActive.Load()},
		}
	}
	return out
}

// Idle reports whether every load counter of every worker is zero (no
// request in flight). End-to-end tests check it after each test.
func (r *Router) Idle() bool {
	for _, w := range *r.workers.Load() {
		if !w.idle() {
			return false
		}
	}
	return true
}

// Select decides where req would go. It changes nothing a later decision
// would not see the same (it only ends unstreamed prefills already due, as
// any read of the counters does): a dry run uses it alone, and a Route of
// the same request with nothing changed in between picks the same worker.
func (r *Router) Select(req *Request) (Decision, error) {
	return r.selectWorker(req, r.now().UnixNano())
}

// Commit registers req on d.Worker: load, approximate-mode index records,
// policy state. The caller ends the returned Active with Free.
func (r *Router) Commit(req *Request, d Decision) *Active {
	r.mu.Lock()
	a := r.commit(req, &d, r.now().UnixNano())
	r.mu.Unlock()
	return a
}

// Route is Select followed by Commit, atomic with respect to other Routes
// and Commits.
func (r *Router) Route(req *Request) (Decision, *Active, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now().UnixNano() // one clock read for both halves
	d, err := r.selectWorker(req, now)
	if err != nil {
		return d, nil, err
	}
	return d, r.commit(req, &d, now), nil
}

// selectWorker and commit take the time (Unix ns) from their caller.
func (r *Router) selectWorker(req *Request, now int64) (Decision, error) {
	// The version is read before availability: a policy caching per
	// version (prefix_hash's ring) must never file candidates older than
	// the version under it, or a worker made available meanwhile would be
	// left out of the cached ring until the next change.
	version := r.version.Load()
	live := *r.live.Load() // before ws: every worker it lists has its id in ws
	ws := *r.workers.Load()
	if req.Pinned {
		if int(req.Pin) >= len(ws) || !ws[req.Pin].available.Load() {
			return Decision{}, ErrWorkerUnavailable
		}
	}
	sc := getScratch()
	defer putScratch(sc)
	sc.ov = r.index.Match(req.Hashes, sc.ov)
	if cap(sc.pos) < len(ws) {
		sc.pos = make([]int32, len(ws))
		for i := range sc.pos {
			sc.pos[i] = -1
		}
	}
	pos := sc.pos[:len(ws)]
	for i := range sc.ov {
		if int(sc.ov[i].Worker) < len(pos) {
			pos[sc.ov[i].Worker] = int32(i)
		}
	}
	cands := req.CandidateBuf[:0]
	if cap(cands) < len(live) {
		cands = make([]Candidate, 0, len(live))
	}
	bs := r.cfg.BlockSize
	waiters := meanPending(live)
	priors := fittedPriors(live, now)
	partial := false
	for _, w := range live {
		if !w.available.Load() {
			continue
		}
		if !req.Pinned && slices.Contains(req.Avoid, w.id) {
			partial = true
			continue
		}
		w.endDuePrefills(now)
		w.cal.relax(now, priors[w.group.Load()])
		c := Candidate{
			Worker: w.id, Name: w.name,
			Inflight: w.inflight.Load() + w.remInflight.Load(), Pending: w.pending.Load() + w.remPending.Load(),
			PrefillTokens: w.prefill.Load() + w.remPrefill.Load(), ActiveBlocks: w.active.Load() + w.remActive.Load(),
		}
		if p := pos[w.id]; p >= 0 {
			o := &sc.ov[p]
			c.Overlap, c.Tiers = int(o.Depth), o.Tiers
			pos[w.id] = -1
		}
		c.MemoryMs = w.memoryWaitMs(c.ActiveBlocks, max((req.PromptTokens+bs-1)/bs-c.Overlap, 0))
		c.CostMs = r.cfg.Cost.predict(w.cal.factor(), &c, req.PromptTokens, bs, w.engineQueue(bs))
		c.ExternalMs = r.cfg.Cost.externality(&c, req.PromptTokens, bs, waiters)
		c.Score = c.CostMs
		cands = append(cands, c)
	}
	for i := range sc.ov { // workers no longer listed
		if int(sc.ov[i].Worker) < len(pos) {
			pos[sc.ov[i].Worker] = -1
		}
	}
	if len(cands) == 0 {
		return Decision{}, ErrNoWorker
	}
	if !req.Pinned && r.cfg.Policy == "kv" { // the only policy that reads ReplicaMs
		r.priceReplicas(req, cands, ws, bs)
	}
	var k int
	if req.Pinned {
		if k = candIndex(cands, req.Pin); k < 0 {
			return Decision{}, ErrWorkerUnavailable
		}
	} else {
		sc.snap = Snapshot{Req: req, Cands: cands, BlockSize: bs, Seed: r.tieSeed(req), Version: version, Partial: partial, Temperature: r.cfg.Temperature}
		k = r.policy.Pick(&sc.snap)
		sc.snap = Snapshot{}
	}
	c := &cands[k]
	return Decision{
		Worker: c.Worker, Name: c.Name, InstanceID: ws[c.Worker].instance,
		Overlap: c.Overlap, Total: len(req.Hashes), PredictedTTFTms: c.CostMs,
		Candidates: cands,
	}, nil
}

// priceReplicas sets each candidate's ReplicaMs. A prefix that a share s
// of the live requests began with, held by k of the n candidates, is
// under-replicated while s·n > k: its traffic cannot spread over the workers
// that hold it, so their batches grow while the others idle. A candidate
// lacking such a prefix (down to the deepest under-replicated sampled
// depth) would compute it once, X ms of prefill, and hold it for the F
// requests expected to begin with it: as many as did among the last
// requests counted (popularity). kv takes X·F/(1+F) off its score: the
// miss amortised over the copy's uses, which a per-request TTFT does not
// see. A system prompt the live conversations share is copied to a worker
// less busy than its holders. A conversation's history is not: while its
// next turn is routed no other live request holds it, or one of its own
// does, and a prefix is shared only if two live requests hold it at least.
// Nor is a prefix held by every candidate, or begun by at most 1/n of the
// requests counted.
func (r *Router) priceReplicas(req *Request, cands []Candidate, ws []*worker, bs int) {
	minO, maxO := cands[0].Overlap, cands[0].Overlap
	liveTotal := int64(0)
	for i := range cands {
		minO, maxO = min(minO, cands[i].Overlap), max(maxO, cands[i].Overlap)
		liveTotal += ws[cands[i].Worker].inflight.Load()
	}
	if minO == maxO || liveTotal == 0 {
		return
	}
	type sample struct {
		depth, held int
		under       bool
		uses        float64 // F
	}
	var samples [64]sample // sampled depths in (minO, maxO] until a prefix is not popular
	m, n := 0, float64(len(cands))
	// holders counts the candidates holding the prefix at depth d, and the
	// live requests on them, which bound live(d) from above.
	holders := func(d int) (k int, busy int64) {
		for j := range cands {
			if cands[j].Overlap >= d {
				k++
				busy += ws[cands[j].Worker].inflight.Load()
			}
		}
		return k, busy
	}
	// live counts the live requests holding the prefix at depth d, on the
	// workers that hold it (the live requests that began with a prefix run
	// where it is cached, or being cached), deeper at each call: a worker
	// with none holding a prefix has none holding a longer one, so after the
	// first call only the workers that had some are asked.
	var with [64]int32 // indices in cands
	nWith := -1        // -1: ask every holder
	live := func(d int) (l int64) {
		h, k := req.Hashes[d-1], 0
		ask := func(j int) {
			w := ws[cands[j].Worker]
			if cands[j].Overlap < d || w.inflight.Load() == 0 {
				return // an idle worker: no lock taken
			}
			if v := w.liveRequests(h); v > 0 {
				l += int64(v)
				if k < len(with) {
					with[k] = int32(j)
				}
				k++
			}
		}
		if nWith < 0 {
			for j := range cands {
				ask(j)
			}
		} else {
			for _, j := range with[:nWith] {
				ask(int(j))
			}
		}
		if nWith = k; k > len(with) {
			nWith = -1
		}
		return l
	}
	r.pop.mu.Lock()
	total := float64(r.pop.n + r.pop.prevN)
	d, count := 1, 0.0
	for ; d <= maxO && m < len(samples)-1; d = nextDepth(d) {
		if d > minO {
			// nor is any deeper prefix popular: k ≥ 1 up to maxO
			if count = float64(r.pop.countLocked(req.Hashes[d-1])); count*n <= total {
				break
			}
			samples[m] = sample{depth: d, uses: count}
			m++
		}
	}
	r.pop.mu.Unlock()
	for j := range samples[:m] {
		x := &samples[j]
		var busy int64
		x.held, busy = holders(x.depth)
		bar := float64(x.held) * float64(liveTotal)
		if float64(busy)*n > bar {
			// One live request holding it is one conversation's (an
			// earlier request of its own still running): a copy is for a
			// prefix that several share.
			l := live(x.depth)
			x.under = l >= 2 && float64(l)*n > bar
		}
	}
	// The samples ran out before maxO with the prefix still popular, and
	// every worker holding it holds the blocks up to maxO, less than a
	// quarter of it, too: they count as part of it. (If some hold only the
	// prefix, the blocks past it are another request's own.)
	if d > maxO && m > 0 && samples[m-1].depth < maxO && samples[m-1].under {
		if k, _ := holders(maxO); k == samples[m-1].held {
			samples[m] = samples[m-1]
			samples[m].depth = maxO
			m++
		}
	}
	for i := range cands {
		c := &cands[i]
		deep, uses := c.Overlap, 0.0
		for _, x := range samples[:m] {
			if x.depth <= c.Overlap {
				continue
			}
			if !x.under {
				break
			}
			deep, uses = x.depth, x.uses
		}
		if deep > c.Overlap {
			w := ws[c.Worker]
			copied := *c
			copied.Overlap = deep
			x := c.CostMs - r.cfg.Cost.predict(w.cal.factor(), &copied, req.PromptTokens, bs, w.engineQueue(bs))
			c.ReplicaMs = x * uses / (1 + uses)
		}
	}
}

// CountedRequests is how many routed requests the prefixes' popularity
// counts at the moment (the last popWindow to 2·popWindow, advisory): each
// once, whatever routes it again (Request.Repeat).
func (r *Router) CountedRequests() int {
	r.pop.mu.Lock()
	defer r.pop.mu.Unlock()
	return r.pop.n + r.pop.prevN
}

// peerGroups bounds SetPeerGroup's groups.
const peerGroups = 4

// SetPeerGroup puts a worker among the peers its fitted speed is compared
// with: an idle worker's fit drifts to the mean fit of its group's workers
// measured lately (see calibrator). A disaggregated fleet's prefill engines
// are one group and its decode engines another: their TTFTs measure other
// work. Workers start in group 0 (a removed one added again too); group is
// taken modulo peerGroups. A worker moved to another group forgets its fit,
// which was of the other group's work.
func (r *Router) SetPeerGroup(id WorkerID, group int) {
	w := r.worker(id)
	if w == nil {
		return
	}
	g := uint32((group%peerGroups + peerGroups) % peerGroups)
	if w.group.Swap(g) != g {
		w.cal.forget()
	}
}

// fittedPriors are the factors an idle worker's fit drifts to, by peer
// group: the mean factor of the group's available workers measured lately,
// 1 (as configured) where none is.
func fittedPriors(ws []*worker, now int64) (priors [peerGroups]float64) {
	var n [peerGroups]int
	for _, w := range ws {
		if g := w.group.Load(); w.available.Load() && w.cal.measured(now) {
			n[g]++
			priors[g] += w.cal.factor()
		}
	}
	for g := range priors {
		if n[g] == 0 {
			priors[g] = 1
		} else {
			priors[g] /= float64(n[g])
		}
	}
	return priors
}

// meanPending is the mean number of requests awaiting their first token per
// available worker.
func meanPending(ws []*worker) float64 {
	n, sum := 0, int64(0)
	for _, w := range ws {
		if w.available.Load() {
			n++
			sum += w.pending.Load() + w.remPending.Load()
		}
	}
	if n == 0 {
		return 0
	}
	return float64(sum) / float64(n)
}

// tieSeed is deterministic for a request until the next Commit.
func (r *Router) tieSeed(req *Request) uint64 {
	var h uint64
	if len(req.Hashes) > 0 {
		h = uint64(req.Hashes[0])
	} else {
		h = uint64(req.PromptTokens) * 0xbf58476d1ce4e5b9
	}
	return mix64(h ^ r.seed ^ mix64(r.commits.Load()))
}

func (r *Router) commit(req *Request, d *Decision, now int64) *Active {
	w := r.worker(d.Worker)
	if w == nil {
		return &Active{freed: true}
	}
	bs := r.cfg.BlockSize
	uncached := int64(req.PromptTokens - d.Overlap*bs)
	if uncached < 0 {
		uncached = 0
	}
	partial := int64(0)
	if req.PromptTokens > len(req.Hashes)*bs {
		partial = 1
	}
	a := &Active{w: w, partial: partial, prefill: uncached, uncached: uncached, unstreamed: req.Unstreamed, aux: req.Auxiliary}
	c := Candidate{ActiveBlocks: w.active.Load(), PrefillTokens: w.prefill.Load()}
	if k := candIndex(d.Candidates, d.Worker); k >= 0 {
		c = d.Candidates[k]
	}
	a.fetchMs = r.cfg.Cost.fetch(&c) + c.MemoryMs // not scaled by the calibrator
	a.start = now
	if req.Unstreamed && d.PredictedTTFTms > 0 {
		a.dueNs = a.start + int64(d.PredictedTTFTms*float64(time.Millisecond))
	}
	// The calibrator regresses on what predict priced: the larger of the
	// router's and the engine's queue (else an engine's own queue would be
	// fitted as slowness, then counted again).
	a.computMs = r.cfg.Cost.compute(&c, int(uncached), max(c.PrefillTokens, w.engineQueue(bs)))
	a.hashes = getHashes(req.Hashes)
	if !w.add(a) {
		a.freed = true // worker removed meanwhile
		return a
	}
	if w.approx.Load() {
		if len(req.Hashes) > 0 {
			r.index.Store(w.id, req.Hashes, kv.TierDevice, r.cfg.IndexTTL)
		}
	} else if n := min(d.Overlap, len(req.Hashes)); n > 0 {
		r.index.Touch(w.id, req.Hashes[:n]) // event mode: the hit keeps them hot
	}
	if len(req.Hashes) > 0 && !req.Repeat && !req.Auxiliary {
		r.pop.record(req.Hashes)
	}
	r.dec = *d
	r.policy.Commit(req, &r.dec)
	r.dec = Decision{}
	r.commits.Add(1)
	return a
}

// mix64 is splitmix64's finaliser.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

type scratch struct {
	snap Snapshot
	ov   []Overlap
	pos  []int32 // WorkerID → index in ov, -1 elsewhere
}

var scratchPool = sync.Pool{New: func() any { return &scratch{ov: make([]Overlap, 0, 64)} }}

func getScratch() *scratch  { return scratchPool.Get().(*scratch) }
func putScratch(s *scratch) { scratchPool.Put(s) }

// SetEngineLoad feeds the engine's own view of its load (scraped metrics):
// waiting and running requests and KV-cache usage in [0, 1]. The cost model
// then uses as the worker's queue the larger of the router's own queued
// prefill tokens and waiting × the worker's mean uncached tokens per
// request, which catches traffic the router did not send. While nothing
// waits, kvUsage against the router's own active blocks estimates the
// engine's KV capacity, which prices the wait for KV memory
// (Candidate.MemoryMs). running and kvUsage are shown in Workers.
// SetEngineCapacity feeds the engine's KV capacity in the router's blocks,
// as the engine reports it (vLLM's cache_config_info). It replaces the
// estimate from usage, which is low when other proxies or clients share the
// engine. 0 goes back to estimating.
func (r *Router) SetEngineCapacity(id WorkerID, blocks float64) {
	w := r.worker(id)
	if w == nil || !(blocks >= 0) || math.IsInf(blocks, 0) {
		return
	}
	w.capReported.Store(blocks > 0)
	w.capBlocks.Store(math.Float64bits(blocks))
}

// MaxRemoteLoad bounds each field of a remote load (SetRemoteLoad): far
// above any real load, and far enough below the int64 limit that adding
// this router's own (and summing over workers) cannot wrap negative.
const MaxRemoteLoad = 1 << 40

// SetRemoteLoad sets the load other routers (kvproxy replicas) put on the
// worker, summed over them: selection weighs it like this router's own, so
// replicas do not pile onto one engine. It replaces the previous value;
// each field is clamped to [0, MaxRemoteLoad].
func (r *Router) SetRemoteLoad(id WorkerID, l Load) {
	w := r.worker(id)
	if w == nil {
		return
	}
	w.remInflight.Store(min(max(l.Inflight, 0), MaxRemoteLoad))
	w.remPending.Store(min(max(l.Pending, 0), MaxRemoteLoad))
	w.remPrefill.Store(min(max(l.PrefillTokens, 0), MaxRemoteLoad))
	w.remActive.Store(min(max(l.ActiveBlocks, 0), MaxRemoteLoad))
}

func (r *Router) SetEngineLoad(id WorkerID, waiting, running int, kvUsage float64) {
	w := r.worker(id)
	if w == nil {
		return
	}
	w.engWaiting.Store(int64(max(waiting, 0)))
	w.engRunning.Store(int64(max(running, 0)))
	w.engKVUsage.Store(math.Float64bits(kvUsage))
	w.observeCapacity(waiting, kvUsage)
}

// hashPool recycles the prompt-hash copies Actives hold until Free.
var hashPool = sync.Pool{New: func() any { return new([]kv.BlockHash) }}

func getHashes(src []kv.BlockHash) *[]kv.BlockHash {
	p := hashPool.Get().(*[]kv.BlockHash)
	*p = append((*p)[:0], src...)
	return p
}
