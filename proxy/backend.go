package proxy

import (
	"crypto/tls"
	"net"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/replicas"
	"github.com/kvproxy/kvproxy/router"
)

// backend is one engine as the proxy sees it: its connection pool and
// whether it may get new requests. It is available when its health probes
// pass, it is not ejected for recent failures, and it is not draining.
type backend struct {
	cfg        config.Backend
	pool       *modelPool
	worker     router.WorkerID
	up         *backends.Upstream
	host       string
	base       string // scheme://host[:port] as configured (the Host its /health and /metrics are asked with)
	authHeader string // the engine's own key, never the client's
	urlHash    string // replicas.URLHash of its URL, for the load reports
	salted     bool   // the engine honours cache_salt (vLLM, SGLang, the mock)
	health     config.Health
	log        zerolog.Logger

	mu        sync.Mutex
	probeOK   bool
	probeErr  string // why the probes failed, while they do
	ejections int    // consecutive passive failures
	// silentWhole counts the non-streamed requests in a row the engine
	// left unanswered for stream_idle_timeout (see wholeTimedOut).
	silentWhole int
	// errorAnswers counts the error answers in a row (errorAnswerLimit).
	errorAnswers int
	// tokenizeDown: until when (unix ns) its /tokenize is not asked, after
	// it failed (engineTokenizeBackoff).
	tokenizeDown atomic.Int64
	ejected      bool
	ejectKind    string    // what the ejections metric counted the ejection in force under
	ejectReason  string    // the failure that ejected it
	downSince    time.Time // when it last became unhealthy (down)
	// probeEnds: the ejection in force is for failed connections only, and
	// a passing health probe ends it (failConn); with probes running
	// (probed), only that does.
	probeEnds bool
	probed    bool // set before it takes requests
	draining  bool
	succeeded bool // draining, and a backend of its id serves in its place (another pool's)
	full      bool // at max_concurrency: healthy but takes nothing new
	cooling   bool // refused a request with 429: left out until coolTimer
	// replaced: a reload handed the router worker(s) to a new backend of
	// the same id; this one only finishes its requests and must not change
	// the workers' availability (its timers and last answers would).
	replaced    bool
	available   bool
	down        bool // not healthy, as last logged: forgetTimer runs
	ejectTimer  *time.Timer
	coolTimer   *time.Timer
	coolUntil   time.Time // when cooling ends
	forgetTimer *time.Timer
	slots       *slotCount // max_concurrency, shared with the backends it is rebuilt as
	// inflight counts the requests holding a slot, on any of the backend's
	// data-parallel ranks: a removed backend retires once it is 0.
	inflight atomic.Int64
	// retiring: a reload removed or replaced it, and its retirement may
	// have found it idle; it takes no more requests (route).
	retiring atomic.Bool
	// noDoneSaid: the engine was found to end its streams without
	// [DONE], and the log said so (once).
	noDoneSaid atomic.Bool
	// wholeAnswerSaid: the engine answered a streaming request with
	// JSON, and the log said so (once).
	wholeAnswerSaid atomic.Bool
	// keptSaid is when the log last said the backend was kept in despite
	// its error answers (answeredError), Unix ns: once a minute at most.
	keptSaid atomic.Int64
	// wake tells the requests queued for a full backend that this one
	// became available (its cooling or ejection ended, its probe passed).
	wake    func()
	metrics *metrics // counts its ejections; nil outside a Server

	// ranks are the data-parallel rank workers ("id#r") taken over from
	// the backend of its id it replaced or that still drains (adoptRanks),
	// set before it takes requests; its feed adds those it sees (workerIDs).
	ranks        []router.WorkerID
	feed         *backends.KVFeed // nil in approximate mode
	rankGroup    *atomic.Int32    // the peer group of the ranks feed adds, handed over with it
	eventsPushed atomic.Uint64
	scrape       atomic.Pointer[scrapeStatus]
	// adapters: the LoRA adapters the engine lists (kind vllm or mock,
	// polled); nil while unknown.
	adapters       atomic.Pointer[[]string]
	adaptersPolled time.Time // scrape loop only
	unlistedWarned bool      // the engine's list lacks served_model, and it was said (scrape loop only)
	// maxModelLen: the context length its /v1/models gives (polled with
	// the adapters); 0 while unknown.
	maxModelLen atomic.Int64
}

func newBackend(bc config.Backend, cfg *config.Config, p *modelPool, log zerolog.Logger) *backend {
	u, _ := url.Parse(bc.URL)
	addr := u.Host
	if u.Port() == "" {
		port := "80"
		if u.Scheme == "https" {
			port = "443"
		}
		addr = net.JoinHostPort(u.Hostname(), port)
	}
	b := &backend{
		cfg: bc, pool: p, host: u.Host, health: cfg.Health, log: log, base: u.Scheme + "://" + u.Host,
		salted:  bc.Kind == config.KindVLLM || bc.Kind == config.KindSGLang || bc.Kind == config.KindMock,
		probeOK: true, available: true,
		up: &backends.Upstream{
			Addr:        addr,
			DialTimeout: cfg.Limits.UpstreamConnectTime,
			ReadTimeout: cfg.Limits.StreamIdleTimeout,
			MaxIdle:     cfg.Limits.MaxConnsPerBackend,
		},
	}
	if u.Scheme == "https" {
		b.up.TLS = &tls.Config{ServerName: u.Hostname(), InsecureSkipVerify: bc.InsecureSkipVerify, MinVersion: tls.VersionTLS12}
	}
	if bc.APIKey != "" {
		b.authHeader = "Bearer " + bc.APIKey
	}
	b.urlHash = replicas.URLHash(bc.URL)
	b.slots = &slotCount{}
	b.slots.limit.Store(int64(bc.MaxConcurrency))
	b.slots.owner.Store(b)
	b.worker = p.rt.AddWorker(bc.ID)
	p.rt.SetPeerGroup(b.worker, peerGroup(bc.Role))
	b.rankGroup = new(atomic.Int32)
	b.rankGroup.Store(int32(peerGroup(bc.Role)))
	if old := p.backend(b.worker); old == nil || old.retiring.Load() {
		// A new worker of a running pool (a reload's), or one AddWorker
		// revived for an id a reload removed, takes no request before
		// activate sets its backend in the pool: one routed to it
		// meanwhile found none, and got 503 backend_removed (the scale
		// trial), or found the retired one and routed again, a core spun
		// on it (the review). A backend it replaces keeps its own until
		// handOver.
		p.rt.SetAvailable(b.worker, false)
	}
	return b
}

// peerGroup is the router's peer group of an engine of the role: prefill
// engines' fitted speeds are compared with each other's, the others' with
// each other's.
func peerGroup(role string) int {
	if role == config.RolePrefill {
		return 1
	}
	return 0
}

// isAvailable reports whether the backend takes new requests.
func (b *backend) isAvailable() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.available
}

// probeURL is what b's health probe asks: GET /health, as vLLM and SGLang
// serve it; for kind: openai, GET /v1/models with its api_key, which every
// OpenAI-compatible server has and many have no /health.
//
// SGLang's /health runs a one-token generation (unless started with
// SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false) and looks once a second
// whether its engine has produced anything, from a second after the probe
// came: a healthy engine answers after one second, or two when one of its
// steps (a long prefill chunk) outlasts the first. Its probe gets those two
// on top of health.timeout: with vLLM's 1 s every SGLang engine was down.
func (b *backend) probeURL() backends.ProbeURL {
	u := backends.ProbeURL{URL: b.base + "/health", Insecure: b.cfg.InsecureSkipVerify}
	switch b.cfg.Kind {
	case config.KindOpenAI:
		u.URL, u.APIKey = b.base+"/v1/models", b.cfg.APIKey
	case config.KindSGLang:
		u.Slow = sglangHealthWait
	}
	return u
}

// sglangHealthWait is how long SGLang's /health may take when its engine
// is well (see probeURL).
const sglangHealthWait = 2 * time.Second

// setProbe records an active health probe result (why: what failed).
// It reports whether the probe started failing with this result.
func (b *backend) setProbe(ok bool, why string) (failing bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if ok && b.probeOK && !b.ejected {
		return false
	}
	if !ok && b.probeOK && !b.ejected && !b.draining && !b.replaced { // one outage, one ejection counted
		b.metrics.countEjection(b.cfg.ID, ejectProbe)
	}
	failing = !ok && b.probeOK
	b.probeOK, b.probeErr = ok, why
	if ok && b.ejected && b.ejectTimer != nil && b.probeEnds {
		b.ejectTimer.Stop()
		b.ejectTimer = nil
		b.log.Info().Str("backend", b.cfg.ID).Msg("ejection ended: the health probe passes again")
	}
	if ok && b.ejected && b.ejectTimer == nil {
		b.ejected = false
	}
	b.applyLocked()
	return failing
}

// setHealth applies a reload's health settings (ejection back-off,
// forget_after) in place: they change no connection, and rebuilding every
// backend for them logged each as replaced.
func (b *backend) setHealth(h config.Health) {
	b.mu.Lock()
	b.health = h
	b.mu.Unlock()
}

// healthCfg is b's health settings.
func (b *backend) healthCfg() config.Health {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.health
}

// inheritProbe starts b, which replaces was for the same engine (same id
// and probe), with was's probe verdict, before the prober says it again: a
// reload must not revive a dead engine, nor count its ejection anew.
func (b *backend) inheritProbe(was *backend) {
	was.mu.Lock()
	ok, why := was.probeOK, was.probeErr
	was.mu.Unlock()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.probeOK, b.probeErr = ok, why
	b.applyLocked()
}

// fail ejects the backend after a passive failure (connect refused, 5xx,
// died mid-stream) for a back-off that doubles with each consecutive
// failure. Failures while an ejection is in force are the same incident:
// an engine that dies fails every request it had at once, and doubling
// for each would keep it out for eject_max after it is back. kind is what
// the ejections metric counts it under (ejectStatus, ejectTimeout, ...).
func (b *backend) fail(kind, reason string) { b.eject(kind, reason, false) }

// The reasons the ejections metric counts an ejection under.
const (
	ejectConnect      = "connect"       // refused, reset, cut off, TLS
	ejectStatus       = "status"        // a 5xx, a 503
	ejectTimeout      = "timeout"       // silent
	ejectErrorAnswers = "error_answers" // 500s or credential refusals in a row
	ejectProbe        = "probe"         // its health probe started failing
)

// failConn is fail for a connection that failed (refused, reset, a failed
// TLS handshake, an answer cut off): the engine was unreachable or died,
// so a health probe that passes again shows it back and ends the ejection
// at once. An engine restarting takes tens of seconds, long enough for the
// back-off to double to eject_max, which would keep it out that long after
// it is up.
func (b *backend) failConn(reason string) { b.eject(ejectConnect, reason, true) }

// cutOff is failConn for a connection that failed after the engine took
// the request (reset, an answer cut off, a stream ended without its end),
// within ejectForAnswer's bound: a gateway before the engines that cuts
// long answers, or requests that make an engine drop them, would
// otherwise let one client take a model down for everyone (the SDK
// trial: one stream cut took a model's only engine out for 2 s, its probe
// passing). An engine that died refuses the next connection, or fails its
// probe, and goes then.
func (b *backend) cutOff(reason string) { b.ejectUnlessMost(ejectConnect, reason, true) }

// failDial is failConn for a connection that could not be opened, unless
// kvproxy itself was out of file descriptors (backends.OutOfFiles), which
// is no fault of the engine's: ejecting engines for it took a whole fleet
// out (the scale trial).
func (b *backend) failDial(ce *backends.ConnectError) {
	if !backends.OutOfFiles(ce) {
		b.failConn("connect: " + ce.Err.Error())
	}
}

func (b *backend) eject(kind, reason string, conn bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.draining || b.replaced {
		// A reload took it out already: its last requests failing are
		// not an outage to count or warn of (its successor has its own).
		b.log.Debug().Str("backend", b.cfg.ID).Str("reason", reason).Msg("a draining backend failed")
		return
	}
	if b.ejected && b.ejectTimer != nil {
		b.probeEnds = b.probeEnds && conn
		b.log.Debug().Str("backend", b.cfg.ID).Str("reason", reason).Msg("backend failed while ejected")
		return
	}
	b.probeEnds = conn
	b.ejections++
	d := b.health.EjectBase << min(b.ejections-1, 16)
	if d > b.health.EjectMax || d <= 0 {
		d = b.health.EjectMax
	}
	b.ejected, b.ejectKind, b.ejectReason = true, kind, reason
	b.metrics.countEjection(b.cfg.ID, kind)
	b.armLocked(&b.ejectTimer, d, func() {
		// An engine whose connections failed is back when its probe says
		// so, not when the time is up: it may still be down (found by the
		// ninth session's operator trial: each crash cost a refused retry
		// and a second ejection before the probes noticed).
		if !b.probeEnds || !b.probed {
			b.ejected = false
		}
	})
	ev := b.log.Warn().Str("backend", b.cfg.ID).Str("reason", reason).Dur("ejected_for", d)
	if b.probeEnds && b.probed {
		ev = ev.Bool("until_probe_passes", true) // a failed connection: ejected_for is the least
	}
	ev.Msg("backend ejected")
	b.applyLocked()
}

// succeed resets the failure streaks after an answer that shows the
// engine up: a good one, or a client error (the request's fault).
func (b *backend) succeed() {
	b.mu.Lock()
	b.ejections, b.silentWhole, b.errorAnswers = 0, 0, 0
	b.mu.Unlock()
}

// silentWholeLimit is how many non-streamed requests in a row may go
// unanswered for stream_idle_timeout before the engine is ejected.
const silentWholeLimit = 3

// errorAnswerLimit is how many error answers in a row (500, or a refusal
// of kvproxy's credentials) eject the engine. One may be the request's
// own doing (vLLM answers 500 to some inputs it fails on), and ejecting on
// it would let a client's retried bad request take engine after engine
// out; a broken engine fails every request.
const errorAnswerLimit = 3

// answeredError records an error answer that is the engine's fault or the
// request's, as errorAnswerLimit describes; the streak's last ejects the
// engine as ejectForAnswer does.
func (b *backend) answeredError(reason string) {
	if b.strike(&b.errorAnswers, errorAnswerLimit) {
		b.ejectForAnswer(ejectErrorAnswers, reason+", "+strconv.Itoa(errorAnswerLimit)+" answers in a row")
	}
}

// ejectForAnswer ejects the backend for an answer it gave (a 500 streak, a
// 502, 503 or 504), unless that would take out more than half of the
// model's backends that answer clients (any of a model's only one;
// prefill engines are not counted, nor held back): a client whose requests
// make engines fail, or outlast a gateway's timeout in front of them,
// could otherwise take every engine of a model out for everyone (the
// security review: three requests a second kept a model at 503), and
// engines that all fail tell the clients more with their own answers than
// kvproxy's 503 would. An engine that is down fails its health probe too,
// which takes it out whatever the others do.
func (b *backend) ejectForAnswer(kind, reason string) { b.ejectUnlessMost(kind, reason, false) }

// ejectUnlessMost is ejectForAnswer's bound for eject(kind, reason, conn).
func (b *backend) ejectUnlessMost(kind, reason string, conn bool) {
	if b.prefillOnly() {
		// Without it the decode engines compute the prompts: its
		// ejection costs no client an answer.
		b.eject(kind, reason, conn)
		return
	}
	p := b.pool
	p.coolMu.Lock() // one backend at a time, as coolDown
	defer p.coolMu.Unlock()
	if total, down := p.health(b); 2*(down+1) > total {
		if now := time.Now().UnixNano(); now-b.keptSaid.Load() > int64(time.Minute) {
			b.keptSaid.Store(now)
			msg := "backend answers with errors, and is kept in: ejecting it would take out more than half of the model's backends"
			if conn {
				msg = "backend dropped a request it took, and is kept in: ejecting it would take out more than half of the model's backends"
			}
			b.log.Warn().Str("backend", b.cfg.ID).Str("reason", reason).Int("backends", total).Int("down", down).Msg(msg)
		}
		return
	}
	b.eject(kind, reason, conn)
}

// health counts the pool's backends that answer clients (prefill engines
// do not), and those down (ejected, or failing their probes), leaving out b.
func (p *modelPool) health(b *backend) (total, down int) {
	seen := map[*backend]bool{}
	for _, w := range *p.workers.Load() {
		if w == nil || seen[w] {
			continue // a data-parallel engine's ranks are one backend
		}
		seen[w] = true
		if w.isDraining() || w.prefillOnly() {
			continue // a prefill engine answers no client
		}
		total++
		if w == b {
			continue
		}
		w.mu.Lock()
		if !w.healthyLocked() {
			down++
		}
		w.mu.Unlock()
	}
	return total, down
}

// wholeTimedOut records a non-streamed request the engine sent nothing for
// within stream_idle_timeout. A whole answer comes only when it is done, so
// one may just be long; silentWholeLimit in a row, with no good answer in
// between, is an engine that takes requests and never finishes them (its
// health probe may still pass), and ejects it.
func (b *backend) wholeTimedOut(reason string) {
	if b.strike(&b.silentWhole, silentWholeLimit) {
		b.fail(ejectTimeout, reason+", "+strconv.Itoa(silentWholeLimit)+" non-streamed requests in a row")
	}
}

// strike counts one failure of a streak (a field of b, guarded by b.mu)
// and reports whether it reached limit, starting it again; succeed ends
// streaks.
func (b *backend) strike(streak *int, limit int) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	*streak++
	if *streak < limit {
		return false
	}
	*streak = 0
	return true
}

// drain stops new requests to the backend (it is being removed).
func (b *backend) drain(succeeded bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.draining, b.succeeded = true, succeeded
	b.applyLocked()
}

// coolDown leaves the backend out of selection for d (its Retry-After)
// after it refused a request with 429, as clients are asked to: the next
// requests go to the other engines instead of paying a refused round trip
// first. The model's last available backend is never cooled: its refusals
// reach the clients, with the engine's Retry-After.
func (b *backend) coolDown(d time.Duration) {
	b.pool.coolMu.Lock()
	defer b.pool.coolMu.Unlock()
	b.mu.Lock()
	replaced := b.replaced
	b.mu.Unlock()
	if replaced {
		return
	}
	others := false
	for _, w := range b.pool.rt.Workers() {
		if w.Available && !b.owns(w.Name) {
			others = true
			break
		}
	}
	if !others {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.coolLocked(d)
	b.log.Info().Str("backend", b.cfg.ID).Dur("cooling_for", d).Msg("backend refused with 429: cooling down")
	b.applyLocked()
}

// coolLocked (re)arms the cooling for d. b.mu is held.
func (b *backend) coolLocked(d time.Duration) {
	b.cooling = true
	b.coolUntil = time.Now().Add(d)
	b.armLocked(&b.coolTimer, d, func() { b.cooling = false })
}

// armLocked (re)arms *slot to run end, then applyLocked, under b.mu after d.
// A timer that fires while being replaced or stopped (it waits for b.mu)
// does nothing: only the current one acts. b.mu is held.
func (b *backend) armLocked(slot **time.Timer, d time.Duration, end func()) {
	if *slot != nil {
		(*slot).Stop()
	}
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		if *slot != t {
			return
		}
		*slot = nil
		end()
		b.applyLocked()
	})
	*slot = t
}

// endCooling ends the cool-down of the pool's backends when no other
// backend is healthy (the others were ejected or went down after these
// cooled): the engines that only refused with 429 take requests again and
// their refusals reach the clients. Busy (full) healthy backends keep the
// cooling on: requests wait for them. It reports whether a backend became
// available.
func (p *modelPool) endCooling() bool {
	p.coolMu.Lock()
	defer p.coolMu.Unlock()
	ws := *p.workers.Load()
	for _, b := range ws {
		if b == nil {
			continue
		}
		b.mu.Lock()
		other := b.healthyLocked() && !b.cooling
		b.mu.Unlock()
		if other {
			return false
		}
	}
	back := false
	for _, b := range ws {
		if b == nil {
			continue
		}
		b.mu.Lock()
		if b.cooling {
			b.cooling = false
			if b.coolTimer != nil {
				b.coolTimer.Stop()
				b.coolTimer = nil
			}
			b.applyLocked()
			back = back || b.available
		}
		b.mu.Unlock()
	}
	return back
}

// admitRank reports whether the backend takes new requests, for its
// data-parallel rank worker w, and leaves w out of selection when it does
// not: the KV feed registers a rank at its first event as available,
// whatever the state of its backend (full, cooling, ejected).
// applyLocked makes it available again with the rest of the backend.
func (b *backend) admitRank(w router.WorkerID) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.available {
		b.pool.rt.SetAvailable(w, false)
	}
	return b.available
}

// coolingLeft is how long the backend still cools down after a 429; 0
// when it does not (or is also down).
func (b *backend) coolingLeft() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.cooling || !b.healthyLocked() {
		return 0
	}
	return max(time.Until(b.coolUntil), time.Millisecond)
}

// healthy reports whether the backend is up (full or cooling down included).
func (b *backend) healthy() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.healthyLocked()
}

// downJSON says why a backend is unhealthy, for /admin/backends.
type downJSON struct {
	// EjectedBy: the ejection's reason as kvproxy_backend_ejections_total
	// counts it (connect, status, timeout, error_answers, probe).
	EjectedBy  string `json:"ejected_by"`
	Reason     string `json:"reason,omitempty"`      // the failure that ejected it
	ProbeError string `json:"probe_error,omitempty"` // why its health probe fails, while it does
	Since      string `json:"since,omitempty"`       // when it went down, UTC
}

// whyDown is why the backend is unhealthy (nil while it is healthy).
func (b *backend) whyDown() *downJSON {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.healthyLocked() {
		return nil
	}
	d := &downJSON{}
	if !b.downSince.IsZero() {
		d.Since = b.downSince.UTC().Format("2006-01-02T15:04:05.000Z07:00")
	}
	if !b.probeOK {
		d.EjectedBy, d.ProbeError = ejectProbe, b.probeErr
	}
	if b.ejected {
		d.EjectedBy, d.Reason = b.ejectKind, b.ejectReason
	}
	return d
}

// owns reports whether the router worker named name is this backend (or
// one of its data-parallel ranks, "id#r").
func (b *backend) owns(name string) bool {
	id := b.cfg.ID
	return name == id || len(name) > len(id) && name[:len(id)] == id && name[len(id)] == '#'
}

// coolingFor is how long a 429 with this Retry-After (seconds) keeps the
// backend out: 1 s by default, at most 30 s.
func coolingFor(retryAfter []byte) time.Duration {
	secs, err := strconv.Atoi(string(retryAfter))
	if err != nil || secs < 1 {
		secs = 1
	}
	return time.Duration(min(secs, 30)) * time.Second
}

func (b *backend) healthyLocked() bool { return b.probeOK && !b.ejected && !b.draining }

// engineHealthy reports whether b's engine is healthy, b draining or not.
func (b *backend) engineHealthy() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.probeOK && !b.ejected
}

// applyLocked brings the router workers' availability in line with the
// backend's state, and logs and times (forget_after) the backend's going
// down and coming back. Health is followed on its own: a backend may go
// down while it was already left out (full, or cooling down after a 429).
func (b *backend) applyLocked() {
	healthy := b.healthyLocked()
	avail := healthy && !b.full && !b.cooling
	if avail != b.available {
		b.available = avail
		if b.replaced {
			return // the workers are its successor's now
		}
		for _, w := range b.workerIDs() {
			b.pool.rt.SetAvailable(w, avail)
		}
		if avail && b.wake != nil {
			b.wake()
		}
	}
	if healthy != b.down || b.replaced {
		return // no change of health (down is its negation)
	}
	b.down = !healthy
	if !healthy {
		b.downSince = time.Now()
		if b.full && b.wake != nil {
			// Requests may be queued for its slots: they route again, to
			// wait on for another full backend or be told at once that
			// none is healthy (they waited out queue_timeout, an outage
			// answered as saturation).
			b.pool.queue.wakeAll()
		}
	}
	if healthy {
		b.log.Info().Str("backend", b.cfg.ID).Msg("backend available")
		if b.forgetTimer != nil {
			b.forgetTimer.Stop()
			b.forgetTimer = nil
		}
		return
	}
	if b.draining && b.probeOK && !b.ejected {
		// A reload's doing, not an outage.
		if b.succeeded {
			// A backend of its id is in another pool: its model's, rebuilt
			// (block size, tokenizer, template), or another model's.
			b.log.Info().Str("backend", b.cfg.ID).Msg("backend draining (replaced by reload: a backend of its id takes the new requests)")
		} else {
			b.log.Info().Str("backend", b.cfg.ID).Msg("backend draining (removed by reload)")
		}
		return
	}
	// A failing probe takes it out as an ejection does, and the ejections
	// metric counts it so (reason probe): the line says so too (it said
	// "ejected":false while the metric counted one).
	ev := b.log.Warn().Str("backend", b.cfg.ID).Bool("probe_ok", b.probeOK).Bool("ejected", b.ejected || !b.probeOK)
	switch {
	case b.ejected:
		ev = ev.Str("ejected_by", b.ejectKind)
	case !b.probeOK:
		ev = ev.Str("ejected_by", ejectProbe)
	}
	ev = ev.Bool("draining", b.draining)
	if !b.probeOK && b.probeErr != "" {
		ev = ev.Str("probe_error", b.probeErr)
	}
	ev.Msg("backend unavailable")
	if b.forgetTimer == nil && b.health.ForgetAfter > 0 && !b.draining {
		// A backend that stays away loses its index entries: whatever it
		// cached is unlikely to be there when it comes back.
		b.forgetTimer = time.AfterFunc(b.health.ForgetAfter, func() {
			b.mu.Lock()
			defer b.mu.Unlock()
			b.forgetTimer = nil
			if b.down && !b.replaced {
				if b.feed != nil {
					b.feed.Clear() // the index entries, the feed's own record of them and its pushes' group choice
				} else {
					b.pool.rt.Index().ClearWorker(b.worker)
				}
				b.log.Warn().Str("backend", b.cfg.ID).Msg("backend gone too long: index entries dropped")
			}
		})
	}
}

// handOver marks b as replaced by next, a new backend of the same id that
// a reload gave b's router workers to, and sets the workers' availability
// from next again, undoing whatever b did to them since next was built.
func (b *backend) handOver(next *backend) {
	b.mu.Lock()
	b.replaced = true
	b.mu.Unlock()
	next.mu.Lock()
	for _, w := range next.workerIDs() {
		next.pool.rt.SetAvailable(w, next.available)
	}
	next.mu.Unlock()
}

// stop releases timers and connections of a removed backend.
func (b *backend) stop() {
	b.mu.Lock()
	if b.ejectTimer != nil {
		b.ejectTimer.Stop()
	}
	if b.coolTimer != nil {
		b.coolTimer.Stop()
	}
	if b.forgetTimer != nil {
		b.forgetTimer.Stop()
	}
	b.mu.Unlock()
	b.up.Close()
}

// slotCount counts the requests an engine runs against the backend's
// max_concurrency. A backend a reload builds for the same id and URL takes
// over the count (Server.shareSlots), so the requests its predecessor
// still runs hold slots of the new limit: each rebuilt backend used to
// start with every slot free, and an engine got up to twice its
// max_concurrency around a reload, or three times a lowered one (found by
// the thirteenth session's review).
type slotCount struct {
	held  atomic.Int64
	limit atomic.Int64            // 0: no limit
	owner atomic.Pointer[backend] // the newest backend counting here: whose full flag a release updates
}

func (c *slotCount) full() bool {
	lim := c.limit.Load()
	return lim > 0 && c.held.Load() >= lim
}

// acquire takes one of the backend's max_concurrency slots; false when all
// are taken. The backend leaves selection while it is full.
func (b *backend) acquire() bool {
	c := b.slots
	for {
		held := c.held.Load()
		if lim := c.limit.Load(); lim > 0 && held >= lim {
			b.markFull() // whatever a racing release concluded, the slots are all taken
			return false
		}
		if c.held.CompareAndSwap(held, held+1) {
			break
		}
	}
	b.inflight.Add(1)
	if c.full() {
		b.markFull()
	}
	return true
}

// release returns a slot taken by acquire: to the backend the engine's
// requests now count on, when a reload has rebuilt b.
func (b *backend) release() {
	b.inflight.Add(-1)
	b.slots.held.Add(-1)
	b.slots.owner.Load().markFull()
}

// markFull sets full from the slots taken now. acquire and release call it
// after changing the slots, so the last call under the lock sees the last
// change: a release that freed a slot another request took again before it
// got the lock leaves the backend full, not selectable with every slot
// held (which made requests re-route in a loop instead of queueing; found
// by the eighth session's review).
func (b *backend) markFull() {
	b.mu.Lock()
	if full := b.slots.full(); full != b.full {
		b.full = full
		b.applyLocked()
	}
	b.mu.Unlock()
}

// fullFor reports whether a request may wait for a slot: its pinned
// backend is full, or, unpinned, any backend of the pool is.
func (p *modelPool) fullFor(rr *router.Request) bool {
	if !rr.Pinned {
		return p.anyFull()
	}
	b := p.backend(rr.Pin)
	if b == nil {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.full && b.healthyLocked()
}

// isDraining reports whether a reload removed the backend.
func (b *backend) isDraining() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.draining
}

// anyFull reports whether the pool has a healthy backend that is
// only full, so a request may wait for it (not a prefill engine: no
// request waits for one).
func (p *modelPool) anyFull() bool {
	for _, b := range *p.workers.Load() {
		if b == nil || b.prefillOnly() {
			continue
		}
		b.mu.Lock()
		full := b.full && b.healthyLocked()
		b.mu.Unlock()
		if full {
			return true
		}
	}
	return false
}

// anyAvailable reports whether the pool has a backend that takes requests
// now (healthy, below max_concurrency, not cooling down). Prefill engines
// do not count: no waiter routes to them (a free one had every freed slot
// wake the whole queue in turn: the review).
func (p *modelPool) anyAvailable() bool {
	for _, b := range *p.workers.Load() {
		if b == nil || b.prefillOnly() {
			continue
		}
		b.mu.Lock()
		avail := b.available
		b.mu.Unlock()
		if avail {
			return true
		}
	}
	return false
}
