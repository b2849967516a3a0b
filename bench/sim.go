package bench

import (
	"container/heap"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/mockengine"
	"github.com/kvproxy/kvproxy/router"
)

// PolicyKVFixed is the simulator's name for the kv policy with calibration
// off (fixed cost coefficients), for comparing the two in one run.
const PolicyKVFixed = "kv_fixed"

// SimConfig is the simulated fleet. Zero fields take DefaultSimConfig's values.
type SimConfig struct {
	Engines     int
	CacheBlocks int // KV blocks per engine
	BlockSize   int
	// Speed is each engine's speed factor (1 = the fitted step times, 0.5 =
	// steps take twice as long); missing entries are 1.
	Speed []float64
	// Approximate runs the router without engine KV events: it indexes its
	// own decisions with a TTL. By default engines' cache events feed the
	// router's index, as vLLM's ZMQ feed does.
	Approximate bool
	// IndexTTL is the approximate-mode entry lifetime (0: the router's default).
	IndexTTL time.Duration
	// NoCalibrate turns off the kv policy's online refit of its coefficients.
	NoCalibrate bool
	// Seed seeds token synthesis and the router's tie-breaking.
	Seed uint64
	// MaxNumSeqs and MaxNumBatchedTokens are the engines' scheduler limits
	// (0: mockengine's defaults, vLLM's).
	MaxNumSeqs          int
	MaxNumBatchedTokens int
	// HostCacheBlocks gives each engine a host (CPU) tier of this many
	// blocks (0: none).
	HostCacheBlocks int
	// DuplicateBlocks has the engines keep and report every copy of a
	// block, as vLLM does (mockengine.ModelConfig.DuplicateBlocks).
	DuplicateBlocks bool
	// StepOverhead is added to every engine step: the time a real engine
	// (or a live mock engine) spends outside the fitted step time, such as
	// scheduling and waking up. 0 models the fit alone.
	StepOverhead time.Duration
	// HopPerToken and HopJitter model the hop from the router's decision to
	// the engine's queue: the proxy writing the request, the engine reading
	// and parsing it. Each request reaches its engine HopPerToken × its
	// prompt tokens plus an exponentially distributed extra of mean
	// HopJitter (seeded) after it was routed, so requests routed together
	// can reach an engine in another order, as they do live. Its TTFT
	// counts the hop. With PrefillEngines a request makes the hop twice, as
	// kvproxy sends it to the decode engine once the prefill is done. Zero:
	// the engine has it at once.
	HopPerToken, HopJitter time.Duration
	// Done, if set, is called at the end of each policy's run with the
	// router's final view of its workers (fitted coefficients, index sizes).
	// Runs of different policies call it concurrently.
	Done func(policy string, workers []router.WorkerStatus)
	// OnRequest, if set, receives each request's record as it finishes or
	// fails (Worker is the engine's name, engine-N; Err says why a request
	// failed). Runs of different policies call it concurrently.
	OnRequest func(policy string, r RequestRecord)
	// Pin, if set, sends request i to engine Pin[i] (when 0 ≤ Pin[i] <
	// Engines) instead of where the policy would: replays a recorded
	// assignment.
	Pin []int
	// Scrape, when positive, feeds every engine's waiting and running
	// requests and KV usage to the router at this interval, as the proxy's
	// /metrics scrape does.
	Scrape time.Duration
	// Replicas is how many kvproxy replicas route (0 or 1: one), each with
	// a router of its own, behind a balancer that hands them requests in
	// turn. Every replica's index follows the engines' events (or its own
	// decisions in approximate mode).
	Replicas int
	// ShareLoad, with several replicas, is how often each tells the others
	// its load, as replicas.nats does (0: never; each sees only its own).
	ShareLoad time.Duration
	// Temperature is the router's (router.temperature): above 0, a
	// policy samples among near-best workers instead of taking the best.
	Temperature float64
	// PrefillEngines makes the first this many engines prefill engines
	// (backends[].role: prefill): each request's prompt is computed on one
	// of them, routed by the policy on its blocks, then decoded on one of
	// the others, which pulls its KV (mockengine.Seq.RemoteKV) at no cost.
	// Its TTFT is the decode engine's first token.
	PrefillEngines int
}

// DefaultSimConfig is the reference fleet: 8 engines sized like
// Llama-3.1-8B on an H100 (30,000 blocks of 16 tokens ≈ 480k tokens each).
func DefaultSimConfig() SimConfig {
	d := mockengine.DefaultModelConfig()
	return SimConfig{Engines: 8, CacheBlocks: d.CacheBlocks, BlockSize: d.BlockSize, Seed: 1}
}

func (c SimConfig) withDefaults() SimConfig {
	d := DefaultSimConfig()
	if c.Engines <= 0 {
		c.Engines = d.Engines
	}
	if c.CacheBlocks <= 0 {
		c.CacheBlocks = d.CacheBlocks
	}
	if c.BlockSize <= 0 {
		c.BlockSize = d.BlockSize
	}
	return c
}

// HeteroSpeeds returns speeds for n engines where the second half runs at
// slow (e.g. 0.5: half the engines at half speed).
func HeteroSpeeds(n int, slow float64) []float64 {
	s := make([]float64, n)
	for i := range s {
		s[i] = 1
		if i >= n-n/2 {
			s[i] = slow
		}
	}
	return s
}

// SimPolicies lists the policies the simulator runs by default: every
// router policy.
func SimPolicies() []string { return strings.Split(router.PolicyNames(), ", ") }

// SimulateAll runs one simulation per policy, in parallel on up to
// GOMAXPROCS cores, and returns the results in policy order.
func SimulateAll(w *Workload, cfg SimConfig, policies []string) ([]Result, error) {
	results := make([]Result, len(policies))
	errs := make([]error, len(policies))
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	var wg sync.WaitGroup
	for i, p := range policies {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			results[i], errs[i] = Simulate(w, cfg, p)
		})
	}
	wg.Wait()
	return results, errors.Join(errs...)
}

// Simulate runs the workload through a simulated fleet on a virtual clock,
// with the real router (policy) making every decision. The same workload,
// config and policy always give the same result.
func Simulate(w *Workload, cfg SimConfig, policy string) (Result, error) {
	s, err := newSim(cfg, policy)
	if err != nil {
		return Result{}, err
	}
	s.run(w)
	for _, rt := range s.rts {
		if !rt.Idle() {
			return Result{}, fmt.Errorf("sim %s: router load counters not zero after the run", policy)
		}
	}
	if cfg.Done != nil {
		cfg.Done(policy, s.rts[0].Workers())
	}
	return s.rec.Result(policy), nil
}

var simEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

type sim struct {
	cfg     SimConfig
	policy  string
	syn     Synth
	rts     []*router.Router // one per replica
	engines []*simEngine
	now     time.Duration
	rec     Recorder
	reqs    []*simReq // by request index while in flight
	tokPool [][]uint32
	hashes  []kv.BlockHash
	cands   []router.Candidate
	hops    hopQueue // requests routed, not yet at their engine
	// with PrefillEngines: the workers each stage leaves out
	decodeAvoid, prefillAvoid []router.WorkerID
}

type simEngine struct {
	id     router.WorkerID
	name   string
	model  *mockengine.Model
	slow   float64 // step time multiplier
	busy   bool
	end    time.Duration // when the running step ends
	out    []mockengine.StepResult
	events []kv.Event
	// feeds apply its cache events to each replica's index, as kvproxy's
	// event feed does (nil in approximate mode).
	feeds []*backends.KVApplier
}

type simReq struct {
	r       *Request
	seq     mockengine.Seq
	act     *router.Active
	arrival time.Duration
	last    time.Duration
	ttft    time.Duration
	// a disaggregated prefill's (PrefillEngines): its sequence while it
	// runs on the prefill engine, its slot there, and the decode engine
	// the request goes to afterwards
	pre    *mockengine.Seq
	preAct *router.Active
	dec    *simEngine
	// cached is the prompt tokens the prefill engine found cached (-1: no
	// prefill stage; the decode engine's count is the hit rate's)
	cached int
}

func newSim(cfg SimConfig, policy string) (*sim, error) {
	cfg = cfg.withDefaults()
	rc := router.DefaultConfig()
	rc.Policy = policy
	if policy == PolicyKVFixed {
		rc.Policy = "kv"
		cfg.NoCalibrate = true
	}
	rc.BlockSize = cfg.BlockSize
	rc.Calibrate = !cfg.NoCalibrate
	rc.Seed = int64(cfg.Seed)
	rc.Temperature = cfg.Temperature
	if cfg.IndexTTL > 0 {
		rc.IndexTTL = cfg.IndexTTL
	}
	s := &sim{cfg: cfg, policy: policy, syn: Synth{Seed: cfg.Seed}}
	rc.Now = func() time.Time { return simEpoch.Add(s.now) }
	for range max(cfg.Replicas, 1) {
		rt, err := router.New(rc)
		if err != nil {
			return nil, err
		}
		s.rts = append(s.rts, rt)
	}
	for i := 0; i < cfg.Engines; i++ {
		name := fmt.Sprintf("engine-%d", i)
		var id router.WorkerID
		for _, rt := range s.rts { // the same ids in every replica
			id = rt.AddWorker(name)
			rt.SetApproximate(id, cfg.Approximate)
			if i < cfg.PrefillEngines {
				rt.SetPeerGroup(id, 1)
			}
		}
		e := &simEngine{
			id:   id,
			name: name,
			model: mockengine.NewModel(mockengine.ModelConfig{
				BlockSize:           cfg.BlockSize,
				CacheBlocks:         cfg.CacheBlocks,
				MaxNumSeqs:          cfg.MaxNumSeqs,
				MaxNumBatchedTokens: cfg.MaxNumBatchedTokens,
				HostCacheBlocks:     cfg.HostCacheBlocks,
				RecordEvents:        !cfg.Approximate,
				DuplicateBlocks:     cfg.DuplicateBlocks,
			}),
			slow: 1,
		}
		if !cfg.Approximate {
			for _, rt := range s.rts {
				e.feeds = append(e.feeds, backends.NewKVApplier(backends.KVApplierConfig{Backend: name, BlockSize: cfg.BlockSize}, rt))
			}
		}
		if i < len(cfg.Speed) && cfg.Speed[i] > 0 {
			e.slow = 1 / cfg.Speed[i]
		}
		s.engines = append(s.engines, e)
	}
	s.cands = make([]router.Candidate, 0, cfg.Engines)
	for i, e := range s.engines {
		if i < cfg.PrefillEngines {
			s.decodeAvoid = append(s.decodeAvoid, e.id)
		} else {
			s.prefillAvoid = append(s.prefillAvoid, e.id)
		}
	}
	return s, nil
}

// run is the event loop: request arrivals, their hops to the engines and
// engine step ends, in time order, with the load scrapes and shares. At
// equal times load shares and scrapes come first, then step ends (engines
// in index order), then hops (in routing order), then arrivals.
func (s *sim) run(w *Workload) {
	s.reqs = make([]*simReq, len(w.Requests))
	next := 0
	nextScrape := s.cfg.Scrape
	share := s.cfg.ShareLoad
	if len(s.rts) < 2 {
		share = 0
	}
	nextShare := share
	for {
		e := -1
		for i, en := range s.engines {
			if en.busy && (e < 0 || en.end < s.engines[e].end) {
				e = i
			}
		}
		hopAt := time.Duration(math.MaxInt64)
		if len(s.hops) > 0 {
			hopAt = s.hops[0].at
		}
		working := next < len(w.Requests) || e >= 0 || len(s.hops) > 0
		if share > 0 && working && nextShare <= hopAt &&
			(next >= len(w.Requests) || nextShare <= w.Requests[next].Arrival) &&
			(e < 0 || nextShare <= s.engines[e].end) {
			s.now = max(s.now, nextShare)
			s.shareLoad()
			nextShare += share
			continue
		}
		if s.cfg.Scrape > 0 && working && nextScrape <= hopAt &&
			(next >= len(w.Requests) || nextScrape <= w.Requests[next].Arrival) &&
			(e < 0 || nextScrape <= s.engines[e].end) {
			s.now = max(s.now, nextScrape)
			for _, en := range s.engines {
				for _, rt := range s.rts {
					rt.SetEngineLoad(en.id, en.model.Waiting(), en.model.Running(), en.model.Usage())
					// The capacity vLLM reports in cache_config_info, as kvproxy reads it.
					rt.SetEngineCapacity(en.id, float64(s.cfg.CacheBlocks))
				}
			}
			nextScrape += s.cfg.Scrape
			continue
		}
		if len(s.hops) > 0 && (next >= len(w.Requests) || hopAt <= w.Requests[next].Arrival) &&
			(e < 0 || hopAt < s.engines[e].end) {
			h := heap.Pop(&s.hops).(hop)
			s.now = max(s.now, h.at)
			s.deliver(h.i, h.en)
			continue
		}
		if next < len(w.Requests) && (e < 0 || w.Requests[next].Arrival < s.engines[e].end) {
			s.now = max(s.now, w.Requests[next].Arrival)
			s.arrive(next, &w.Requests[next])
			next++
			continue
		}
		if e < 0 {
			return
		}
		s.now = s.engines[e].end
		s.finishStep(s.engines[e])
		s.startStep(s.engines[e])
	}
}

func (s *sim) arrive(i int, r *Request) {
	if reason := s.unservable(r); reason != "" {
		// As an engine would refuse it, but without building a prompt
		// that may not even fit in memory.
		s.fail(i, r, "", reason)
		return
	}
	var tok []uint32
	if n := len(s.tokPool); n > 0 {
		tok, s.tokPool = s.tokPool[n-1][:0], s.tokPool[:n-1]
	}
	tok = s.syn.Tokens(tok, r)
	s.hashes = kv.HashBlocks(s.hashes[:0], tok, s.cfg.BlockSize, 0)
	req := router.Request{Hashes: s.hashes, PromptTokens: len(tok), CandidateBuf: s.cands}
	if i < len(s.cfg.Pin) && s.cfg.Pin[i] >= 0 && s.cfg.Pin[i] < len(s.engines) {
		req.Pinned, req.Pin = true, s.engines[s.cfg.Pin[i]].id
	}
	disaggregated := s.cfg.PrefillEngines > 0 && !req.Pinned
	if disaggregated {
		req.Avoid = s.decodeAvoid
	}
	rt := s.rts[i%len(s.rts)]
	d, act, err := rt.Route(&req)
	if err != nil {
		s.tokPool = append(s.tokPool, tok)
		s.fail(i, r, "", err.Error())
		return
	}
	best := 0
	for _, c := range d.Candidates {
		best = max(best, c.Overlap)
	}
	s.rec.Forgone((best - d.Overlap) * s.cfg.BlockSize)
	sr := &simReq{r: r, act: act, arrival: s.now, cached: -1}
	sr.seq = mockengine.Seq{ID: uint64(i), Prompt: tok, MaxTokens: max(r.OutputLen, 1)}
	en := s.engineOf(d.Worker)
	if disaggregated {
		// The decode engine's slot is held (as kvproxy holds it); the
		// prompt goes to a prefill engine first.
		pre := router.Request{Hashes: s.hashes, PromptTokens: len(tok), Unstreamed: true, Avoid: s.prefillAvoid, CandidateBuf: s.cands, Repeat: true}
		if pd, pact, err := rt.Route(&pre); err == nil {
			sr.pre = &mockengine.Seq{ID: uint64(i), Prompt: tok, MaxTokens: 1}
			sr.preAct, sr.dec, sr.seq.RemoteKV = pact, en, true
			en = s.engineOf(pd.Worker)
		}
	}
	s.reqs[i] = sr
	s.send(i, 0, en)
}

// send puts request i into en's queue after the hop (SimConfig.HopPerToken),
// at once when there is none. The jitter is drawn from the seed, the request
// and its stage (0, or 1 for a prefill stage's decode engine) alone, so every
// policy sees the same hops.
func (s *sim) send(i, stage int, en *simEngine) {
	if s.cfg.HopPerToken <= 0 && s.cfg.HopJitter <= 0 {
		s.deliver(i, en)
		return
	}
	u := float64(mix64(s.cfg.Seed^0x686f70<<32^uint64(i)<<1^uint64(stage))>>11) / (1 << 53) // "hop"; uniform in [0, 1)
	d := float64(len(s.reqs[i].seq.Prompt))*float64(s.cfg.HopPerToken) - math.Log(1-u)*float64(s.cfg.HopJitter)
	heap.Push(&s.hops, hop{at: s.now + time.Duration(d), i: i, en: en})
}

// deliver puts routed request i into its engine's queue: its prefill
// engine's while it has a prefill stage to run.
func (s *sim) deliver(i int, en *simEngine) {
	sr := s.reqs[i]
	seq := &sr.seq
	if sr.pre != nil {
		seq = sr.pre
	}
	if err := en.model.Add(seq); err != nil {
		sr.act.Free()
		if sr.preAct != nil {
			sr.preAct.Free()
		}
		s.tokPool = append(s.tokPool, sr.seq.Prompt)
		s.reqs[i] = nil
		s.fail(i, sr.r, en.name, err.Error())
		return
	}
	if !en.busy {
		s.startStep(en)
	}
}

// hop is a routed request on its way to its engine (SimConfig.HopPerToken).
type hop struct {
	at time.Duration
	i  int
	en *simEngine
}

// hopQueue is a min-heap of hops by arrival at the engine, then routing
// order.
type hopQueue []hop

func (q hopQueue) Len() int { return len(q) }
func (q hopQueue) Less(a, b int) bool {
	return q[a].at < q[b].at || q[a].at == q[b].at && q[a].i < q[b].i
}
func (q hopQueue) Swap(a, b int) { q[a], q[b] = q[b], q[a] }
func (q *hopQueue) Push(x any)   { *q = append(*q, x.(hop)) }
func (q *hopQueue) Pop() any {
	old := *q
	h := old[len(old)-1]
	*q = old[:len(old)-1]
	return h
}

// unservable says why no engine could take r ("" when one could): an
// empty prompt, or a prompt and output beyond its KV cache (mockengine's
// own checks).
func (s *sim) unservable(r *Request) string {
	bs := s.cfg.BlockSize
	switch {
	case r.InputLen == 0:
		return "empty prompt"
	case (r.InputLen+max(r.OutputLen, 1)+bs-1)/bs > s.cfg.CacheBlocks:
		// One reason for all (the dump has each one's lengths), so the
		// failures group.
		return fmt.Sprintf("prompt and output exceed an engine's KV cache (%d blocks of %d tokens)", s.cfg.CacheBlocks, bs)
	}
	return ""
}

// fail records request i as failed, and hands its record (with the
// reason) to OnRequest.
func (s *sim) fail(i int, r *Request, worker, reason string) {
	s.rec.Error(r.Arrival, s.now, reason)
	if s.cfg.OnRequest != nil {
		s.cfg.OnRequest(s.policy, RequestRecord{Index: i, Arrival: r.Arrival, Sent: r.Arrival, Worker: worker,
			Prompt: r.InputLen, Err: reason})
	}
}

func (s *sim) engineOf(id router.WorkerID) *simEngine {
	for _, e := range s.engines {
		if e.id == id {
			return e
		}
	}
	panic("sim: router chose an unknown worker")
}

// startStep runs the engine's next step now; its results become visible
// when the step ends.
func (s *sim) startStep(e *simEngine) {
	d, out := e.model.Step()
	if d == 0 && len(out) == 0 {
		e.busy = false
		return
	}
	e.busy = true
	e.end = s.now + time.Duration(float64(d)*e.slow) + s.cfg.StepOverhead
	e.out = out
	if !s.cfg.Approximate {
		e.events = e.model.DrainEvents(e.events[:0])
	}
}

// finishStep delivers a finished step: tokens to their requests and the
// router's load tracking, cache events to the router's index.
func (s *sim) finishStep(e *simEngine) {
	bs := s.cfg.BlockSize
	for _, res := range e.out {
		id := int(res.Seq.ID)
		sr := s.reqs[id]
		if sr.pre != nil && res.Seq == sr.pre {
			// The prefill is done: the decode engine pulls its KV.
			sr.preAct.PrefillDone()
			sr.preAct.Free()
			sr.pre, sr.preAct, sr.cached = nil, nil, res.CachedTokens
			s.send(id, 1, sr.dec)
			continue
		}
		if res.Generated == 1 {
			sr.ttft = s.now - sr.arrival
			sr.act.PrefillDone()
			sr.act.ObserveTTFT(sr.ttft)
		} else {
			s.rec.ITL(s.now-sr.last, 1)
		}
		sr.last = s.now
		if res.Generated%bs == 0 {
			sr.act.OutputBlock()
		}
		if res.Finished {
			sr.act.Free()
			cached := res.CachedTokens
			if sr.cached >= 0 {
				cached = sr.cached // what its prefill engine had, not what the decode engine pulled
			}
			s.rec.Request(sr.arrival, s.now, sr.ttft, len(sr.seq.Prompt), cached, res.Generated)
			if s.cfg.OnRequest != nil {
				s.cfg.OnRequest(s.policy, RequestRecord{Index: id, Arrival: sr.arrival, Sent: sr.arrival, Worker: e.name,
					Prompt: len(sr.seq.Prompt), Cached: cached, Output: res.Generated, TTFT: sr.ttft})
			}
			s.tokPool = append(s.tokPool, sr.seq.Prompt)
			s.reqs[id] = nil
		}
	}
	e.out = nil
	for _, f := range e.feeds {
		f.ApplyEvents(0, e.events)
	}
	clear(e.events)
	e.events = e.events[:0]
}

// shareLoad gives each replica's router the others' load, summed per
// worker, as replicas.nats does every interval.
func (s *sim) shareLoad() {
	own := make([][]router.WorkerStatus, len(s.rts))
	for i, rt := range s.rts {
		own[i] = rt.Workers()
	}
	for i, rt := range s.rts {
		for k, w := range own[i] {
			var l router.Load
			for j := range s.rts {
				if j != i {
					o := own[j][k]
					l.Inflight += o.Inflight
					l.Pending += o.Pending
					l.PrefillTokens += o.PrefillTokens
					l.ActiveBlocks += o.ActiveBlocks
				}
			}
			rt.SetRemoteLoad(w.ID, l)
		}
	}
}

// CheckPolicies reports an empty list, an unknown name or one given twice,
// before a run.
func CheckPolicies(policies []string) error {
	if len(policies) == 0 {
		return errors.New("no policy given")
	}
	known := append(SimPolicies(), PolicyKVFixed)
	for i, p := range policies {
		if !slices.Contains(known, p) {
			return fmt.Errorf("unknown policy %q (want all, or some of %s)", p, strings.Join(known, ", "))
		}
		if slices.Contains(policies[:i], p) {
			return fmt.Errorf("policy %q given twice", p)
		}
	}
	return nil
}

// ParsePolicies splits a comma-separated policy list; "all" or "" is every
// router policy.
func ParsePolicies(s string) []string {
	if s == "" || s == "all" {
		return SimPolicies()
	}
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
