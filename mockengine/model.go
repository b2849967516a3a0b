package mockengine

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

// ModelConfig sizes a simulated engine core. Zero fields take the defaults of
// DefaultModelConfig.
type ModelConfig struct {
	BlockSize           int // tokens per KV block
	CacheBlocks         int // device KV capacity in blocks
	MaxNumSeqs          int // running sequences per step at most
	MaxNumBatchedTokens int // tokens computed per step at most (chunked prefill)
	// HostCacheBlocks is the capacity of the host (CPU) tier in blocks; 0
	// turns it off. Blocks evicted from the device move there, and a prefix
	// hit there costs HostLoadPerBlock per block instead of recomputation.
	HostCacheBlocks  int
	HostLoadPerBlock time.Duration
	// RecordEvents keeps a list of cache events for DrainEvents.
	RecordEvents bool
	// MaxLoRAs is how many LoRA adapters the running batch may hold (vLLM's
	// --max-loras): a waiting sequence of another adapter is passed over
	// until one leaves. 0: no limit.
	MaxLoRAs int
	// DuplicateBlocks keeps every copy of a block, as vLLM's block pool
	// does: a full block whose prefix another block already holds (the
	// last block of a prompt cached whole, which is computed again for its
	// logits; here also two sequences admitted in one step, which vLLM,
	// registering a block when it schedules it, would share) is cached and
	// reported stored too, and each copy is evicted, and reported removed,
	// on its own. Off, such a copy stays anonymous and is freed when its
	// sequence ends (SGLang's radix cache keeps one copy too).
	DuplicateBlocks bool
}

// DefaultHostLoadPerBlock is the host→device copy time of one block of 16
// tokens of Llama-3.1-8B (128 KiB of KV per token, 2 MiB per block) at the
// router's default host fetch cost of 55 µs/MB.
const DefaultHostLoadPerBlock = 115 * time.Microsecond

// DefaultModelConfig is vLLM's scheduler defaults with a cache sized like
// Llama-3.1-8B on one H100 (about 480k tokens).
func DefaultModelConfig() ModelConfig {
	return ModelConfig{BlockSize: 16, CacheBlocks: 30000, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192}
}

func (c ModelConfig) withDefaults() ModelConfig {
	d := DefaultModelConfig()
	if c.BlockSize <= 0 {
		c.BlockSize = d.BlockSize
	}
	if c.CacheBlocks <= 0 {
		c.CacheBlocks = d.CacheBlocks
	}
	if c.MaxNumSeqs <= 0 {
		c.MaxNumSeqs = d.MaxNumSeqs
	}
	if c.MaxNumBatchedTokens <= 0 {
		c.MaxNumBatchedTokens = d.MaxNumBatchedTokens
	}
	if c.HostCacheBlocks < 0 {
		c.HostCacheBlocks = 0
	}
	if c.HostLoadPerBlock <= 0 {
		c.HostLoadPerBlock = DefaultHostLoadPerBlock
	}
	return c
}

// ErrTooLong is returned by Add for a sequence that could never fit the cache.
var ErrTooLong = errors.New("mockengine: prompt plus max tokens exceed the KV cache")

type seqState uint8

const (
	seqNew seqState = iota
	seqWaiting
	seqRunning
	seqDone
)

// Seq is one request inside the Model. Set the exported fields, then Add it;
// the Model owns it until it finishes or is aborted. Prompt and Output must
// not change while the Model holds the Seq.
type Seq struct {
	ID     uint64
	Prompt []uint32
	// MaxTokens is exactly how many tokens the sequence generates (≥ 1); the
	// caller decides where an EOS would fall.
	MaxTokens int
	// Output optionally gives the generated token ids (used to hash output
	// blocks, which are cached as vLLM does); missing ids are synthesized
	// deterministically from ID.
	Output []uint32
	// Salt is vLLM's cache_salt: folded into the hash of block 0, so
	// different salts never share cached blocks.
	Salt string
	// LoRA is the LoRA adapter the sequence runs with ("" for the base
	// model): its blocks never serve another adapter or the base model.
	LoRA string
	// RemoteKV: a prefill engine computed the prompt (disaggregated
	// prefill): its full blocks that are not cached here are pulled rather
	// than computed, and only the rest (less than a block) is. vLLM's
	// NixlConnector pulls them beside the running batch (RDMA, while the
	// request waits for its KV); the model charges the step nothing for it.
	RemoteKV bool

	ns         kv.Namespace
	hashes     []kv.BlockHash // engine hashes of every full block known
	blocks     []int32        // cache slots held, one per started block
	computed   int            // tokens whose KV is in the cache
	generated  int            // output tokens produced
	cached     int            // prompt tokens hit in the cache at first admission
	prefillEnd int            // tokens to compute before decoding (set on admission)
	sched      int            // tokens scheduled in the current step
	state      seqState
	admitted   bool
}

// Generated is how many output tokens the sequence has produced.
func (s *Seq) Generated() int { return s.generated }

// CachedTokens is how many prompt tokens came from the prefix cache when the
// sequence was first scheduled (vLLM's num_cached_tokens).
func (s *Seq) CachedTokens() int { return s.cached }

// Finished reports whether the sequence has produced all its tokens.
func (s *Seq) Finished() bool { return s.state == seqDone && s.generated >= s.MaxTokens }

func (s *Seq) total() int { return len(s.Prompt) + s.generated }

// StepResult reports one token produced by a step. Generated == 1 is the
// first token (end of prefill).
type StepResult struct {
	Seq          *Seq
	Generated    int  // output tokens so far, this one included
	CachedTokens int  // prompt tokens served from the prefix cache
	Finished     bool // this was the last token; the sequence left the Model
}

// Counters are the Model's cumulative prefix-cache figures, in tokens, as
// vLLM counts them (one query per prompt token at admission).
type Counters struct {
	PrefixQueries uint64
	PrefixHits    uint64 // found on the device
	HostHits      uint64 // found in the host tier and loaded
	Preemptions   uint64
	Copies        uint64 // blocks cached while another held their prefix (DuplicateBlocks)
}

// Model is the deterministic engine core: prefix cache, continuous-batching
// scheduler, step timing. It is not safe for concurrent use. Given the same
// config and the same calls it produces the same results.
type Model struct {
	cfg      ModelConfig
	cache    *blockCache
	waiting  seqQueue
	running  []*Seq
	out      []StepResult
	counters Counters

	host      *hostCache // nil when the host tier is off
	devTokens []uint32   // BlockSize tokens per device block, for events
	hostLoads int        // blocks loaded from the host in the current step

	scratch []uint32       // one block of tokens spanning prompt and output
	hbuf    []kv.BlockHash // one hash
	events  eventLog
	skipped []*Seq   // Step: waiting sequences passed over, kept in order
	loras   []string // Step: the running adapters (runningLoRAs)
}

// NewModel builds a Model; zero config fields take defaults.
func NewModel(cfg ModelConfig) *Model {
	cfg = cfg.withDefaults()
	m := &Model{
		cfg:     cfg,
		cache:   newBlockCache(cfg.CacheBlocks, cfg.DuplicateBlocks),
		scratch: make([]uint32, cfg.BlockSize),
		hbuf:    make([]kv.BlockHash, 0, 1),
		events:  eventLog{on: cfg.RecordEvents},
	}
	// Token copies are kept even while events are off, so recording can be
	// switched on at any time (SetRecordEvents) and still report the tokens
	// of blocks cached before.
	m.devTokens = make([]uint32, cfg.CacheBlocks*cfg.BlockSize)
	if cfg.HostCacheBlocks > 0 {
		m.host = newHostCache(cfg.HostCacheBlocks, cfg.BlockSize)
	}
	return m
}

// Config returns the effective configuration.
func (m *Model) Config() ModelConfig { return m.cfg }

var engineNS = kv.NewNamespace("mockengine")

// Add queues a sequence. It fails if the sequence is malformed or could never
// fit in the cache.
func (m *Model) Add(s *Seq) error {
	if s.state != seqNew {
		return fmt.Errorf("mockengine: sequence %d added twice", s.ID)
	}
	if len(s.Prompt) == 0 {
		return errors.New("mockengine: empty prompt")
	}
	if s.MaxTokens < 1 {
		return errors.New("mockengine: MaxTokens must be at least 1")
	}
	bs := m.cfg.BlockSize
	if (len(s.Prompt)+s.MaxTokens+bs-1)/bs > m.cfg.CacheBlocks {
		return ErrTooLong
	}
	s.ns = engineNS
	switch {
	case s.LoRA != "":
		s.ns = kv.NewNamespace("mockengine", s.Salt, "lora\xfe"+s.LoRA)
	case s.Salt != "":
		s.ns = kv.NewNamespace("mockengine", s.Salt)
	}
	s.hashes = kv.HashBlocks(s.hashes[:0], s.Prompt, bs, s.ns)
	s.blocks = s.blocks[:0]
	s.state = seqWaiting
	m.waiting.pushBack(s)
	return nil
}

// Abort removes a waiting or running sequence, releasing its blocks (full
// ones stay cached). It reports whether the Model held the sequence.
func (m *Model) Abort(s *Seq) bool {
	switch s.state {
	case seqWaiting:
		m.waiting.remove(s)
	case seqRunning:
		m.running = removeSeq(m.running, s)
		m.releaseAll(s)
	default:
		return false
	}
	s.state = seqDone
	return true
}

func removeSeq(q []*Seq, s *Seq) []*Seq {
	for i, x := range q {
		if x == s {
			copy(q[i:], q[i+1:])
			q[len(q)-1] = nil
			return q[:len(q)-1]
		}
	}
	return q
}

// Running is the number of sequences in the running batch.
func (m *Model) Running() int { return len(m.running) }

// Waiting is the number of queued sequences (new and preempted).
func (m *Model) Waiting() int { return m.waiting.len() }

// Usage is the fraction of KV blocks held by running sequences (vLLM's
// kv_cache_usage_perc, as a fraction).
func (m *Model) Usage() float64 { return float64(m.cache.used) / float64(len(m.cache.blocks)) }

// CachedBlocks is the number of blocks findable by a prefix hit.
func (m *Model) CachedBlocks() int { return m.cache.index.len() }

// Counters returns the cumulative prefix-cache counters.
func (m *Model) Counters() Counters { return m.counters }

// Idle reports whether no sequence is waiting or running.
func (m *Model) Idle() bool { return m.waiting.len() == 0 && len(m.running) == 0 }

// Step runs one scheduler iteration: running sequences first (each gets the
// rest of its prefill chunk or one decode token, preempting the newest
// running sequence when blocks run out), then waiting ones in order while
// the token budget, MaxNumSeqs and free blocks allow. It returns how long the
// step takes (StepTime) and the tokens it produced. The results slice is
// reused by the next Step. An idle Model returns 0 and no results.
func (m *Model) Step() (time.Duration, []StepResult) {
	m.out = m.out[:0]
	budget := m.cfg.MaxNumBatchedTokens
	prefill, decodes := 0, 0
	preempted := false
	m.hostLoads = 0

	for i := 0; i < len(m.running); i++ {
		s := m.running[i]
		s.sched = 0
		if budget == 0 {
			continue
		}
		n := min(s.total()-s.computed, budget)
		for !m.grow(s, s.computed+n) {
			v := m.running[len(m.running)-1]
			m.running = m.running[:len(m.running)-1]
			m.preempt(v)
			preempted = true
			if v == s {
				n = 0
				break
			}
		}
		if n == 0 {
			break
		}
		s.sched = n
		budget -= n
		if s.computed < s.prefillEnd {
			prefill += n
		} else {
			decodes++
		}
	}

	// Like vLLM, admit nothing in a step that had to preempt, and pass over
	// (keeping their places) sequences of an adapter the batch has no room
	// for.
	loras := m.runningLoRAs()
	for !preempted && budget > 0 && m.waiting.len() > 0 && len(m.running) < m.cfg.MaxNumSeqs {
		s := m.waiting.front()
		if m.cfg.MaxLoRAs > 0 && s.LoRA != "" && len(loras) >= m.cfg.MaxLoRAs && !slices.Contains(loras, s.LoRA) {
			m.waiting.popFront()
			m.skipped = append(m.skipped, s)
			continue
		}
		if !m.admit(s, budget) {
			break
		}
		m.waiting.popFront()
		m.running = append(m.running, s)
		if m.cfg.MaxLoRAs > 0 && s.LoRA != "" && !slices.Contains(loras, s.LoRA) {
			loras = append(loras, s.LoRA)
		}
		budget -= s.sched
		prefill += s.sched
	}
	for i := len(m.skipped) - 1; i >= 0; i-- {
		m.waiting.pushFront(m.skipped[i])
	}
	clear(m.skipped)
	m.skipped = m.skipped[:0]

	if prefill == 0 && decodes == 0 {
		return 0, nil
	}
	dur := StepTime(prefill, decodes, m.Usage()) + time.Duration(m.hostLoads)*m.cfg.HostLoadPerBlock

	// Apply: advance every scheduled sequence, cache its newly full blocks,
	// sample a token where the sequence caught up with itself.
	bs := m.cfg.BlockSize
	keep := m.running[:0]
	for _, s := range m.running {
		if s.sched == 0 {
			keep = append(keep, s)
			continue
		}
		old := s.computed
		s.computed += s.sched
		s.sched = 0
		for i := old / bs; i < s.computed/bs; i++ {
			m.fillBlock(s, i)
		}
		if s.computed < s.total() {
			keep = append(keep, s)
			continue
		}
		s.generated++
		done := s.generated >= s.MaxTokens
		m.out = append(m.out, StepResult{Seq: s, Generated: s.generated, CachedTokens: s.cached, Finished: done})
		if done {
			m.releaseAll(s)
			s.state = seqDone
			continue
		}
		keep = append(keep, s)
	}
	for i := len(keep); i < len(m.running); i++ {
		m.running[i] = nil
	}
	m.running = keep
	return dur, m.out
}

// grow makes s hold enough blocks for upto tokens, evicting cached blocks as
// needed; it fails, changing nothing, if there are not enough.
func (m *Model) grow(s *Seq, upto int) bool {
	need := (upto+m.cfg.BlockSize-1)/m.cfg.BlockSize - len(s.blocks)
	if need <= 0 {
		return true
	}
	if need > m.cache.available() {
		return false
	}
	for ; need > 0; need-- {
		s.blocks = append(s.blocks, m.alloc())
	}
	return true
}

func (m *Model) alloc() int32 {
	b, evicted := m.cache.alloc()
	if evicted {
		bl := &m.cache.blocks[b]
		m.events.removed(bl.hash, kv.TierDevice)
		if m.host != nil {
			m.offload(bl, m.devBlockTokens(b))
		}
	}
	return b
}

// offload moves a block evicted from the device into the host tier.
func (m *Model) offload(bl *block, toks []uint32) {
	old, didEvict, added := m.host.put(bl.hash, bl.rhash, bl.parent, bl.hasParent, toks)
	if didEvict {
		m.events.removed(old, kv.TierHost)
	}
	if added {
		m.events.stored(bl.parent, bl.hasParent, bl.hash, toks, kv.TierHost, "", "")
	}
}

// devBlockTokens is the token copy of device block b.
func (m *Model) devBlockTokens(b int32) []uint32 {
	bs := m.cfg.BlockSize
	return m.devTokens[int(b)*bs : int(b+1)*bs]
}

// admit schedules a waiting sequence for its first chunk: prefix lookup over
// its full blocks (always leaving at least one token to compute) on the
// device, then on in the host tier, then blocks for the chunk. It fails,
// changing nothing, when blocks are short.
func (m *Model) admit(s *Seq, budget int) bool {
	bs := m.cfg.BlockSize
	total := s.total()
	maxHit := min((total-1)/bs, len(s.hashes))
	hits, inLRU := 0, 0
	for hits < maxHit {
		b, ok := m.cache.index.get(s.hashes[hits])
		if !ok {
			break
		}
		if m.cache.blocks[b].ref == 0 {
			inLRU++
		}
		hits++
	}
	loaded := hits
	if m.host != nil {
		for loaded < maxHit {
			if _, ok := m.host.index.get(s.hashes[loaded]); !ok {
				break
			}
			loaded++
		}
	}
	pulled := loaded
	if s.RemoteKV && !s.admitted {
		pulled = maxHit
	}
	n := min(total-pulled*bs, budget)
	need := (pulled*bs+n+bs-1)/bs - hits
	if need > m.cache.available()-inLRU {
		return false
	}
	for i := 0; i < hits; i++ {
		b, _ := m.cache.index.get(s.hashes[i])
		m.cache.acquire(b)
		s.blocks = append(s.blocks, b)
	}
	loaded = hits + m.loadFromHost(s, hits, loaded)
	if pulled > loaded {
		loaded = m.pullRemote(s, loaded, pulled)
	}
	for end := (loaded*bs + n + bs - 1) / bs; len(s.blocks) < end; {
		s.blocks = append(s.blocks, m.alloc())
	}
	s.computed = loaded * bs
	s.prefillEnd = total
	s.sched = n
	s.state = seqRunning
	if !s.admitted {
		s.admitted = true
		s.cached = min(loaded*bs, len(s.Prompt))
		m.counters.PrefixQueries += uint64(len(s.Prompt))
		m.counters.PrefixHits += uint64(min(hits*bs, s.cached))
		m.counters.HostHits += uint64(s.cached - min(hits*bs, s.cached))
	}
	return true
}

// loadFromHost copies blocks from..to-1 of s from the host tier into new
// device blocks, registering them there; each costs HostLoadPerBlock in this
// step. It returns how many it loaded: fewer than asked if allocating device
// blocks pushed a needed host entry out.
func (m *Model) loadFromHost(s *Seq, from, to int) int {
	for i := from; i < to; i++ {
		if hi, ok := m.host.index.get(s.hashes[i]); ok {
			m.host.touch(hi)
		}
	}
	for i := from; i < to; i++ {
		b := m.alloc()
		s.blocks = append(s.blocks, b)
		hi, ok := m.host.index.get(s.hashes[i])
		if !ok {
			return i - from // evicted meanwhile: recompute from here
		}
		e := &m.host.entries[hi]
		bl := &m.cache.blocks[b]
		bl.hash, bl.rhash, bl.parent, bl.hasParent = e.hash, e.rhash, e.parent, e.hasParent
		toks := m.host.blockTokens(hi)
		copy(m.devBlockTokens(b), toks)
		if m.cached(b) {
			m.events.stored(bl.parent, bl.hasParent, bl.hash, toks, kv.TierDevice, "", "")
		}
		m.hostLoads++
	}
	return to - from
}

// pullRemote fills blocks from..to-1 of s with the prompt's KV a prefill
// engine computed, registering them as computed ones are. It returns to.
func (m *Model) pullRemote(s *Seq, from, to int) int {
	for i := from; i < to; i++ {
		s.blocks = append(s.blocks, m.alloc())
		m.fillBlock(s, i)
	}
	return to
}

// preempt sends a running sequence back to the front of the queue, releasing
// its blocks; it will recompute (mostly from cache) when readmitted.
func (m *Model) preempt(s *Seq) {
	m.releaseAll(s)
	s.computed = 0
	s.sched = 0
	s.state = seqWaiting
	m.waiting.pushFront(s)
	m.counters.Preemptions++
}

// releaseAll drops every block of s, tail first, so the tail of a finished
// sequence is evicted before its (more shareable) head, as vLLM does.
func (m *Model) releaseAll(s *Seq) {
	for i := len(s.blocks) - 1; i >= 0; i-- {
		m.cache.release(s.blocks[i])
	}
	s.blocks = s.blocks[:0]
}

// tokenAt is token p of the sequence: prompt, then output.
func (s *Seq) tokenAt(p int) uint32 {
	if p < len(s.Prompt) {
		return s.Prompt[p]
	}
	j := p - len(s.Prompt)
	if j < len(s.Output) {
		return s.Output[j]
	}
	return synthToken(s.ID, j)
}

// synthToken is a deterministic output token id for sequences that bring no
// Output: a mix of the sequence id and position, kept in a plain-text range.
func synthToken(id uint64, j int) uint32 {
	x := id*0x9E3779B97F4A7C15 + uint64(j)*0xBF58476D1CE4E5B9
	x ^= x >> 31
	x *= 0x94D049BB133111EB
	x ^= x >> 29
	return 1000 + uint32(x%50000)
}

// blockTokens returns the tokens of block i of s, viewing the prompt when the
// block lies inside it.
func (m *Model) blockTokens(s *Seq, i int) []uint32 {
	bs := m.cfg.BlockSize
	lo := i * bs
	if lo+bs <= len(s.Prompt) {
		return s.Prompt[lo : lo+bs]
	}
	for k := range m.scratch {
		m.scratch[k] = s.tokenAt(lo + k)
	}
	return m.scratch
}

// fillBlock records that block i of s is now full: hashes it (engine and
// router schemes) and registers it in the cache.
func (m *Model) fillBlock(s *Seq, i int) {
	b := s.blocks[i]
	bl := &m.cache.blocks[b]
	if bl.cached {
		return // a prefix hit: already known
	}
	toks := m.blockTokens(s, i)
	copy(m.devBlockTokens(b), toks)
	var parent, rparent kv.BlockHash
	if i > 0 {
		p := &m.cache.blocks[s.blocks[i-1]]
		parent, rparent = p.hash, p.rhash
	}
	bl.parent, bl.hasParent = parent, i > 0
	if i < len(s.hashes) {
		bl.hash = s.hashes[i]
	} else {
		m.hbuf = kv.ContinueHashes(m.hbuf[:0], parent, i == 0, toks, m.cfg.BlockSize, s.ns)
		bl.hash = m.hbuf[0]
		s.hashes = append(s.hashes, bl.hash)
	}
	m.hbuf = kv.ContinueHashes(m.hbuf[:0], rparent, i == 0, toks, m.cfg.BlockSize, 0)
	bl.rhash = m.hbuf[0]
	if m.cached(b) {
		salt := ""
		if i == 0 {
			salt = s.Salt
		}
		m.events.stored(parent, i > 0, bl.hash, toks, kv.TierDevice, salt, s.LoRA)
	}
}

// cached registers full block b in the cache (blockCache.register),
// counting the copies, and reports whether it was cached.
func (m *Model) cached(b int32) bool {
	ok, copy := m.cache.register(b)
	if copy {
		m.counters.Copies++
	}
	return ok
}

// SetRecordEvents switches event recording (ModelConfig.RecordEvents) on or
// off. Events already recorded stay until drained.
func (m *Model) SetRecordEvents(on bool) { m.events.on = on }

// ResetPrefixCache forgets every cached block on both tiers and records one
// AllBlocksCleared event, as vLLM's reset_prefix_cache does. Like vLLM it
// refuses (returns false) while any running sequence holds blocks.
func (m *Model) ResetPrefixCache() bool {
	if m.cache.used > 0 {
		return false
	}
	m.cache = newBlockCache(m.cfg.CacheBlocks, m.cfg.DuplicateBlocks)
	if m.host != nil {
		m.host = newHostCache(m.cfg.HostCacheBlocks, m.cfg.BlockSize)
	}
	m.events.cleared()
	return true
}

// ResidentBlock is one block findable in the engine's cache.
type ResidentBlock struct {
	// Hash is the router-scheme sequence hash of the block's prefix:
	// kv.HashBlocks(tokens, BlockSize, 0), ignoring any cache salt.
	Hash kv.BlockHash
	// EngineHash is the engine's own (opaque) hash, as events carry it.
	EngineHash kv.BlockHash
	// Parent is the EngineHash of the block before, if HasParent.
	Parent    kv.BlockHash
	HasParent bool
	Tier      kv.Tier
}

// AppendResident appends every cached block: the device tier, then the host
// tier, each in slab order. A block may be in both.
func (m *Model) AppendResident(dst []ResidentBlock) []ResidentBlock {
	for i := range m.cache.blocks {
		bl := &m.cache.blocks[i]
		if bl.cached {
			dst = append(dst, ResidentBlock{Hash: bl.rhash, EngineHash: bl.hash, Parent: bl.parent, HasParent: bl.hasParent, Tier: kv.TierDevice})
		}
	}
	if m.host != nil {
		for _, e := range m.host.entries[:m.host.n] {
			dst = append(dst, ResidentBlock{Hash: e.rhash, EngineHash: e.hash, Parent: e.parent, HasParent: e.hasParent, Tier: kv.TierHost})
		}
	}
	return dst
}

// AppendResidentTokens appends the token ids of every cached block,
// BlockSize per block, in AppendResident's order.
func (m *Model) AppendResidentTokens(dst []uint32) []uint32 {
	for i := range m.cache.blocks {
		if m.cache.blocks[i].cached {
			dst = append(dst, m.devBlockTokens(int32(i))...)
		}
	}
	if m.host != nil {
		for i := 0; i < m.host.n; i++ {
			dst = append(dst, m.host.blockTokens(int32(i))...)
		}
	}
	return dst
}

// HostBlocks is the number of blocks in the host tier.
func (m *Model) HostBlocks() int {
	if m.host == nil {
		return 0
	}
	return m.host.index.len()
}

// runningLoRAs is the adapters of the running sequences, each once, when
// MaxLoRAs limits them (else nil).
func (m *Model) runningLoRAs() []string {
	if m.cfg.MaxLoRAs <= 0 {
		return nil
	}
	m.loras = m.loras[:0]
	for _, s := range m.running {
		if s.LoRA != "" && !slices.Contains(m.loras, s.LoRA) {
			m.loras = append(m.loras, s.LoRA)
		}
	}
	return m.loras
}

// LoRAs reports the adapters of the running and the waiting sequences, each
// once (vLLM's lora_requests_info).
func (m *Model) LoRAs() (running, waiting []string) {
	for _, s := range m.running {
		if s.LoRA != "" && !slices.Contains(running, s.LoRA) {
			running = append(running, s.LoRA)
		}
	}
	for _, s := range m.waiting.buf[m.waiting.head:] {
		if s.LoRA != "" && !slices.Contains(waiting, s.LoRA) {
			waiting = append(waiting, s.LoRA)
		}
	}
	return running, waiting
}

// seqQueue is the waiting queue: FIFO, with preempted sequences put back at
// the front. Both ends are O(1) amortized, so a long queue in a saturated
// simulation costs nothing per admission.
type seqQueue struct {
	buf  []*Seq
	head int
}

func (q *seqQueue) len() int    { return len(q.buf) - q.head }
func (q *seqQueue) front() *Seq { return q.buf[q.head] }

func (q *seqQueue) pushBack(s *Seq) { q.buf = append(q.buf, s) }

func (q *seqQueue) popFront() {
	q.buf[q.head] = nil
	q.head++
	if q.head == len(q.buf) {
		q.buf, q.head = q.buf[:0], 0
	} else if q.head >= 1024 && q.head*2 >= len(q.buf) {
		n := copy(q.buf, q.buf[q.head:])
		clear(q.buf[n:])
		q.buf, q.head = q.buf[:n], 0
	}
}

func (q *seqQueue) pushFront(s *Seq) {
	if q.head > 0 {
		q.head--
		q.buf[q.head] = s
		return
	}
	q.buf = append(q.buf, nil)
	copy(q.buf[1:], q.buf)
	q.buf[0] = s
}

func (q *seqQueue) remove(s *Seq) {
	live := removeSeq(q.buf[q.head:], s)
	q.buf = q.buf[:q.head+len(live)]
}
