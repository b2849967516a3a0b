package mockengine

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/tokenize"
)

// Config describes one simulated engine. Zero fields take DefaultConfig's
// values.
type Config struct {
	ID    string // engine id, shown in logs and /debug/cache
	Model string // served model name; requests naming another get 404
	// LoRAModules are the LoRA adapters it serves, by name (vLLM's
	// --lora-modules NAME=PATH): a request may name one instead of Model.
	// An adapter's blocks are cached apart from the base model's and
	// reported with its lora_name, as vLLM caches and reports them.
	LoRAModules []string
	// MaxLoRAs is how many adapters a batch may hold (vLLM's --max-loras,
	// default 1 with adapters): a request of another waits for a place.
	MaxLoRAs int

	BlockSize           int
	CacheBlocks         int // device KV capacity in blocks
	MaxNumSeqs          int
	MaxNumBatchedTokens int

	// Speedup compresses time: a step of d sleeps d/Speedup.
	Speedup float64
	// Seed varies the generated lengths and words.
	Seed int64

	// Tokenizer and Template name the prompt encoding as tokenize.Load and
	// tokenize.LoadTemplate take them: built-in names or Hugging Face files.
	Tokenizer string
	Template  string

	// HostCacheBlocks sizes the host (CPU) tier in blocks; 0 turns it off.
	HostCacheBlocks int
	// DuplicateBlocks keeps and reports every copy of a block, as vLLM
	// does (ModelConfig.DuplicateBlocks).
	DuplicateBlocks bool
	// OnEvents, if set, receives each step's cache events (stored, removed,
	// with medium, parent and token ids) in order, on the scheduler
	// goroutine, so it must not block for long. The slice is reused after
	// the call; the events' own slices may be kept. It and PublishEvents
	// both drain the same event log: use one or the other.
	OnEvents func(events []kv.Event)
}

// DefaultConfig is one engine sized like Llama-3.1-8B on an H100 with vLLM's
// scheduler defaults, in real time.
func DefaultConfig() Config {
	m := DefaultModelConfig()
	return Config{
		ID:                  "mock-0",
		Model:               "mock-model",
		BlockSize:           m.BlockSize,
		CacheBlocks:         m.CacheBlocks,
		MaxNumSeqs:          m.MaxNumSeqs,
		MaxNumBatchedTokens: m.MaxNumBatchedTokens,
		Speedup:             1,
		Tokenizer:           "cl100k_base",
		Template:            "chatml",
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.ID == "" {
		c.ID = d.ID
	}
	if c.Model == "" {
		c.Model = d.Model
	}
	// The model's fields default where the model defaults them.
	m := c.modelConfig().withDefaults()
	c.BlockSize, c.CacheBlocks, c.MaxNumSeqs, c.MaxNumBatchedTokens = m.BlockSize, m.CacheBlocks, m.MaxNumSeqs, m.MaxNumBatchedTokens
	if c.Speedup <= 0 {
		c.Speedup = d.Speedup
	}
	if c.Tokenizer == "" {
		c.Tokenizer = d.Tokenizer
	}
	if c.Template == "" {
		c.Template = d.Template
	}
	return c
}

// modelConfig is the part of the engine's configuration its Model takes.
func (c Config) modelConfig() ModelConfig {
	return ModelConfig{
		BlockSize:           c.BlockSize,
		CacheBlocks:         c.CacheBlocks,
		MaxNumSeqs:          c.MaxNumSeqs,
		MaxNumBatchedTokens: c.MaxNumBatchedTokens,
		HostCacheBlocks:     c.HostCacheBlocks,
		RecordEvents:        c.OnEvents != nil,
		MaxLoRAs:            c.maxLoRAs(),
		DuplicateBlocks:     c.DuplicateBlocks,
	}
}

// maxLoRAs is MaxLoRAs, 1 by default when the engine serves adapters, as
// vLLM's --max-loras.
func (c Config) maxLoRAs() int {
	if c.MaxLoRAs <= 0 && len(c.LoRAModules) > 0 {
		return 1
	}
	return c.MaxLoRAs
}

// Stats is a snapshot of an engine's counters and state.
type Stats struct {
	Requests uint64 // accepted into the model
	Finished uint64 // answered in full
	Aborts   uint64 // client went away before the end
	Rejected uint64 // answered with an error
	InFlight int    // handlers still running

	PromptTokens     uint64 // prompt tokens of accepted requests
	GenerationTokens uint64 // output tokens sent to clients

	Running, Waiting int
	KVUsage          float64 // fraction of blocks held by running sequences
	CachedBlocks     int
	PrefixQueries    uint64 // prompt tokens looked up
	PrefixHits       uint64 // prompt tokens found cached
	HostBlocks       int    // blocks in the host tier
	HostHits         uint64 // prompt tokens loaded from the host tier
	Preemptions      uint64
	Steps            uint64
	TokenizeCalls    uint64 // POST /tokenize answered
	// The adapters of the running and the waiting requests.
	RunningLoRAs, WaitingLoRAs []string
}

// Engine is a simulated vLLM serving the OpenAI API over HTTP.
type Engine struct {
	cfg      Config
	idPrefix string // of answer ids: the engine's ID and a random part
	enc      *tokenize.Encoder
	words    []word

	mu      sync.Mutex // guards model, reqs, nextID
	model   *Model
	reqs    map[uint64]*request
	nextID  uint64
	steps   uint64
	deliver []delivery
	events  []kv.Event
	// stepHook, if set (under mu), runs after each step is scheduled and
	// before its time passes. For tests.
	stepHook func()

	wake   chan struct{}
	done   chan struct{}
	loopWG sync.WaitGroup

	requests, finished, aborts, rejected atomic.Uint64
	promptToks, genToks                  atomic.Uint64
	tokenizeCalls                        atomic.Uint64 // POST /tokenize answered

	idleMu      sync.Mutex
	inflight    int
	idleWaiters []chan struct{}

	srvMu  sync.Mutex
	srvs   []*http.Server
	closed bool

	modelJSON []byte // the model name as a JSON string

	responses *responseStore // stored Responses API answers
}

// request is one HTTP request's view of its sequence. The engine loop
// publishes progress in the atomics and pokes notify; the handler reads them.
type request struct {
	seq       Seq
	words     []uint16  // word index per output token of a text answer
	call      *toolCall // the answer when it is a tool call (words is nil)
	notify    chan struct{}
	generated atomic.Int32
	cached    atomic.Int32
	done      atomic.Bool
}

type delivery struct {
	r           *request
	gen, cached int32
	done        bool
}

// New builds an engine and starts its scheduler; it serves nothing until
// Serve or Start.
func New(cfg Config) (*Engine, error) {
	cfg = cfg.withDefaults()
	tok, err := tokenize.Load(cfg.Tokenizer)
	if err != nil {
		return nil, err
	}
	tmpl, err := tokenize.LoadTemplate(cfg.Template)
	if err != nil {
		return nil, err
	}
	enc := tokenize.NewEncoder(tok, tmpl, 0)
	words := buildWords(enc)
	if len(words) == 0 {
		return nil, fmt.Errorf("mockengine: tokenizer %s encodes none of the output words as one token", cfg.Tokenizer)
	}
	mj, _ := json.Marshal(cfg.Model)
	var nonce [4]byte
	rand.Read(nonce[:])
	e := &Engine{
		// Answer ids are unique across engines and restarts, as vLLM's
		// (random) are: every "kvmock -n 1" process is mock-0.
		idPrefix:  cfg.ID + "-" + hex.EncodeToString(nonce[:]),
		cfg:       cfg,
		enc:       enc,
		words:     words,
		model:     NewModel(cfg.modelConfig()),
		reqs:      make(map[uint64]*request),
		wake:      make(chan struct{}, 1),
		done:      make(chan struct{}),
		modelJSON: mj,
		responses: newResponseStore(responseStoreCap),
	}
	e.loopWG.Add(1)
	go e.loop()
	return e, nil
}

// Config returns the engine's effective configuration.
func (e *Engine) Config() Config { return e.cfg }

// Serve answers HTTP on ln until Close. It returns nil after Close.
func (e *Engine) Serve(ln net.Listener) error {
	srv := &http.Server{Handler: e.Handler(), ReadHeaderTimeout: 10 * time.Second}
	e.srvMu.Lock()
	if e.closed {
		e.srvMu.Unlock()
		ln.Close()
		return nil
	}
	e.srvs = append(e.srvs, srv)
	e.srvMu.Unlock()
	err := srv.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Start listens on addr ("127.0.0.1:0" picks a port), serves in the
// background and returns the bound address.
func (e *Engine) Start(addr string) (string, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", err
	}
	go e.Serve(ln)
	return ln.Addr().String(), nil
}

// Close stops serving (open connections are closed, which aborts their
// requests), waits for the handlers to return and stops the scheduler. It
// is safe to call more than once.
func (e *Engine) Close() error {
	e.srvMu.Lock()
	if e.closed {
		e.srvMu.Unlock()
		return nil
	}
	e.closed = true
	srvs := e.srvs
	e.srvMu.Unlock()
	var err error
	for _, s := range srvs {
		err = errors.Join(err, s.Close())
	}
	// Closed connections cancel their handlers' contexts; let them return
	// (and apply their aborts) before the scheduler stops.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	e.WaitIdle(ctx)
	cancel()
	close(e.done)
	e.loopWG.Wait()
	return err
}

// Stats returns a snapshot of the engine's counters.
func (e *Engine) Stats() Stats {
	e.idleMu.Lock()
	inflight := e.inflight
	e.idleMu.Unlock()
	e.mu.Lock()
	c := e.model.Counters()
	st := Stats{
		Running:       e.model.Running(),
		Waiting:       e.model.Waiting(),
		KVUsage:       e.model.Usage(),
		CachedBlocks:  e.model.CachedBlocks(),
		PrefixQueries: c.PrefixQueries,
		PrefixHits:    c.PrefixHits,
		HostBlocks:    e.model.HostBlocks(),
		HostHits:      c.HostHits,
		Preemptions:   c.Preemptions,
		Steps:         e.steps,
		TokenizeCalls: e.tokenizeCalls.Load(),
	}
	st.RunningLoRAs, st.WaitingLoRAs = e.model.LoRAs()
	e.mu.Unlock()
	st.Requests = e.requests.Load()
	st.Finished = e.finished.Load()
	st.Aborts = e.aborts.Load()
	st.Rejected = e.rejected.Load()
	st.PromptTokens = e.promptToks.Load()
	st.GenerationTokens = e.genToks.Load()
	st.InFlight = inflight
	return st
}

// WaitIdle blocks until no request handler is running (every response is
// written or abandoned and every abort applied), or ctx ends. Tests use it
// instead of sleeping.
func (e *Engine) WaitIdle(ctx context.Context) error {
	e.idleMu.Lock()
	if e.inflight == 0 {
		e.idleMu.Unlock()
		return nil
	}
	ch := make(chan struct{})
	e.idleWaiters = append(e.idleWaiters, ch)
	e.idleMu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *Engine) enter() {
	e.idleMu.Lock()
	e.inflight++
	e.idleMu.Unlock()
}

func (e *Engine) leave() {
	e.idleMu.Lock()
	e.inflight--
	if e.inflight == 0 {
		for _, ch := range e.idleWaiters {
			close(ch)
		}
		e.idleWaiters = e.idleWaiters[:0]
	}
	e.idleMu.Unlock()
}

// submit puts a request's sequence into the model.
func (e *Engine) submit(r *request) error {
	e.mu.Lock()
	e.nextID++
	r.seq.ID = e.nextID
	if err := e.model.Add(&r.seq); err != nil {
		e.mu.Unlock()
		return err
	}
	e.reqs[r.seq.ID] = r
	e.mu.Unlock()
	e.requests.Add(1)
	e.promptToks.Add(uint64(len(r.seq.Prompt)))
	select {
	case e.wake <- struct{}{}:
	default:
	}
	return nil
}

// abort takes a request out of the model if it is still there.
func (e *Engine) abort(r *request) {
	e.mu.Lock()
	e.model.Abort(&r.seq)
	delete(e.reqs, r.seq.ID)
	e.mu.Unlock()
}

// maxLag is how far the scheduler may fall behind its clock and still catch
// up (by skipping sleeps); after a longer stall it starts afresh.
const maxLag = 250 * time.Millisecond

// loop steps the model in real time: each step's results are published when
// its (scaled) duration has passed. Deadlines accumulate, so waking late
// from one step shortens the next and the long-run rate stays exact.
func (e *Engine) loop() {
	defer e.loopWG.Done()
	var clock time.Time // when the previous step ended; zero after idling
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		e.mu.Lock()
		dur, out := e.model.Step()
		if len(out) == 0 && dur == 0 {
			// Idle: publish what happened outside steps (a cache reset).
			if e.cfg.OnEvents != nil {
				e.events = e.model.DrainEvents(e.events[:0])
			}
			e.mu.Unlock()
			e.publishEvents()
			clock = time.Time{}
			select {
			case <-e.wake:
				continue
			case <-e.done:
				return
			}
		}
		e.steps++
		hook := e.stepHook
		e.deliver = e.deliver[:0]
		for _, o := range out {
			r := e.reqs[o.Seq.ID]
			if r == nil {
				continue
			}
			if o.Finished {
				delete(e.reqs, o.Seq.ID)
			}
			e.deliver = append(e.deliver, delivery{r: r, gen: int32(o.Generated), cached: int32(o.CachedTokens), done: o.Finished})
		}
		if e.cfg.OnEvents != nil {
			e.events = e.model.DrainEvents(e.events[:0])
		}
		e.mu.Unlock()
		if hook != nil {
			hook()
		}

		if now := time.Now(); clock.IsZero() || now.Sub(clock) > maxLag {
			clock = now
		}
		clock = clock.Add(time.Duration(float64(dur) / e.cfg.Speedup))
		if wait := time.Until(clock); wait > 0 {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-e.done:
				return
			}
		}
		// The step is done: publish its cache events, then its tokens, so a
		// client that saw a token can find the blocks behind it announced.
		e.publishEvents()
		for _, d := range e.deliver {
			d.r.cached.Store(d.cached)
			d.r.generated.Store(d.gen)
			if d.done {
				d.r.done.Store(true)
			}
			select {
			case d.r.notify <- struct{}{}:
			default:
			}
		}
	}
}

func (e *Engine) publishEvents() {
	if len(e.events) > 0 {
		e.cfg.OnEvents(e.events)
		clear(e.events)
		e.events = e.events[:0]
	}
}

// appendResident lists the cached blocks under the engine lock.
func (e *Engine) appendResident(dst []ResidentBlock) []ResidentBlock {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.model.AppendResident(dst)
}
