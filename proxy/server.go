package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/replicas"
	"github.com/kvproxy/kvproxy/router"
	"github.com/kvproxy/kvproxy/tokenize"
)

// WorkerHeader names the backend that served (or would serve) a request.
const WorkerHeader = "x-kvproxy-worker"

// Options configure a Server beyond the config file.
type Options struct {
	Logger zerolog.Logger
	// Registry receives the proxy's metrics; nil means a new registry.
	Registry *prometheus.Registry
	// DisableHealthChecks turns off active probes (tests that drive health by hand).
	DisableHealthChecks bool
}

// Server is a running kvproxy. Its configuration-derived state (pools,
// backends, tenants) is swapped whole on reload; a request works with the
// state it started with.
type Server struct {
	log      zerolog.Logger
	opts     Options
	st       atomic.Pointer[state]
	reloadMu sync.Mutex
	metrics  *metrics
	watcher  *hangupWatcher
	srv      *fasthttp.Server
	health   *backends.Prober
	retries  *retryBudget
	queued   atomic.Int64 // requests waiting for a backend slot, all models (limits.max_queue)
	// queuedFirst: those of them not in live yet (not moving streams).
	queuedFirst atomic.Int64
	limits      config.Limits // fixed at start: the header limits shape the HTTP server
	// bodyMem bounds the memory of large bodies: request bodies and engine
	// answers read whole (limits.body_memory_mb).
	bodyMem *backends.Budget
	// respRandom keys response ids where no secret does (respKey).
	respRandom [32]byte
	// cert is the listener's certificate (tls in the config), replaced by
	// reloads; nil serves plain HTTP.
	cert atomic.Pointer[tls.Certificate]
	// started is the configuration New was given: the settings read only
	// at start keep its values, whatever reloads came since.
	started *config.Config

	reqPrefix string
	reqSeq    atomic.Uint64
	bufs      sync.Pool
	draining  atomic.Bool
	live      liveExchanges
	rejectLog *logLimiter // the rejected requests' log lines
	acceptLog acceptLog   // the accept errors' log lines
	refuseLog refuseLog   // the lines of connections refused over the cap
	// openConns counts the client connections open (limits.max_connections);
	// fdLimit is the open files limit at start (0: unknown).
	openConns atomic.Int64
	// spareConns counts those open past the cap, for an operator's request.
	spareConns atomic.Int64
	fdLimit    uint64
	// adminConns counts the connections open on admin_listen, and
	// adminRefuseLog those its cap refused; adminSrv serves them
	// (ServeAdmin) and stops last, after the drain (adminListeners).
	adminConns     atomic.Int64
	adminRefuseLog refuseLog
	adminSrv       *fasthttp.Server
	adminListeners []net.Listener

	routeTable map[string]route
	reloader   atomic.Pointer[func() error] // SetReloader

	startOnce  sync.Once
	stopOnce   sync.Once // Shutdown's stopping of probes, scrapes and backends
	serveMu    sync.Mutex
	stopped    bool           // Shutdown has begun (serveMu)
	listeners  []net.Listener // Serve's (serveMu)
	stopScrape chan struct{}
	scrapeDone chan struct{}
	// listsRead is closed when the scrape loop's first round has read (or
	// failed to read) every engine's model list: until then an adapter only
	// the engines list is not known yet.
	listsRead chan struct{}
	replicas  *replicas.Sync // nil without replicas.nats
	retiring  sync.Map       // *backend → struct{}: removed or replaced by a reload, finishing its requests
	// retiredCh is closed (and dropped) whenever a backend has retired,
	// for AwaitRetired; nil while nothing waits (retiredMu).
	retiredMu sync.Mutex
	retiredCh chan struct{}
	// testRouted, set by tests, runs between a route's choice of a backend
	// and its taking a slot there.
	testRouted atomic.Pointer[func(*backend)]
	// testActivating, set by tests, runs in a reload's activate once the
	// new backends are in their pools, before the state is current.
	testActivating atomic.Pointer[func()]
	// hijacks holds the relay of each HTTP/1.0 stream (net.Conn →
	// io.Closer) until its hijack handler starts: fasthttp closes the
	// connection without calling the handler when it cannot flush what it
	// holds for the client, and the relay must then end here.
	hijacks sync.Map
	// overLimit: requests whose body was declared over its limit, by
	// their header (overLimitBody), until answered.
	overLimit overLimitNotes
	// slotCounts holds each engine's max_concurrency count by backend id
	// and URL, while a backend of them is configured or a request of
	// theirs runs (activate, under reloadMu).
	slotCounts map[string]*slotCount
}

type state struct {
	cfg      *config.Config
	models   map[string]*modelPool // by name and alias
	served   map[string]*modelPool // by an engine's own name for it (nameServedModels)
	pools    []*modelPool
	backends map[string]*backend // by id
	auth     *authTable
	respMACs *respMACs    // of the response ids, keyed by respKey
	trusted  []*net.IPNet // trusted_proxies
	// autoConns is the cap on client connections when the configuration
	// sets none: what the open files limit has room for beside its
	// backends (autoMaxConns).
	autoConns int
	// restartNeeded names the settings this configuration changed that
	// apply only after a restart (the running ones are kept).
	restartNeeded []string
}

type modelPool struct {
	cfg       config.Model
	names     atomic.Pointer[modelNames] // the current aliases and adapters (cfg's may be older)
	routerCfg config.Router
	enc       *tokenize.Encoder // nil with tokenizer: engine
	engineTok *engineTokenizer  // set with tokenizer: engine
	rt        *router.Router
	workers   atomic.Pointer[[]*backend] // indexed by router.WorkerID
	coolMu    sync.Mutex                 // one backend cools down at a time: never the last
	waiting   atomic.Int64               // requests queued for a slot (route)
	queue     waitQueue                  // ... in order
	queueWait prometheus.Observer        // kvproxy_queue_wait_seconds of the model
}

// modelNames are a model's other names, which a reload changes without
// rebuilding its pool.
type modelNames struct {
	aliases, adapters []string
}

// unnamed is m without its other names and its tokenizer cache's size:
// what a pool is built from, and changing it loses the index.
func unnamed(m config.Model) config.Model {
	m.Aliases, m.Adapters, m.TokenizerCacheMB = nil, nil, 0
	return m
}

// tokenizerCacheBytes is what the model's tokenizer cache holds.
func (p *modelPool) tokenizerCacheBytes() int {
	if p.enc != nil {
		held, _ := p.enc.CacheBytes()
		return held
	}
	return p.engineTok.cache.bytes()
}

func (p *modelPool) backend(w router.WorkerID) *backend {
	ws := *p.workers.Load()
	if int(w) < len(ws) {
		return ws[w]
	}
	return nil
}

func (p *modelPool) setBackend(b *backend) {
	old := *p.workers.Load()
	ws := make([]*backend, max(len(old), int(b.worker)+1))
	copy(ws, old)
	ws[b.worker] = b
	p.workers.Store(&ws)
}

// New builds the pools and backends of cfg; Serve starts answering.
func New(cfg *config.Config, opts Options) (*Server, error) {
	s := &Server{log: opts.Logger, opts: opts, limits: cfg.Limits, started: cfg,
		retries: newRetryBudget(cfg.Limits.RetryBudget), rejectLog: newLogLimiter(opts.Logger),
		listsRead: make(chan struct{}), bodyMem: backends.NewBudget(0)}
	var rb [6]byte
	rand.Read(rb[:])
	s.reqPrefix = hex.EncodeToString(rb[:])
	rand.Read(s.respRandom[:])
	if !opts.DisableHealthChecks {
		s.health = backends.NewProber(backends.ProbeConfig{
			Interval: cfg.Health.Interval, Timeout: cfg.Health.Timeout, Rise: cfg.Health.Rise, Fall: cfg.Health.Fall,
		})
	}
	st, err := s.prepare(cfg)
	if err != nil {
		return nil, err
	}
	s.activate(st, nil)
	s.routeTable = s.routes()
	if rc := cfg.Replicas; rc.NATS != "" {
		if s.replicas, err = replicas.Start(replicas.Config{URL: rc.NATS, Subject: rc.Subject, ID: rc.ID, Interval: rc.Interval,
			CredsFile: rc.CredsFile, CAFile: rc.TLS.CAFile, CertFile: rc.TLS.CertFile, KeyFile: rc.TLS.KeyFile},
			s.localLoad, s.applyRemoteLoad, s.log); err != nil {
			for _, b := range st.backends { // activate started their event feeds
				b.stopEvents()
				b.stop()
			}
			return nil, err
		}
	}
	s.watcher = newHangupWatcher() // after the last error: a goroutine and two fds, given back by Shutdown
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	s.metrics.register(reg, s)
	s.srv = s.httpServer(cfg)
	return s, nil
}

// httpServer is the HTTP server of a listener: Serve's, and ServeAdmin's,
// which runs on through the drain.
func (s *Server) httpServer(cfg *config.Config) *fasthttp.Server {
	return &fasthttp.Server{
		Handler:               s.handle,
		Name:                  "kvproxy",
		NoDefaultServerHeader: true,
		// fasthttp's errors quote the request they could not parse, its
		// Authorization header with it (the security review: keys in the
		// debug log, which README says they never are).
		SecureErrorLogMessage: true,
		MaxRequestBodySize:    cfg.Limits.MaxRequestBodyBytes,
		ReadBufferSize:        cfg.Limits.MaxHeaderBytes, // also the largest header accepted
		// Bodies are read by the handler once it has checked the request
		// (rawBody), into a buffer that grows as bytes arrive: fasthttp
		// reading them first allocated each one's declared length at once.
		StreamRequestBody: true,
		// ReadTimeout covers the headers (slowloris); the body gets its own
		// budget once the headers are in. No WriteTimeout: it would cut long
		// streams, which have an idle timer instead.
		ReadTimeout: cfg.Limits.HeaderTimeout,
		HeaderReceived: func(h *fasthttp.RequestHeader) fasthttp.RequestConfig {
			// The body's limits are read per request: a reload changes them.
			// With bodies streamed, fasthttp reads up to the smallest of
			// this, the declared length and 8 KiB before calling the
			// handler (prefetchedBody); the handler refuses a body declared
			// over its limit, or any body of a request without a key
			// kvproxy knows (refuseDeclaredBody), and gets one byte of it:
			// a stranger that declared a body and sent none held its
			// connection for body_timeout, and got a 408 (the security
			// review).
			st := s.st.Load()
			known := st.auth.knows(h)
			max, wait := st.cfg.Limits.MaxRequestBodyBytes, st.cfg.Limits.BodyTimeout
			if cl := h.ContentLength(); cl > max || !known && hasBody(cl) {
				// A client that waits for an answer before it sends the
				// body gets its 413 (or 401) when that byte is not there
				// at once (transportError, which gets the request with its
				// headers reset: they are noted here), not a 408 after
				// body_timeout.
				note := overLimitBody{at: time.Now(), known: known, header: new(fasthttp.RequestHeader)}
				h.CopyTo(note.header)
				s.overLimit.add(h, note)
				max, wait = 1, min(wait, declaredBodyWait)
			} else {
				s.overLimit.clear(h) // one a previous request of this pooled header left
			}
			return fasthttp.RequestConfig{ReadTimeout: wait, MaxRequestBodySize: max}
		},
		IdleTimeout: cfg.Limits.IdleTimeout,
		// An answer that ends once Shutdown has begun says Connection:
		// close, and that makes fasthttp flush it: with another request
		// pipelined behind it, fasthttp waits to flush and, stopping,
		// dropped the unflushed answer (the chaos trial's drain).
		CloseOnShutdown:              true,
		MaxIdleWorkerDuration:        maxIdleWorkerDuration,
		DisablePreParseMultipartForm: true,
		ErrorHandler:                 s.transportError,
		ExpectHandler:                s.expectContinue,
		ConnState: func(c net.Conn, cs fasthttp.ConnState) {
			// Idle connections may make room for new ones at the cap
			// (capListener); busy ones never.
			switch cs {
			case fasthttp.StateIdle:
				if cc := countedOf(c); cc != nil {
					cc.idle()
				}
			case fasthttp.StateActive, fasthttp.StateHijacked:
				if cc := countedOf(c); cc != nil {
					cc.busy()
				}
			}
			// A hijacked connection (an HTTP/1.0 stream) is still watched
			// for hang-ups while its relay runs: relayUntilClose forgets it.
			if cs == fasthttp.StateClosed {
				s.watcher.Closed(c)
				if rl, ok := s.hijacks.LoadAndDelete(c); ok {
					rl.(io.Closer).Close()
				}
			}
		},
		Logger: fasthttpLogger{s.log},
	}
}

// build makes the state for cfg, reusing from prev every pool whose model and
// router settings are unchanged and every backend whose settings are unchanged,
// so their index, load and connections carry over.
func (s *Server) build(cfg *config.Config, prev *state) (*state, error) {
	st := &state{cfg: cfg, models: map[string]*modelPool{}, served: map[string]*modelPool{}, backends: map[string]*backend{}}
	var prevAuth *authTable
	if prev != nil {
		prevAuth = prev.auth
	}
	st.auth = newAuthTable(cfg, prevAuth)
	st.respMACs = newRespMACs(respKey(cfg.Auth, s.respRandom[:]))
	st.trusted = cfg.TrustedNets()
	fds := s.fdLimit
	if cfg.AdminListen != "" && fds > 2*adminMaxConns {
		fds -= adminMaxConns // admin_listen's connections, which hold no engine's
	}
	st.autoConns = autoMaxConns(fds, len(cfg.Backends))
	for mi, mc := range cfg.Models {
		var p *modelPool
		if prev != nil {
			if old := prev.models[mc.Name]; old != nil && old.cfg.Name == mc.Name && reflect.DeepEqual(unnamed(old.cfg), unnamed(mc)) {
				// The pool, its router, index and load carry over. A router
				// cannot change its settings in place; rebuilding it would
				// throw away what it knows of every engine's cache, so
				// router settings take effect at the next restart. Its
				// aliases and adapters are names only: they change in place
				// when this state is activated (a reload that fails later
				// must change nothing).
				p = old
				if !reflect.DeepEqual(old.routerCfg, cfg.Router) {
					s.log.Warn().Str("model", mc.Name).Msg("reload: router settings changed; they apply after a restart (the index is kept)")
					st.restartNeeded = append(st.restartNeeded, "router (model "+mc.Name+")")
				}
				if old.cfg.TokenizerCacheMB != mc.TokenizerCacheMB {
					s.log.Warn().Str("model", mc.Name).Msg("reload: tokenizer_cache_mb changed; it applies after a restart")
					st.restartNeeded = append(st.restartNeeded, "tokenizer_cache_mb (model "+mc.Name+")")
				}
			}
		}
		if p == nil {
			rt, err := router.New(routerConfig(cfg, mc))
			if err != nil {
				return nil, fmt.Errorf("model %s: %w", mc.Name, err)
			}
			p = &modelPool{cfg: mc, routerCfg: cfg.Router, rt: rt, queueWait: s.metrics.queueWait.WithLabelValues(mc.Name)}
			p.names.Store(&modelNames{aliases: mc.Aliases, adapters: mc.Adapters})
			if mc.Tokenizer == config.TokenizerEngine {
				p.engineTok = &engineTokenizer{}
			} else {
				tok, err := tokenize.Load(mc.Tokenizer)
				if err != nil {
					return nil, fmt.Errorf("model %s: %s: %w", mc.Name, cfg.Where(fmt.Sprintf("models[%d].tokenizer", mi)), err)
				}
				tmpl, err := tokenize.LoadTemplate(mc.Template)
				if err != nil {
					return nil, fmt.Errorf("model %s: %s: %w", mc.Name, cfg.Where(fmt.Sprintf("models[%d].template", mi)), err)
				}
				p.enc = tokenize.NewEncoder(tok, tmpl, mc.TokenizerCacheMB<<20/tokenize.CacheBytesPerEntry)
			}
			p.workers.Store(&[]*backend{})
		}
		st.pools = append(st.pools, p)
		st.models[mc.Name] = p
		for _, a := range slices.Concat(mc.Aliases, mc.Adapters) {
			st.models[a] = p
		}
	}
	for _, bc := range cfg.Backends {
		p := st.models[bc.Model]
		if prev != nil {
			// Health settings apply to a kept backend in place (activate).
			if old := prev.backends[bc.ID]; old != nil && old.pool == p && reflect.DeepEqual(old.cfg, bc) &&
				len(upstreamLimitsChanged(prev.cfg.Limits, cfg.Limits)) == 0 {
				st.backends[bc.ID] = old
				continue
			}
		}
		b := newBackend(bc, cfg, p, s.log)
		b.up.Budget = s.bodyMem
		b.wake, b.metrics = p.queue.signal, s.metrics
		if b.prefillOnly() {
			b.wake = nil // no waiter can use its slots
		}
		b.probed = s.health != nil
		st.backends[bc.ID] = b
	}
	st.nameServedModels()
	return st, nil
}

// nameServedModels lets the engines' own model name (served_model) name
// their model too, as clients that used the engines directly name it
// (vLLM's is the Hugging Face id): unless it is a configured name, alias
// or adapter, or the engines of two models answer to it. An adapter the
// engines list goes first (poolFor).
func (st *state) nameServedModels() {
	served := map[string]*modelPool{}
	for _, bc := range st.cfg.Backends {
		if bc.ServedModel == "" || st.models[bc.ServedModel] != nil {
			continue
		}
		p := st.models[bc.Model]
		if q, ok := served[bc.ServedModel]; ok && q != p {
			p = nil // ambiguous
		}
		served[bc.ServedModel] = p
	}
	for name, p := range served {
		if p != nil {
			st.served[name] = p
		}
	}
}

// activate makes st current: backends start getting traffic and probes;
// backends of prev that st lacks drain and then disappear.
func (s *Server) activate(st, prev *state) {
	mb := st.cfg.Limits.BodyMemoryMB
	if mb == 0 { // a configuration built in code, without the defaults
		mb = config.DefaultBodyMemoryMB
	}
	s.bodyMem.SetLimit(int64(mb) << 20)
	for _, mc := range st.cfg.Models {
		st.models[mc.Name].names.Store(&modelNames{aliases: mc.Aliases, adapters: mc.Adapters})
	}
	s.shareSlots(st)
	if prev != nil {
		// A backend replaced by a new configuration of the same id hands its
		// worker over: its event feed stops and forgets before the new one
		// starts, so the index never mixes two feeds' mappings. Its rank
		// workers go to the new one while its configuration has them.
		for id, old := range prev.backends {
			if nb := st.backends[id]; nb != nil && nb != old && nb.pool == old.pool {
				if old.sameFeed(nb) {
					// The engine's feed goes on: a new one would find
					// the index empty, and vLLM does not announce again
					// the blocks it still holds (a reload that changed
					// only health settings emptied every index).
					nb.setFeed(old.feed)
					nb.eventsPushed.Store(old.eventsPushed.Load())
					nb.rankGroup = old.rankGroup // the feed's: its next ranks join nb's group
					nb.rankGroup.Store(int32(peerGroup(nb.cfg.Role)))
				} else {
					old.stopEvents()
				}
				nb.adoptRanks(old)
				old.handOver(nb)
			}
		}
	}
	for _, b := range st.backends {
		b.setHealth(st.cfg.Health)
		var was *backend
		if prev != nil {
			if was = prev.backends[b.cfg.ID]; was == b {
				continue
			}
		}
		if was == nil || was.pool != b.pool {
			b.adoptRanks(nil) // a removed backend of its id may still drain
		}
		if was != nil && was.probeURL() == b.probeURL() {
			b.adapters.Store(was.adapters.Load())
			b.maxModelLen.Store(was.maxModelLen.Load())
			if s.health != nil {
				b.inheritProbe(was)
			}
		}
		// Its feed first: requests reach b once it is set in the pool,
		// and read its feed for its data-parallel ranks.
		b.startEvents()
		b.pool.setBackend(b)
		b.mu.Lock()
		for _, w := range b.workerIDs() {
			b.pool.rt.SetAvailable(w, b.available)
		}
		b.mu.Unlock()
		if s.health != nil {
			// Replaces the probe of a backend of its id: the same engine
			// keeps its probe state (a rebuilt backend of a dead engine
			// is down at once, not healthy until probes fail again).
			s.health.Add(b.cfg.ID, b.probeURL(), func(ok bool, why string) {
				if b.setProbe(ok, why) {
					s.cutUnresponsive(b, why)
				}
			})
		}
	}
	if hook := s.testActivating.Load(); hook != nil {
		(*hook)()
	}
	s.st.Store(st)
	if prev == nil {
		return
	}
	// Queued requests look again: there may be new backends or slots, or
	// none left to wait for.
	defer func() {
		for _, p := range slices.Concat(prev.pools, st.pools) {
			p.queue.wakeAll()
		}
	}()
	// The event feeds of the backends removed stop side by side: each
	// stop waits for its feed's goroutine, and 128 in a row held the
	// reload 5 s (the scale trial). All have stopped before any retires.
	var stopping sync.WaitGroup
	for id, old := range prev.backends {
		nb := st.backends[id]
		if nb == old || nb != nil && nb.pool == old.pool {
			continue // kept, or replaced (above)
		}
		if s.health != nil && nb == nil {
			s.health.Remove(id)
		}
		old.drain(nb != nil)
		stopping.Go(old.stopEvents)
	}
	stopping.Wait()
	for id, old := range prev.backends {
		if st.backends[id] == old {
			continue
		}
		nb := st.backends[id]
		replaced := nb != nil && nb.pool == old.pool
		rebuilt := replaced && reflect.DeepEqual(nb.cfg, old.cfg)
		old.retiring.Store(true) // before retire reads its inflight: see route
		s.retiring.Store(old, struct{}{})
		go s.retire(old, replaced, rebuilt, st.cfg.Limits.DrainTimeout)
	}
}

// shareSlots gives each new backend the max_concurrency count of the
// backend of its id and URL it replaces, whatever else changed (its model's
// pool too), or that a reload removed while its requests still run: they
// hold slots of the new limit. A backend moved to another URL is another
// engine, and starts with its slots free. Counts nothing holds any more
// are dropped.
func (s *Server) shareSlots(st *state) {
	if s.slotCounts == nil {
		s.slotCounts = map[string]*slotCount{}
	}
	current := map[*slotCount]bool{}
	for id, b := range st.backends {
		key := id + " " + b.cfg.URL
		if c := s.slotCounts[key]; c != nil && c != b.slots {
			c.limit.Store(int64(b.cfg.MaxConcurrency))
			c.owner.Store(b)
			b.slots = c
			b.markFull()
		}
		s.slotCounts[key] = b.slots
		current[b.slots] = true
	}
	for key, c := range s.slotCounts {
		if !current[c] && c.held.Load() == 0 {
			delete(s.slotCounts, key)
		}
	}
}

// upstreamLimitsChanged names the limits that differ between a and b among
// those a backend's connections are built with: a change rebuilds every
// backend, as the running exchanges read them unguarded.
func upstreamLimitsChanged(a, b config.Limits) []string {
	var out []string
	if a.StreamIdleTimeout != b.StreamIdleTimeout {
		out = append(out, "limits.stream_idle_timeout")
	}
	if a.UpstreamConnectTime != b.UpstreamConnectTime {
		out = append(out, "limits.upstream_connect_timeout")
	}
	if a.MaxConnsPerBackend != b.MaxConnsPerBackend {
		out = append(out, "limits.max_conns_per_backend")
	}
	return out
}

// retire waits for a removed backend's requests to end (up to timeout), then
// drops its index entries; it stays listed (/admin/backends, inflight in
// /metrics) and keeps its connections until they have all ended. A backend
// replaced by a new configuration of the same id keeps its worker and index;
// rebuilt: with the same settings (upstreamLimitsChanged), which the
// reload's line reports, so its retirement is logged at debug only.
func (s *Server) retire(b *backend, replaced, rebuilt bool, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) && b.inflight.Load() > 0 {
		time.Sleep(50 * time.Millisecond)
	}
	defer func() {
		// Found by the ninth session's operator trial: the backend left the
		// listing at the deadline while its streams went on, and an operator
		// who saw it gone would have stopped the engine under them.
		if n := b.inflight.Load(); n > 0 {
			s.log.Warn().Str("backend", b.cfg.ID).Int64("inflight", n).Dur("drain_timeout", timeout).
				Msg("backend still has requests after limits.drain_timeout: listed as draining until they end")
		}
		for b.inflight.Load() > 0 {
			time.Sleep(50 * time.Millisecond)
		}
		b.stop()
		s.reloadMu.Lock()
		if s.st.Load().backends[b.cfg.ID] == nil {
			s.metrics.forgetBackend(b.cfg.ID)
		}
		s.reloadMu.Unlock()
		ev := s.log.Info()
		if rebuilt {
			ev = s.log.Debug()
		}
		// Logged before AwaitRetired can return: whoever stops the engine
		// then finds the line in the log.
		// "replaced" as the reload's backends_replaced: a backend of its
		// id took over (in its pool, or in another: drain said which).
		b.mu.Lock()
		succeeded := replaced || b.succeeded
		b.mu.Unlock()
		ev.Str("backend", b.cfg.ID).Bool("replaced", succeeded).Msg("backend retired")
		s.retiring.Delete(b)
		s.signalRetired()
	}()
	if !replaced {
		// Not while a reload runs: one bringing the id back into the pool
		// takes over the workers (adoptRanks).
		s.reloadMu.Lock()
		if cur := s.st.Load().backends[b.cfg.ID]; cur == nil || cur.pool != b.pool {
			b.stopEvents()
			b.pool.rt.RemoveWorker(b.worker)
			// Every rank worker of its id, its own and any it took over.
			for _, w := range b.rankWorkers() {
				b.pool.rt.RemoveWorker(w.ID)
			}
		}
		s.reloadMu.Unlock()
	}
}

// AwaitRetired waits until the proxy is done with the engine of backend
// id at url: no backend of its configuration is that one, and every one a
// reload removed or replaced has retired (its requests are over, none can
// be routed to it, its pooled connections are closed). An engine the proxy
// alone uses (an in-process mock) may stop then without failing a request.
// It returns ctx's error if ctx ends first. A backend a reload removes
// counts from the time Reload returns.
func (s *Server) AwaitRetired(ctx context.Context, id, url string) error {
	for {
		s.retiredMu.Lock()
		if s.retiredCh == nil {
			s.retiredCh = make(chan struct{})
		}
		ch := s.retiredCh
		s.retiredMu.Unlock()
		if !s.usesEngine(id, url) {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// usesEngine reports whether a backend of id and url is configured or
// retiring.
func (s *Server) usesEngine(id, url string) bool {
	if b := s.st.Load().backends[id]; b != nil && b.cfg.URL == url {
		return true
	}
	found := false
	s.retiring.Range(func(k, _ any) bool {
		b := k.(*backend)
		found = b.cfg.ID == id && b.cfg.URL == url
		return !found
	})
	return found
}

// signalRetired wakes AwaitRetired: a backend has retired.
func (s *Server) signalRetired() {
	s.retiredMu.Lock()
	if s.retiredCh != nil {
		close(s.retiredCh)
		s.retiredCh = nil
	}
	s.retiredMu.Unlock()
}

// Check builds what cfg describes (the listener's certificate, each model's
// tokenizer, chat template and router, each backend) as New does, and starts
// nothing: no listener, probe, event feed or NATS connection. It logs the
// warnings New would. kvproxy -check runs it, so that a configuration can be
// tried before it is deployed or reloaded.
func Check(cfg *config.Config, opts Options) error {
	_, err := (&Server{log: opts.Logger}).prepare(cfg)
	return err
}

// prepare warns of what in cfg is likely a mistake, loads the listener's
// certificate and builds the state cfg describes.
func (s *Server) prepare(cfg *config.Config) (*state, error) {
	if len(cfg.Templates()) > 0 {
		return nil, errTemplates
	}
	s.fdLimit = openFilesLimit()
	s.logWarnings(cfg)
	if cfg.TLS.Enabled() {
		c, err := cfg.TLS.Load()
		if err != nil {
			return nil, fmt.Errorf("tls: %w", err)
		}
		s.cert.Store(c)
	}
	s.metrics = newMetrics()
	s.refuseLog = refuseLog{counted: s.metrics.connsRefused, say: func(n int) {
		s.log.Warn().Int("max_connections", s.maxConns()).Int("refused", n).
			Msg("client connections refused: limits.max_connections are open (answered 503 and closed)")
	}}
	s.adminRefuseLog = refuseLog{counted: s.metrics.adminConnsRefused, say: func(n int) {
		s.log.Warn().Int("admin_connections", adminMaxConns).Int("refused", n).
			Msg("operators' connections refused: admin_listen has as many open as it takes, none idle (answered 503 and closed)")
	}}
	return s.build(cfg, nil)
}

// logWarnings logs what in cfg is likely a mistake.
func (s *Server) logWarnings(cfg *config.Config) {
	for _, w := range cfg.Warnings() {
		s.log.Warn().Msg("config: " + w)
	}
	if replicasWithoutNATS(cfg.Replicas) {
		s.log.Warn().Str("setting", "replicas.nats").Msg("config: replicas sets subject, id, interval, creds_file or tls but no nats (an unset variable?): this replica shares no load and routes on its own")
	}
	room := connsFor(s.fdLimit, len(cfg.Backends))
	if s.fdLimit > 0 && room < 64 {
		s.log.Warn().Uint64("open_files_limit", s.fdLimit).Int("backends", len(cfg.Backends)).Uint64("room_for", room).
			Msg("config: the open files limit has little room for client connections beside the backends' own (about 4 descriptors each: probe, scrapes, event feed, a pooled engine connection): raise it (ulimit -n, LimitNOFILE)")
	}
	if n := cfg.Limits.MaxConnections; n > 0 && s.fdLimit > 0 && uint64(n) > room {
		s.log.Warn().Str("setting", "limits.max_connections").Int("max_connections", n).Uint64("open_files_limit", s.fdLimit).
			Uint64("room_for", room).
			Msg("config: the open files limit has no room for this many client connections and their engine connections: accepts will fail for want of descriptors (kvproxy retries them) before the cap refuses any")
	}
}

// replicasWithoutNATS reports a replicas block that names the fleet but no
// NATS server: without this warning the replica ran alone, silently.
func replicasWithoutNATS(rc config.Replicas) bool {
	return rc.NATS == "" && rc != (config.Replicas{})
}

// Reload applies a new configuration without dropping in-flight requests.
// An invalid configuration is rejected and the current one keeps serving.
func (s *Server) Reload(cfg *config.Config) (err error) { return s.reload(cfg, true) }

// ReloadBackends is Reload for a change of the engines discovered: the
// listener's certificate is not read again (a discovery must not depend on
// the certificate files, nor rotate the certificate unasked).
func (s *Server) ReloadBackends(cfg *config.Config) error { return s.reload(cfg, false) }

func (s *Server) reload(cfg *config.Config, readCert bool) (err error) {
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	defer func() { s.metrics.countReload(err) }()
	if err := cfg.Validate(); err != nil {
		return err
	}
	if len(cfg.Templates()) > 0 {
		return errTemplates
	}
	s.logWarnings(cfg)
	prev := s.st.Load()
	listenChanged := cfg.Listen != prev.cfg.Listen
	if listenChanged {
		s.log.Warn().Msg("reload: listen address changes need a restart; keeping the current one")
		cfg.Listen = prev.cfg.Listen
	}
	adminListenChanged := cfg.AdminListen != prev.cfg.AdminListen
	if adminListenChanged {
		s.log.Warn().Msg("reload: admin_listen changes need a restart; keeping the current one")
		cfg.AdminListen = prev.cfg.AdminListen
	}
	// The listener's certificate is read again (rotation); turning TLS on
	// or off needs a restart, as the listener does.
	var cert *tls.Certificate
	tlsChanged := cfg.TLS.Enabled() != s.started.TLS.Enabled()
	if tlsChanged {
		s.log.Warn().Msg("reload: turning tls on or off needs a restart; the listener keeps serving as it does")
	} else if cfg.TLS.Enabled() && readCert {
		c, err := cfg.TLS.Load()
		if err != nil {
			return fmt.Errorf("tls: %w", err)
		}
		cert = c
	}
	st, err := s.build(cfg, prev)
	if err != nil {
		return err
	}
	if listenChanged {
		st.restartNeeded = append(st.restartNeeded, "listen")
	}
	if adminListenChanged {
		st.restartNeeded = append(st.restartNeeded, "admin_listen")
	}
	if tlsChanged {
		st.restartNeeded = append(st.restartNeeded, "tls")
	}
	if cert != nil {
		s.cert.Store(cert)
	}
	// Read once at start: the HTTP server's header limits, the retry
	// budget, the prober's schedule, the replicas' NATS connection. Compared
	// with what runs, not with the last reload (which may not have applied).
	run := s.started
	pl, l := run.Limits, cfg.Limits
	ph, h := run.Health, cfg.Health
	for _, c := range []struct {
		name    string
		changed bool
	}{
		{"limits.max_header_bytes", pl.MaxHeaderBytes != l.MaxHeaderBytes},
		{"limits.header_timeout", pl.HeaderTimeout != l.HeaderTimeout},
		{"limits.idle_timeout", pl.IdleTimeout != l.IdleTimeout},
		{"limits.retry_budget", pl.RetryBudget != l.RetryBudget},
		{"health.interval", ph.Interval != h.Interval},
		{"health.timeout", ph.Timeout != h.Timeout},
		{"health.rise", ph.Rise != h.Rise},
		{"health.fall", ph.Fall != h.Fall},
		{"replicas", run.Replicas != cfg.Replicas},
	} {
		if c.changed {
			s.log.Warn().Str("setting", c.name).Msg("reload: this setting applies after a restart")
			st.restartNeeded = append(st.restartNeeded, c.name)
		}
	}
	changes := diffReload(prev, st)
	ev := s.log.Info()
	if limits := upstreamLimitsChanged(prev.cfg.Limits, cfg.Limits); len(limits) > 0 {
		// Backends_replaced says a backend's settings changed; these only
		// got new connections, for the new limits.
		rebuilt := 0
		changes.backendsReplaced = slices.DeleteFunc(changes.backendsReplaced, func(id string) bool {
			same := reflect.DeepEqual(prev.backends[id].cfg, st.backends[id].cfg) && prev.backends[id].pool == st.backends[id].pool
			if same {
				rebuilt++
			}
			return same
		})
		if rebuilt > 0 {
			ev = ev.Int("backends_rebuilt", rebuilt).Strs("rebuilt_for", limits)
		}
	}
	s.activate(st, prev)
	changes.log(ev, len(st.backends), len(st.pools))
	return nil
}

// errTemplates: the caller resolves backends[].discover (config.Expand).
var errTemplates = errors.New("backends with discover are templates: expand them (config.Expand) before serving")

// ReloadFailed counts a reload that failed before Reload was called (the
// configuration file did not load): the reload metrics count every try.
func (s *Server) ReloadFailed() { s.metrics.countReload(errReloadFailed) }

var errReloadFailed = errors.New("reload failed")

func routerConfig(cfg *config.Config, mc config.Model) router.Config {
	rc := router.DefaultConfig()
	rc.Policy = cfg.Router.Policy
	rc.BlockSize = mc.BlockSize
	rc.IndexTTL = cfg.Router.IndexTTL
	if cfg.Router.MaxIndexBlocks > 0 {
		rc.MaxIndexBlocks = cfg.Router.MaxIndexBlocks
	}
	rc.Temperature = cfg.Router.Temperature
	if cfg.Router.Seed != 0 {
		rc.Seed = cfg.Router.Seed
	}
	if v := cfg.Router.Cost.PrefillMsPerToken; v > 0 {
		rc.Cost.PrefillMsPerToken = v
	}
	if v := cfg.Router.Cost.QueueMsPerToken; v > 0 {
		rc.Cost.QueueMsPerToken = v
	}
	if v := cfg.Router.Cost.DecodeMsPerBlock; v > 0 {
		rc.Cost.DecodeMsPerBlock = v
	}
	if v := cfg.Router.OverlapWeight; v > 0 {
		rc.Dynamo.OverlapWeight = v
	}
	mb := float64(mc.BytesPerBlock) / (1 << 20)
	f := cfg.Router.FetchUsPerMB
	rc.Cost.FetchMsPerBlock[kv.TierHost] = f.Host * mb / 1000
	rc.Cost.FetchMsPerBlock[kv.TierDisk] = f.Disk * mb / 1000
	rc.Cost.FetchMsPerBlock[kv.TierShared] = f.Shared * mb / 1000
	if cfg.Router.Calibrate != nil {
		rc.Calibrate = *cfg.Router.Calibrate
	}
	return rc
}

// Serve answers on ln until Shutdown. After Shutdown (which may win the
// race with a Serve still starting) it closes ln and returns nil.
func (s *Server) Serve(ln net.Listener) error { return s.serve(ln, false) }

// ServeAdmin answers operators on ln (admin_listen) until Shutdown has
// drained the requests: /live, /health, /metrics, /admin/* and
// /v1/kv_events, with TLS if Serve has it. With admin_listen configured,
// Serve's listener does not serve /metrics and /admin/*.
func (s *Server) ServeAdmin(ln net.Listener) error { return s.serve(ln, true) }

func (s *Server) serve(ln net.Listener, admin bool) error {
	s.serveMu.Lock()
	if s.stopped {
		s.serveMu.Unlock()
		ln.Close()
		return nil
	}
	ln = newRetryListener(ln, s.acceptFailed, s.acceptRecovered)
	capped := &capListener{Listener: ln, max: s.maxConns, open: &s.openConns, spares: &s.spareConns, refused: s.connRefused, evicted: s.metrics.connsEvicted.Inc}
	if admin {
		capped = &capListener{Listener: ln, admin: true, max: func() int { return adminMaxConns }, open: &s.adminConns, refused: s.adminRefuseLog.add, evicted: func() {}}
	}
	if s.cert.Load() == nil { // under TLS, plain text is no answer: closed only
		capped.refusal = tooManyConnsAnswers
		if admin {
			capped.refusal = adminFullAnswers
		}
	}
	ln = capped
	ln = writeIdleListener{ln, func() time.Duration { return s.st.Load().cfg.Limits.StreamIdleTimeout }}
	if s.cert.Load() != nil {
		ln = tls.NewListener(plainHTTPGuard{ln}, &tls.Config{
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return s.cert.Load(), nil },
			MinVersion:     tls.VersionTLS12,
			NextProtos:     []string{"http/1.1"},
		})
	}
	srv := s.srv
	if admin {
		if s.adminSrv == nil {
			s.adminSrv = s.httpServer(s.started)
		}
		srv = s.adminSrv
		s.adminListeners = append(s.adminListeners, ln)
	} else {
		s.listeners = append(s.listeners, ln)
	}
	if s.health != nil {
		s.health.Start()
	}
	s.startOnce.Do(func() {
		s.stopScrape = make(chan struct{})
		s.scrapeDone = make(chan struct{})
		go func() {
			defer close(s.scrapeDone)
			s.scrapeLoop(s.stopScrape)
		}()
	})
	s.serveMu.Unlock()
	return srv.Serve(ln)
}

// FlushLogs writes the lines kvproxy holds back now: the summary of the
// rejected requests whose lines the last second suppressed.
func (s *Server) FlushLogs() { s.rejectLog.flush() }

// Shutdown stops accepting, lets in-flight requests and streams finish, and
// stops probes. Bound it with a deadline from outside if needed.
func (s *Server) Shutdown() error {
	s.serveMu.Lock()
	s.stopped = true          // a Serve from now on returns at once
	s.startOnce.Do(func() {}) // a Serve still starting has set up the scrape loop, or never will
	s.serveMu.Unlock()
	s.draining.Store(true)
	err := s.srv.Shutdown()
	// fasthttp closes only the listeners its Serve had registered: one still
	// being registered is closed here (closing one twice is harmless).
	s.serveMu.Lock()
	for _, ln := range s.listeners {
		ln.Close()
	}
	s.serveMu.Unlock()
	s.live.wait() // streams outlive fasthttp's view of the handler
	// The operators' listener last: probes and scrapes watched the drain.
	s.serveMu.Lock()
	adminSrv, adminListeners := s.adminSrv, s.adminListeners
	s.serveMu.Unlock()
	if adminSrv != nil {
		adminSrv.Shutdown()
	}
	for _, ln := range adminListeners {
		ln.Close()
	}
	s.stopOnce.Do(func() { // a second Shutdown (a test's cleanup) must not panic
		if s.health != nil {
			s.health.Stop()
		}
		if s.stopScrape != nil {
			close(s.stopScrape)
			<-s.scrapeDone
		}
		for _, b := range s.st.Load().backends {
			b.stopEvents()
			b.stop()
		}
		if s.replicas != nil {
			s.replicas.Close()
		}
		s.watcher.Close()
	})
	return err
}

// localLoad is the load this replica puts on each worker, for the others.
func (s *Server) localLoad() []replicas.Entry {
	var out []replicas.Entry
	st := s.st.Load()
	for _, p := range st.pools {
		backends := *p.workers.Load()
		for _, w := range p.rt.Workers() {
			if w.Removed {
				continue
			}
			var b *backend
			if int(w.ID) < len(backends) {
				b = backends[w.ID]
			}
			if b == nil { // a data-parallel rank's worker ("id#r")
				if rb, _ := st.rankBackend(w.Name); rb != nil && rb.pool == p {
					b = rb
				}
			}
			if b != nil {
				out = append(out, replicas.Entry{Model: p.cfg.Name, Worker: w.Name, URLHash: b.urlHash,
					Load: router.Load{Inflight: w.Inflight, Pending: w.Pending, PrefillTokens: w.PrefillTokens, ActiveBlocks: w.ActiveBlocks}})
			}
		}
	}
	return out
}

// applyRemoteLoad gives each worker the load the other replicas report on
// it (none where they report nothing).
func (s *Server) applyRemoteLoad(sum map[replicas.Key]router.Load) {
	for _, p := range s.st.Load().pools {
		for _, w := range p.rt.Workers() {
			p.rt.SetRemoteLoad(w.ID, sum[replicas.Key{Model: p.cfg.Name, Worker: w.Name}])
		}
	}
}

// Cut ends the requests still in flight, for when the drain deadline has
// passed: a stream gets an OpenAI error event and [DONE], a request whose
// answer has not begun or that waits for a backend slot a 503, instead of
// a connection dropped mid-answer. Shutdown returns once they are
// answered. It reports how many were cut.
func (s *Server) Cut() int {
	s.draining.Store(true)
	queued := int(s.queuedFirst.Load())
	return s.live.cutAll() + queued
}

// InFlight is how many requests are in flight towards engines or waiting
// for a backend slot: what Shutdown waits for and Cut would end.
func (s *Server) InFlight() int {
	s.live.mu.Lock()
	defer s.live.mu.Unlock()
	return len(s.live.set) + int(s.queuedFirst.Load())
}

// Idle reports whether every load counter of every worker is zero and no
// backend slot (max_concurrency) is held nor any request counted on a
// backend (what retiring a removed one waits for). A request frees its
// router slot just before its backend slot: both are checked.
func (s *Server) Idle() bool {
	for _, p := range s.st.Load().pools {
		if !p.rt.Idle() {
			return false
		}
		for _, b := range *p.workers.Load() {
			if b != nil && (b.slots.held.Load() != 0 || b.inflight.Load() != 0) {
				return false
			}
		}
	}
	return true
}

// access says who may call an endpoint.
type access uint8

const (
	public        access = iota // health
	client                      // an API key, when keys are configured
	admin                       // an admin key
	metricsReader               // a metrics key, when auth.metrics_keys are set, or an admin key
)

type route struct {
	method string // the one allowed (GET allows HEAD too)
	access access
	serve  func(ctx *fasthttp.RequestCtx, st *state)
}

func (s *Server) routes() map[string]route {
	t := map[string]route{
		"/v1/chat/completions":      {fasthttp.MethodPost, public, func(ctx *fasthttp.RequestCtx, st *state) { s.handleCompletion(ctx, st, apiChat) }},
		"/v1/completions":           {fasthttp.MethodPost, public, func(ctx *fasthttp.RequestCtx, st *state) { s.handleCompletion(ctx, st, apiCompletions) }},
		"/v1/responses":             {fasthttp.MethodPost, public, func(ctx *fasthttp.RequestCtx, st *state) { s.handleCompletion(ctx, st, apiResponses) }},
		"/v1/messages":              {fasthttp.MethodPost, public, func(ctx *fasthttp.RequestCtx, st *state) { s.handleCompletion(ctx, st, apiMessages) }},
		"/v1/messages/count_tokens": {fasthttp.MethodPost, public, func(ctx *fasthttp.RequestCtx, st *state) { s.handleCompletion(ctx, st, apiCountTokens) }},
		"/v1/models":                {fasthttp.MethodGet, client, s.handleModels},
		"/health":                   {fasthttp.MethodGet, public, s.handleHealth},
		"/healthz":                  {fasthttp.MethodGet, public, s.handleHealth},
		"/live":                     {fasthttp.MethodGet, public, s.handleLive},
		"/livez":                    {fasthttp.MethodGet, public, s.handleLive},
		"/metrics":                  {fasthttp.MethodGet, metricsReader, func(ctx *fasthttp.RequestCtx, _ *state) { s.metrics.serve(ctx) }},
		"/admin/backends":           {fasthttp.MethodGet, admin, s.handleAdminBackends},
		"/admin/index/lookup":       {fasthttp.MethodPost, admin, s.handleIndexLookup},
		"/admin/reload":             {fasthttp.MethodPost, admin, func(ctx *fasthttp.RequestCtx, _ *state) { s.handleAdminReload(ctx) }},
		"/v1/kv_events":             {fasthttp.MethodPost, admin, s.handleKVEvents},
	}
	for path := range passthroughPaths {
		t[path] = route{fasthttp.MethodPost, public, func(ctx *fasthttp.RequestCtx, st *state) { s.handlePassthrough(ctx, st, path) }}
	}
	return t
}

// handle dispatches a request. Completions check their key themselves
// (after counting the request), other endpoints here.
func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	defer s.finishBody(ctx)
	noted := s.overLimit.pending(&ctx.Request.Header)
	if noted {
		// Left, a note would answer a later request of this header
		// (fasthttp pools them) with this one's refusal (the review).
		defer s.overLimit.clear(&ctx.Request.Header)
	}
	if bytes.HasPrefix(ctx.Path(), messagesPath) {
		// Anthropic's clients read Anthropic's errors, whoever answers,
		// and its SDKs show the request's id from request-id.
		defer toAnthropicError(ctx)
		defer func() {
			if id := ctx.Response.Header.PeekBytes(hdrRequestID); len(id) > 0 { // a preflight has none
				ctx.Response.Header.SetBytesV("Request-Id", id)
			}
		}()
	}
	honourConnectionClose(ctx)
	cc := countedOf(ctx.Conn())
	if cc != nil && cc.spare() {
		cc.handled.Store(true)
		ctx.SetConnectionClose() // one request each
		if !probePath(ctx.Path()) {
			s.connRefused()
			retryAfterASecond(ctx)
			writeError(ctx, fasthttp.StatusServiceUnavailable, tooManyConnsMsg, "service_unavailable", "", "too_many_connections")
			return
		}
	}
	if refuseAmbiguousFraming(ctx) {
		s.logUnrouted(ctx, "Transfer-Encoding not chunked, or beside Content-Length")
		return
	}
	if dotSegments(ctx.Request.Header.RequestURI()) {
		writeError(ctx, fasthttp.StatusBadRequest, "the path has a . or .. segment (percent-encoded or not): name the endpoint itself", "invalid_request_error", "", "invalid_path")
		s.logUnrouted(ctx, "dot segment in the path")
		return
	}
	if s.wrongListener(ctx, cc) {
		return
	}
	if cl := ctx.Request.Header.ContentLength(); hasBody(cl) && (noted || cl > s.st.Load().cfg.Limits.MaxRequestBodyBytes) && s.refuseDeclaredBody(ctx) {
		return
	}
	defer s.recoverPanic(ctx) // before those above: they shape its answer
	if s.cors(ctx, s.st.Load()) {
		return // a preflight
	}
	r, ok := s.routeTable[string(ctx.Path())]
	if !ok && bytes.HasPrefix(ctx.Path(), modelPathPrefix) {
		r, ok = route{fasthttp.MethodGet, client, s.handleModel}, true
	}
	if !ok && bytes.HasPrefix(ctx.Path(), responsesPathPrefix) {
		// It checks the key (as completions do) and its methods itself.
		s.handleResponseByID(ctx, s.st.Load())
		return
	}
	if !ok {
		writeError(ctx, fasthttp.StatusNotFound, "unknown path "+strconv.Quote(string(ctx.Path())), "invalid_request_error", "", "not_found")
		s.logUnrouted(ctx, "unknown path")
		return
	}
	if r.access == admin && len(ctx.Request.Header.PeekBytes(hdrOrigin)) > 0 {
		// A browser's: any web page can make one (a form's POST needs no
		// preflight), and with no keys configured it would reload the
		// config or feed the KV index. Operators' tools send no Origin.
		writeError(ctx, fasthttp.StatusForbidden, "operator endpoints take no requests from web pages (the request has an Origin header)", "invalid_request_error", "", "browser_request_refused")
		s.logUnrouted(ctx, "browser request to an operator endpoint")
		return
	}
	st := s.st.Load()
	if r.access == admin && len(st.auth.admin) == 0 && st.auth.anonymous == nil {
		writeError(ctx, fasthttp.StatusForbidden, "admin endpoints are closed: client keys are configured and auth.admin_keys is not (add an admin key; SIGHUP still reloads)", "invalid_request_error", "", "admin_disabled")
		s.logUnrouted(ctx, "admin endpoints closed")
		return
	}
	if r.access == metricsReader && !st.auth.readsMetrics(ctx) {
		if st.auth.anonymous == nil && st.auth.client(ctx) != nil {
			writeError(ctx, fasthttp.StatusForbidden, "this API key is a client key; /metrics takes one of auth.metrics_keys or auth.admin_keys", "invalid_request_error", "", "metrics_key_required")
			s.logUnrouted(ctx, "client key on /metrics")
			return
		}
		ctx.Response.Header.Set("WWW-Authenticate", `Bearer realm="kvproxy"`)
		writeError(ctx, fasthttp.StatusUnauthorized, "missing or invalid metrics key (send Authorization: Bearer <one of auth.metrics_keys or auth.admin_keys>)", "invalid_request_error", "", "invalid_api_key")
		s.logUnrouted(ctx, "invalid metrics key")
		return
	}
	if (r.access == client && st.auth.client(ctx) == nil) || (r.access == admin && !st.auth.isAdmin(ctx)) {
		if r.access == admin && st.auth.anonymous == nil && st.auth.client(ctx) != nil { // a client's key: known, not allowed
			writeError(ctx, fasthttp.StatusForbidden, "this API key is a client key; admin endpoints take one of auth.admin_keys", "invalid_request_error", "", "admin_key_required")
			s.logUnrouted(ctx, "client key on an admin endpoint")
			return
		}
		unauthorized(ctx)
		s.logUnrouted(ctx, "invalid api key")
		return
	}
	if m := string(ctx.Method()); m != r.method && !(r.method == fasthttp.MethodGet && m == fasthttp.MethodHead) {
		allow := r.method
		if allow == fasthttp.MethodGet {
			allow = "GET, HEAD"
		}
		methodNotAllowed(ctx, allow)
		s.logUnrouted(ctx, "method not allowed")
		return
	}
	r.serve(ctx, st)
}

// recoverPanic answers a request whose handler panicked with a 500 and logs
// the stack. fasthttp recovers no handler's panic: one request would end
// the process, and every stream in it. What the request held is freed by
// the defers on its way (dispatch's among them).
func (s *Server) recoverPanic(ctx *fasthttp.RequestCtx) {
	p := recover()
	if p == nil {
		return
	}
	s.metrics.panics.Inc()
	s.metrics.countRequest("", fasthttp.StatusInternalServerError)
	rid := string(ctx.Response.Header.PeekBytes(hdrRequestID))
	s.log.Error().Str("request_id", rid).Str("path", string(ctx.Path())).Interface("panic", p).
		Str("stack", string(debug.Stack())).Msg("request handler panicked")
	if ctx.Hijacked() {
		return
	}
	ctx.Response.Reset()
	msg := "kvproxy failed on this request: a bug, which its log has the details of"
	if rid != "" {
		ctx.Response.Header.SetCanonical(hdrRequestID, stringBytes(rid))
		msg += " (request id " + rid + ")"
	}
	writeError(ctx, fasthttp.StatusInternalServerError, msg, "server_error", "", "internal_error")
}

// SetReloader gives POST /admin/reload what SIGHUP does: f loads the
// configuration file again and applies it whole (Reload and whatever else
// the command owns), or changes nothing and says why. Without one the
// endpoint answers 501.
func (s *Server) SetReloader(f func() error) { s.reloader.Store(&f) }

func (s *Server) handleAdminReload(ctx *fasthttp.RequestCtx) {
	f := s.reloader.Load()
	if f == nil || *f == nil {
		writeError(ctx, fasthttp.StatusNotImplemented, "reload is not available", "invalid_request_error", "", "")
		return
	}
	if err := (*f)(); err != nil {
		s.log.Error().Err(err).Msg("reload rejected (POST /admin/reload); the current configuration keeps serving")
		writeError(ctx, fasthttp.StatusBadRequest, "reload rejected, the current configuration keeps serving: "+err.Error(), "invalid_request_error", "", "invalid_config")
		return
	}
	answer := map[string]any{"status": "reloaded"}
	if later := s.st.Load().restartNeeded; len(later) > 0 {
		answer["restart_needed"] = later
	}
	writeJSON(ctx, answer)
}

func methodNotAllowed(ctx *fasthttp.RequestCtx, allow string) {
	ctx.Response.Header.Set("Allow", allow)
	writeError(ctx, fasthttp.StatusMethodNotAllowed, "method not allowed; use "+allow, "invalid_request_error", "", "method_not_allowed")
}

func unauthorized(ctx *fasthttp.RequestCtx) {
	ctx.Response.Header.Set("WWW-Authenticate", `Bearer realm="kvproxy"`)
	msg := "missing or invalid API key (send Authorization: Bearer <key>, or x-api-key: <key>)"
	if path := ctx.Path(); operatorPath(path) && !bytes.HasPrefix(path, []byte("/health")) { // they take admin keys, as bearer tokens only; /health a client's too
		msg = "missing or invalid admin key (send Authorization: Bearer <admin key>)"
	}
	writeError(ctx, fasthttp.StatusUnauthorized, msg, "invalid_request_error", "", "invalid_api_key")
}

// logUnrouted writes the access-log line of a request answered before any
// endpoint took it (unknown path, wrong method, bad key on a non-completion
// path), with the request's id (X-Request-Id) as every answer has; the
// path is cut at 200 bytes. Its lines are bounded as logRejected's are.
func (s *Server) logUnrouted(ctx *fasthttp.RequestCtx, reason string) {
	rid, _ := s.requestIDs(ctx)
	s.metrics.countRequest("", ctx.Response.StatusCode())
	if !s.rejectLog.allow("", reason, ctx.Response.StatusCode() >= 500) {
		return
	}
	s.rejectEvent(ctx.Response.StatusCode()).Str("request_id", rid).IPAddr("remote", s.st.Load().clientIP(ctx)).Str("method", logClip(ctx.Method())).Str("path", logClip(ctx.Path())).
		Int("status", ctx.Response.StatusCode()).Dur("duration", time.Since(ctx.Time())).Str("error", reason).Msg("request")
}

// expectContinue answers a request's Expect: 100-continue: one without a
// key kvproxy knows, or whose body is over the limit, is refused before
// the client sends its body (fasthttp asked for it, then refused it).
func (s *Server) expectContinue(ctx *fasthttp.RequestCtx) int {
	if s.wrongListener(ctx, countedOf(ctx.Conn())) { // its 404 before the body comes, in vain
		if bytes.HasPrefix(ctx.Path(), messagesPath) {
			toAnthropicError(ctx)
		}
		return ctx.Response.StatusCode()
	}
	st := s.st.Load()
	// Answered here, or its body is asked for.
	known, noted := s.judged(st, &ctx.Request.Header)
	reason := "body too large"
	switch {
	case !known:
		s.refuseStranger(ctx)
		reason = "invalid api key"
	case noted || ctx.Request.Header.ContentLength() > st.cfg.Limits.MaxRequestBodyBytes || beyondBudget(ctx.Request.Header.ContentLength(), s.bodyMem):
		msg := fmt.Sprintf("request body exceeds the limit of %d bytes", st.cfg.Limits.MaxRequestBodyBytes)
		if !noted && ctx.Request.Header.ContentLength() <= st.cfg.Limits.MaxRequestBodyBytes {
			// Within max_request_body_bytes, over a budget set smaller
			// (warned of): the client is told before it uploads.
			msg = fmt.Sprintf("request body larger than kvproxy holds at once (limits.body_memory_mb: %d MiB)", s.bodyMem.Limit()>>20)
		}
		s.cors(ctx, st)
		writeError(ctx, fasthttp.StatusRequestEntityTooLarge, msg, "invalid_request_error", "", "request_too_large")
		if bytes.HasPrefix(ctx.Path(), messagesPath) {
			toAnthropicError(ctx)
		}
	default:
		return fasthttp.StatusContinue
	}
	s.logTransport(ctx, reason, reason)
	return ctx.Response.StatusCode()
}

// refuseStranger answers a request without a key kvproxy knows before its
// body is read, as the handler would (CORS headers, the API's error shape).
func (s *Server) refuseStranger(ctx *fasthttp.RequestCtx) {
	ctx.SetConnectionClose()
	s.cors(ctx, s.st.Load())
	unauthorized(ctx)
	if bytes.HasPrefix(ctx.Path(), messagesPath) {
		toAnthropicError(ctx)
	}
}

// transportError answers requests fasthttp rejects before the handler:
// oversized bodies or headers, malformed HTTP, slow clients.
func (s *Server) transportError(ctx *fasthttp.RequestCtx, err error) {
	defer s.overLimit.clear(&ctx.Request.Header) // of use to the timeout's answer only (declaredOverLimit)
	var small *fasthttp.ErrSmallBuffer
	var ne net.Error
	// The log gets a fixed reason: fasthttp's errors may quote the
	// request's headers, API keys included.
	reason := "malformed HTTP request"
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		// Not met with bodies streamed: handle refuses them
		// (refuseDeclaredBody).
		st := s.st.Load()
		s.refuseLargeBody(ctx, st, st.auth.knows(&ctx.Request.Header))
		return
	case errors.Is(err, fasthttp.ErrUnsupportedTransferEncoding):
		// A coding other than chunked (gzip, or gzip then chunked):
		// answered as refuseAmbiguousFraming answers identity.
		writeError(ctx, fasthttp.StatusBadRequest, "the request's Transfer-Encoding is not chunked: send its body with Content-Length or chunked", "invalid_request_error", "", "unsupported_transfer_encoding")
		s.closeLingering(ctx)
		reason = "unsupported transfer-encoding"
	case errors.As(err, &small) || errors.Is(err, fasthttp.ErrSmallReadBuffer):
		writeError(ctx, fasthttp.StatusRequestHeaderFieldsTooLarge, fmt.Sprintf("request headers exceed the limit of %d bytes", s.limits.MaxHeaderBytes), "invalid_request_error", "", "headers_too_large")
		s.closeLingering(ctx) // a client still sending gets the answer, not a reset
		reason = "headers too large"
	case errors.As(err, &ne) && ne.Timeout() && s.declaredOverLimit(ctx):
		return
	case errors.As(err, &ne) && ne.Timeout():
		writeError(ctx, fasthttp.StatusRequestTimeout, "the request was not received in time", "invalid_request_error", "", "request_timeout")
		reason = "request not received in time"
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE):
		// The client left before its request was whole: no answer reaches
		// it, and it is no malformed request (counted as 400s, a client
		// aborting its uploads looked like one sending garbage).
		ctx.SetStatusCode(499)
		reason = "client closed before its request was whole"
	default:
		writeError(ctx, fasthttp.StatusBadRequest, "malformed HTTP request", "invalid_request_error", "", "bad_request")
		s.closeLingering(ctx)
	}
	limitKey := reason
	if tc, ok := ctx.Conn().(*tls.Conn); ok && !tc.ConnectionState().HandshakeComplete {
		// No request was read, so the error quotes none: a client that
		// refused kvproxy's certificate, spoke plain HTTP or went silent.
		// The error names the client's port: the limiter keys on the kind
		// (each connection had a key of its own, and filled the table).
		limitKey = "TLS handshake failed"
		reason = limitKey + ": " + err.Error()
	}
	s.logTransport(ctx, reason, limitKey)
}

// logTransport writes the access-log line of a request refused before the
// handler, bounded per limitKey as rejections are. fasthttp calls its
// handlers before it has a whole request: no method, path or start time to
// log (its defaults would say GET / and 292 years). The id is the client's
// when its headers were read (a body too large).
func (s *Server) logTransport(ctx *fasthttp.RequestCtx, reason, limitKey string) {
	rid, _ := s.requestIDs(ctx)
	s.metrics.countRequest("", ctx.Response.StatusCode())
	if !s.rejectLog.allow("", limitKey, ctx.Response.StatusCode() >= 500) {
		return
	}
	s.rejectEvent(ctx.Response.StatusCode()).Str("request_id", rid).Str("remote", s.st.Load().clientIP(ctx).String()).Int("status", ctx.Response.StatusCode()).
		Str("error", reason).Msg("request")
}

// declaredOverLimit answers a request whose body, declared over its limit,
// never began, as refused for its size, and reports whether it did. A note
// older than the wait is a dead connection's (no handler ran, nor this).
func (s *Server) declaredOverLimit(ctx *fasthttp.RequestCtx) bool {
	note, ok := s.overLimit.take(&ctx.Request.Header)
	if !ok {
		return false
	}
	note.header.CopyTo(&ctx.Request.Header)
	s.refuseLargeBody(ctx, s.st.Load(), note.known)
	return true
}

// declaredBodyWait is how long a body declared over its limit has for its
// first byte before it is refused for its size.
const declaredBodyWait = 250 * time.Millisecond

// hasBody reports whether a request of Content-Length cl (fasthttp's: -1
// chunked, -2 none) has a body.
func hasBody(cl int) bool { return cl > 0 || cl == -1 }

// judged takes h's note, if any, and reports whether its key is known: as
// the note says when there is one, since fasthttp reads a noted request's
// body with the noted limits (one byte, declaredBodyWait), whatever a
// reload changed since (the review: a key added meanwhile let it read its
// body, which then timed out at 250 ms); else by the current keys.
func (s *Server) judged(st *state, h *fasthttp.RequestHeader) (known, noted bool) {
	note, noted := s.overLimit.take(h)
	if noted {
		return note.known, true
	}
	return st.auth.knows(h), false
}

// refuseDeclaredBody answers a request with a body (declared, or chunked),
// before any of it is read, when it is over its limit or the request has
// no key kvproxy knows: the 401 for the latter (its key is the answer),
// the 413 for the former. It reports false when the body is to be read.
func (s *Server) refuseDeclaredBody(ctx *fasthttp.RequestCtx) bool {
	st, h := s.st.Load(), &ctx.Request.Header
	known, noted := s.judged(st, h)
	if !noted && known && h.ContentLength() <= st.cfg.Limits.MaxRequestBodyBytes {
		return false
	}
	s.refuseLargeBody(ctx, st, known)
	return true
}

// refuseLargeBody answers a request refused for its body's size, its
// connection closed after the answer. The body is not kept: what comes of
// it is read and thrown away (finishBody).
func (s *Server) refuseLargeBody(ctx *fasthttp.RequestCtx, st *state, known bool) {
	reason := "invalid api key"
	if known {
		reason = "body too large"
		ctx.SetConnectionClose()
		s.cors(ctx, st)
		writeError(ctx, fasthttp.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds the limit of %d bytes", st.cfg.Limits.MaxRequestBodyBytes), "invalid_request_error", "", "request_too_large")
		if bytes.HasPrefix(ctx.Path(), messagesPath) {
			toAnthropicError(ctx)
		}
	} else {
		s.refuseStranger(ctx)
	}
	s.logTransport(ctx, reason, reason)
	if bytes.HasPrefix(ctx.Path(), messagesPath) {
		// As handle's defers give every other answer there (it runs before
		// them); logTransport has set X-Request-Id.
		ctx.Response.Header.SetBytesV("Request-Id", ctx.Response.Header.PeekBytes(hdrRequestID))
	}
}

// maxDrain bounds how much of an unread body is read and thrown away.
const maxDrain = 8 << 20

// drainBufs are finishBody's buffers.
var drainBufs = sync.Pool{New: func() any { return new([16 << 10]byte) }}

// finishBody reads what the handler left unread of the request's body
// (answered before it was needed: a 401, 413, 429 or 404), so the
// connection can carry the next request, and a client still writing its
// body gets the answer rather than "connection reset" from a socket closed
// on unread data. A body that goes on past maxDrain, or stalls (250 ms
// without a byte, 2 s in all), is not waited for: the connection closes
// after the answer, lingering (countedConn.lingerClose) for the rest to
// come. Memory is one pooled buffer, whatever the declared length.
func (s *Server) finishBody(ctx *fasthttp.RequestCtx) {
	if !ctx.Request.IsBodyStream() {
		return // read (rawBody), or none
	}
	r, c := ctx.RequestBodyStream(), ctx.Conn()
	buf := drainBufs.Get().(*[16 << 10]byte)
	defer drainBufs.Put(buf)
	end := time.Now().Add(2 * time.Second)
	for left := maxDrain; ; {
		if left <= 0 {
			s.closeLingering(ctx)
			break
		}
		// A client that stops sending is not waited for: one that
		// declared a body it never sends gets its answer at once.
		by := time.Now().Add(250 * time.Millisecond)
		if by.After(end) {
			by = end
		}
		if cl := ctx.Request.Header.ContentLength(); cl < 0 || cl > prefetchedBody {
			c.SetReadDeadline(by) // else it is all in, read with the headers
		}
		n, err := r.Read(buf[:min(len(buf), left)])
		left -= n
		if err == io.EOF {
			break
		}
		if err != nil {
			s.closeLingering(ctx)
			break
		}
	}
	ctx.Request.CloseBodyStream()
}

// closeLingering closes the connection after the answer, lingering for
// what the client still sends when the connection is plain TCP.
func (s *Server) closeLingering(ctx *fasthttp.RequestCtx) {
	ctx.SetConnectionClose()
	if cc := plainCountedOf(ctx.Conn()); cc != nil {
		// No longer than a body may take to come: an operator's shorter
		// body_timeout bounds what a client holds (the last review).
		cc.linger.Store(int64(min(lingerTime, s.st.Load().cfg.Limits.BodyTimeout)))
	}
}

// clientRequestID is the client's X-Request-Id when it is one a log can
// carry as it is (1–128 of A–Z a–z 0–9 - _ . :), so a request can be
// followed from the client through kvproxy to the engine; "" otherwise.
func clientRequestID(ctx *fasthttp.RequestCtx) string {
	id := ctx.Request.Header.PeekBytes(hdrRequestID)
	if len(id) == 0 || len(id) > 128 {
		return ""
	}
	for _, c := range id {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':') {
			return ""
		}
	}
	return string(id)
}

// newRequestID is req-<process prefix>-<sequence in base 36>, built in one
// allocation.
func (s *Server) newRequestID() string {
	var b [40]byte
	id := append(b[:0], "req-"...)
	id = append(id, s.reqPrefix...)
	id = append(id, '-')
	return string(strconv.AppendUint(id, s.reqSeq.Add(1), 36))
}

type fasthttpLogger struct{ l zerolog.Logger }

func (f fasthttpLogger) Printf(format string, args ...any) {
	f.l.Debug().Msgf(format, args...)
}

// scratch holds per-request buffers reused across requests. Nothing in it
// may be kept past the handler, which a streamed answer's exchange outlives.
type scratch struct {
	req    apiRequest
	tokens []uint32
	batch  []uint32 // a batch's other prompts, counted one by one
	hashes []kv.BlockHash
	route  router.Request
	cands  []router.Candidate // Request.CandidateBuf
	body   []byte             // the body sent to the engine
}

func (s *Server) getScratch() *scratch {
	if v := s.bufs.Get(); v != nil {
		return v.(*scratch)
	}
	return &scratch{}
}

// trim drops the buffers that grew past limit bytes: the tokens and
// hashes, the body sent to the engine, the request's text.
func (sc *scratch) trim(limit int) {
	if cap(sc.tokens)*4 > limit {
		sc.tokens = nil
	}
	if cap(sc.batch)*4 > limit {
		sc.batch = nil
	}
	if cap(sc.hashes)*8 > limit {
		sc.hashes = nil
	}
	if cap(sc.body) > limit {
		sc.body = nil
	}
	if cap(sc.req.text) > limit {
		sc.req.text = nil
	}
}

// keepCandidates keeps the candidate buffer a router grew for the next
// request.
func (sc *scratch) keepCandidates(c []router.Candidate) {
	if cap(c) > cap(sc.cands) {
		sc.cands = c[:0]
	}
}

func (s *Server) putScratch(sc *scratch) {
	sc.trim(1 << 20) // don't pin the memory of one huge request
	sc.req.reset()
	sc.route = router.Request{}
	sc.tokens, sc.hashes = sc.tokens[:0], sc.hashes[:0]
	s.bufs.Put(sc)
}

// cutUnresponsive ends the requests waiting on b's engine once its health
// probe starts failing (a frozen process, a lost node: its connections
// neither answer nor close): those it has sent nothing to since the probe
// began to fail get 504 (a stream, an error event and [DONE]) at once,
// where they waited for stream_idle_timeout (5 minutes by default). SDKs
// retry a 504, and the engine is out of selection meanwhile. Requests the
// engine still sends to are left alone: it is alive to them.
func (s *Server) cutUnresponsive(b *backend, why string) {
	h := b.healthCfg()
	// Since the first failing probe began: each took up to its timeout
	// (SGLang's with its wait), and the next began an interval after it,
	// or at once when it took longer.
	probe := h.Timeout + b.probeURL().Slow
	failingFor := time.Duration(max(h.Fall-1, 0))*max(h.Interval, probe) + probe
	since := time.Now().Add(-failingFor)
	msg := "backend " + b.cfg.ID + " sent nothing for this request while its health probe failed (" + why + ")"
	if n := s.live.cutSilent(b.cfg.ID, clockAt(since), msg); n > 0 {
		s.log.Warn().Str("backend", b.cfg.ID).Int("requests", n).Str("probe_error", why).
			Msg("ended the requests the backend stopped answering")
	}
}

// maxIdleWorkerDuration is how long fasthttp keeps an idle worker. Its
// pool's cleaner sleeps this long between sweeps and holds the server (and
// so everything the handler reaches) until it wakes, after Shutdown too:
// the tests shorten it, so that a server an earlier test shut down is let
// go before a heap measurement, not during it.
var maxIdleWorkerDuration = 5 * time.Second
