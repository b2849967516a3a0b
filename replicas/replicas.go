package replicas

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/router"
)

// Config says where and how often the replicas meet.
type Config struct {
	URL      string        // NATS server(s), comma-separated: nats://host:4222
	Subject  string        // the subject every replica of one fleet shares
	ID       string        // this replica's name, unique in the fleet
	Interval time.Duration // how often each replica reports
	// CredsFile is a NATS user credentials file ("": none).
	CredsFile string
	// CAFile verifies the server by a private CA; CertFile and KeyFile are
	// a client certificate. Any of them turns TLS on.
	CAFile, CertFile, KeyFile string
}

// authOptions are the NATS options for cfg's credentials and TLS.
func (cfg Config) authOptions() []nats.Option {
	var opts []nats.Option
	if cfg.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(cfg.CredsFile))
	}
	if cfg.CAFile != "" {
		opts = append(opts, nats.RootCAs(cfg.CAFile))
	}
	if cfg.CertFile != "" {
		opts = append(opts, nats.ClientCert(cfg.CertFile, cfg.KeyFile))
	}
	return opts
}

// Default is the configuration for a NATS server at url.
func Default(url string) Config {
	host, _ := os.Hostname()
	return Config{URL: url, Subject: "kvproxy.load", ID: fmt.Sprintf("%s-%d", host, os.Getpid()), Interval: 100 * time.Millisecond}
}

// Key names a worker of a model.
type Key struct{ Model, Worker string }

// Entry is one worker's load as one replica counts it.
type Entry struct {
	Model  string `json:"model"`
	Worker string `json:"worker"`
	// URLHash is URLHash of the worker's URL: a replica naming another
	// engine with the same id must not add that engine's load to this one.
	// Empty from older versions, whose reports are taken unchecked.
	URLHash string `json:"url_hash,omitempty"`
	router.Load
}

// URLHash is a short hash of a backend URL, enough to tell two engines
// apart without putting their addresses (or credentials) on the subject.
func URLHash(u string) string {
	if p, err := url.Parse(strings.TrimSpace(u)); err == nil && p.Host != "" {
		u = strings.ToLower(p.Scheme+"://"+p.Host) + strings.TrimRight(p.Path, "/")
	}
	h := sha256.Sum256([]byte(u))
	return hex.EncodeToString(h[:6])
}

// report is what a replica publishes every interval.
type report struct {
	Replica string `json:"replica"`
	// Instance is random per Sync: it tells this replica's reports from
	// those of another that shares its id (copied config; two containers
	// of one host name, both pid 1).
	Instance   string  `json:"instance,omitempty"`
	IntervalMs int64   `json:"interval_ms,omitempty"` // the publisher's interval; expiry waits three of them
	Loads      []Entry `json:"loads"`
	// Leaving is a replica's last report, sent as it closes: the others
	// drop it at once rather than at its expiry (a restart under the same
	// id is then not counted twice). Older versions read it as a report
	// of no load.
	Leaving bool `json:"leaving,omitempty"`
}

type peer struct {
	id       string // its replicas.id, as the log names it
	instance string
	loads    []Entry
	seen     time.Time
	interval time.Duration // between its reports
	ttl      time.Duration
}

// maxPeerInterval bounds the interval a peer claims, so that one claiming
// hours does not linger that long once gone.
const maxPeerInterval = 20 * time.Second

// maxMismatches bounds the (replica, backend) pairs whose mismatch was
// logged, as maxPeers does the replicas.
const maxMismatches = 1024

// maxPeers bounds the replicas one keeps reports of: a publisher inventing
// ids cannot grow the memory without end.
const maxPeers = 256

// Sync publishes this replica's load and gathers the others'.
type Sync struct {
	cfg      Config
	period   time.Duration // between reports: the interval, rounded to the loop's ticks
	instance string
	local    func() []Entry
	apply    func(map[Key]router.Load)
	log      zerolog.Logger
	nc       *nats.Conn
	sub      *nats.Subscription

	mu      sync.Mutex
	peers   map[string]*peer // the other replicas' last reports, by id and instance
	warnDup bool             // another replica's use of this id was logged
	warnMax bool             // maxPeers reached was logged
	warnBad bool             // a malformed report was logged
	pubErr  string           // the publish error last logged, "" once one succeeds
	// mine is this replica's workers and their URL hashes, as local last
	// gave them: a peer's report on another worker is not applied.
	mine       map[Key]string
	mineAt     time.Time           // when mine was read
	mismatched map[string]bool     // the (replica, backend) mismatches logged
	sent       map[Key]router.Load // the load last published, where above zero
	sentAt     time.Time           // when
	watching   atomic.Bool         // the loop watches for ended load (tests)
	// up: connected to NATS, as its handlers said. Read by /metrics:
	// nats.go's IsConnected waits for its lock, which a reconnection to a
	// hung server holds for its 2 s dial (the replicas trial's scrapes).
	up atomic.Bool

	stop chan struct{}
	done chan struct{}
	// closing: Close is leaving NATS, which is no outage to warn of;
	// closed ends when nats.go has run its last handler.
	closing atomic.Bool
	closed  chan struct{}
	whyDone chan struct{} // sayWhyDown has ended
}

// Start connects to NATS (retrying in the background when it is not up
// yet) and starts reporting: local is called every interval for this
// replica's load, apply with the other replicas' load summed per worker
// whenever it changes (workers missing from the map carry none).
func Start(cfg Config, local func() []Entry, apply func(map[Key]router.Load), log zerolog.Logger) (*Sync, error) {
	d := Default(cfg.URL)
	if cfg.Subject == "" {
		cfg.Subject = d.Subject
	}
	if cfg.ID == "" {
		cfg.ID = d.ID
	}
	if cfg.Interval <= 0 {
		cfg.Interval = d.Interval
	}
	if cfg.URL == "" {
		return nil, errors.New("replicas: no NATS URL")
	}
	var nonce [8]byte
	rand.Read(nonce[:])
	tick, perReport := reportTicks(cfg.Interval)
	s := &Sync{cfg: cfg, period: time.Duration(perReport) * tick, instance: hex.EncodeToString(nonce[:]), local: local, apply: apply, log: log, peers: map[string]*peer{},
		mine: workersOf(local()), mineAt: time.Now(), mismatched: map[string]bool{},
		stop: make(chan struct{}), done: make(chan struct{}), closed: make(chan struct{}), whyDone: make(chan struct{})}
	up := &s.up // each transition is logged once
	connected := func(c *nats.Conn) {
		if !up.Swap(true) {
			log.Info().Str("server", c.ConnectedUrlRedacted()).Str("subject", cfg.Subject).Str("id", cfg.ID).Msg("replicas: connected to NATS")
		}
	}
	firstErr := make(chan error, 1) // why the first connection failed
	var (                           // the error last logged, and when
		asyncMu  sync.Mutex
		asyncMsg string
		asyncAt  time.Time
	)
	sayRefused := func(err error) {
		log.Error().Err(err).Str("nats", redactURLs(cfg.URL)).
			Msg("replicas: NATS refuses this replica (its user and password, token or credentials); routing on this replica's load, retrying every 500ms (said once a minute while it lasts)")
	}
	sayAgain := func(err error) bool { // once a minute while the same error repeats
		asyncMu.Lock()
		defer asyncMu.Unlock()
		now, msg := time.Now(), err.Error()
		if msg == asyncMsg && now.Sub(asyncAt) < time.Minute {
			return false
		}
		asyncMsg, asyncAt = msg, now
		return true
	}
	nc, err := nats.Connect(cfg.URL, append(cfg.authOptions(),
		nats.Name("kvproxy "+cfg.ID),
		nats.NoEcho(), // this replica's own reports are not delivered back to it
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		// An authorization refused twice (a password changed for a
		// moment, credentials that expired and are renewed in place)
		// does not end the retries: nats.go gave up, and sharing stayed
		// off until a restart (the trial).
		nats.IgnoreAuthErrorAbort(),
		nats.ReconnectWait(500*time.Millisecond),
		// A server that hangs (stopped, its host gone) without closing the
		// connection is noticed within seconds, not nats.go's 2 minutes × 2.
		nats.PingInterval(pingInterval),
		nats.MaxPingsOutstanding(maxPingsOut),
		// No reports are kept while disconnected: they would reach the
		// others stale, megabytes at once, when the server is back.
		nats.ReconnectBufSize(-1),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if up.Swap(false) && !s.closing.Load() {
				log.Warn().Err(err).Msg("replicas: disconnected from NATS; routing on this replica's load until it is back")
			}
		}),
		nats.ConnectHandler(connected), // a first connection made while retrying
		nats.ReconnectHandler(connected),
		nats.ClosedHandler(func(c *nats.Conn) {
			up.Store(false)
			if !s.closing.Load() { // nats.go gave up (it retries for ever: should not happen)
				log.Error().Err(c.LastError()).Str("nats", redactURLs(cfg.URL)).Msg("replicas: NATS closed the connection for good; this replica routes on its own load until restarted")
			}
			close(s.closed)
		}),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) {
			select { // then again every retry: only the first is kept
			case firstErr <- err:
			default:
			}
			if refused(err) && sayAgain(err) {
				sayRefused(err)
			}
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			// Once a minute while the same error repeats: a publish the
			// server's permissions deny comes back at every report (the
			// review: 29 lines in 3 s).
			switch {
			case !sayAgain(err):
			case refused(err): // a reconnection refused, as nats.go tells of it
				sayRefused(err)
			default:
				log.Warn().Err(err).Msg("replicas: NATS error (said once a minute while it repeats)")
			}
		}),
		// Each dial closes the connection dialled before it: nats.go
		// leaves one whose handshake or authorization failed open until
		// the garbage collector finds it (a refused replica gained two
		// sockets a second: the operator trial).
		nats.SetCustomDialer(&closingDialer{}),
	)...)
	if err != nil {
		return nil, fmt.Errorf("replicas: %w", err)
	}
	if nc.IsConnected() {
		connected(nc)
	} else if err := connectError(firstErr); err == nil || !refused(err) { // a refusal is said as an error
		if err != nil {
			sayAgain(err) // not said again by sayWhyDown within the minute
		}
		log.Warn().Err(err).Str("nats", redactURLs(cfg.URL)).Msg("replicas: cannot reach NATS yet; routing on this replica's load, retrying every 500ms")
	}
	s.nc = nc
	if s.sub, err = nc.Subscribe(cfg.Subject, s.receive); err != nil {
		s.closing.Store(true)
		nc.Close()
		return nil, fmt.Errorf("replicas: subscribe %s: %w", cfg.Subject, err)
	}
	if nc.IsConnected() {
		// The server has the subscription once it answers the flush:
		// from then on every report reaches this replica. Without it,
		// reports sent just after Start could go unheard (a test's,
		// on a busy machine: CI).
		nc.FlushTimeout(time.Second)
	}
	go s.loop()
	go s.sayWhyDown(sayAgain, sayRefused)
	return s, nil
}

// sayWhyDown says, while the connection is down, why the reconnections
// fail, once a minute while the same reason lasts: a refusal as an
// error, a failed TLS handshake (an expired or untrusted certificate) as a
// warning. nats.go tells its reconnect handler only of failed dials
// (the operator trial: a password changed, or a certificate expired,
// while connected was never said). A server that is down is said once,
// at the disconnection. It reads nats.go's last error apart from the
// report loop: the read waits while a dial runs (up to 2 s).
func (s *Sync) sayWhyDown(sayAgain func(error) bool, sayRefused func(error)) {
	defer close(s.whyDone)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		if s.up.Load() {
			continue
		}
		err := s.nc.LastError()
		switch {
		case err == nil || errors.Is(err, nats.ErrNoServers) || errors.Is(err, syscall.ECONNREFUSED) || s.closing.Load() || !sayAgain(err):
		case refused(err):
			sayRefused(err)
		default:
			s.log.Warn().Err(err).Str("nats", redactURLs(s.cfg.URL)).Msg("replicas: cannot reconnect to NATS; routing on this replica's load, retrying every 500ms (said once a minute while it lasts)")
		}
	}
}

// closingDialer dials NATS servers, closing the connection it dialled
// before (see its use in Start).
type closingDialer struct {
	mu   sync.Mutex
	last net.Conn
}

func (d *closingDialer) Dial(network, address string) (net.Conn, error) {
	d.mu.Lock()
	if d.last != nil {
		d.last.Close()
		d.last = nil
	}
	d.mu.Unlock()
	c, err := (&net.Dialer{Timeout: nats.DefaultTimeout}).Dial(network, address)
	if err == nil {
		d.mu.Lock()
		d.last = c
		d.mu.Unlock()
	}
	return c, err
}

// pingInterval and maxPingsOut: NATS is deemed lost once it has not
// answered maxPingsOut pings, sent every pingInterval (3–4 s).
const (
	pingInterval = time.Second
	maxPingsOut  = 3
)

// connectError is why the first connection failed, as nats.go hands it to
// the reconnect handler at once.
func connectError(first <-chan error) error {
	select {
	case err := <-first:
		if errors.Is(err, nats.ErrNoServers) { // what nats.go makes of a refused connection
			return errors.New("connection refused")
		}
		if errors.Is(err, nats.ErrNoInfoReceived) {
			return fmt.Errorf("not a NATS server: %w", err)
		}
		return err
	case <-time.After(time.Second):
		return nil
	}
}

// expiryCheck bounds how long a silent peer's load outlives its expiry: a
// replica with a long interval of its own still looks this often (it
// looked at its own ticks only, and a peer reporting every 50 ms lingered
// for 5 s of a 5 s interval; found by the ninth session's review).
const expiryCheck = 250 * time.Millisecond

func (s *Sync) loop() {
	defer close(s.done)
	tick, perReport := reportTicks(s.cfg.Interval)
	t := time.NewTicker(tick)
	defer t.Stop()
	var w *time.Ticker // the watch for ended load, while the last report showed load
	var watch <-chan time.Time
	defer func() {
		if w != nil {
			w.Stop()
		}
	}()
	for n := 0; ; {
		select {
		case <-s.stop:
			return
		case <-watch:
			s.publishIfEnded()
		case <-t.C:
			if n++; n%perReport == 0 {
				s.Publish()
			}
			if s.expire(time.Now()) {
				s.applySum()
			}
		}
		// An idle replica is not woken every few milliseconds.
		if busy := s.reportedLoad(); busy && w == nil {
			w = time.NewTicker(min(s.cfg.Interval/4, watchEvery))
			watch = w.C
			s.watching.Store(true)
		} else if !busy && w != nil {
			w.Stop()
			w, watch = nil, nil
			s.watching.Store(false)
		}
	}
}

// reportTicks is the loop's tick for a report interval, and how many
// ticks go between reports: the interval rounded to ticks of at most
// expiryCheck.
func reportTicks(interval time.Duration) (tick time.Duration, perReport int) {
	tick = min(interval, expiryCheck)
	return tick, max(1, int((interval+tick/2)/tick))
}

// reportedLoad reports whether the last report showed load.
func (s *Sync) reportedLoad() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sent) > 0
}

// While its last report showed load, a replica looks every watchEvery (or
// quarter interval, if shorter) for load that has ended, and reports it
// then, earlyGap after its last report at the soonest (a busy replica's
// load ends all the time: at most 100 more reports a second). Peers
// weighed ended load until the next report: a follow-up sent at once to
// another replica left the engine holding its prefix for one whose last
// report was taken mid-prefill (found by the replicas user trial).
const (
	watchEvery = 5 * time.Millisecond
	earlyGap   = 10 * time.Millisecond
)

// publishIfEnded publishes early when some load the last report showed
// has ended (a prefill, a request).
func (s *Sync) publishIfEnded() {
	s.mu.Lock()
	due := len(s.sent) > 0 && time.Since(s.sentAt) >= earlyGap // else nothing reported can have ended, or too soon
	s.mu.Unlock()
	if !due {
		return
	}
	loads := s.local()
	s.mu.Lock()
	ended := endedSince(s.sent, loads)
	s.mu.Unlock()
	if ended {
		s.publish(loads)
	}
}

// endedSince reports whether any load of sent is lower in loads.
func endedSince(sent map[Key]router.Load, loads []Entry) bool {
	now := make(map[Key]router.Load, len(loads))
	for _, e := range loads {
		now[Key{e.Model, e.Worker}] = e.Load
	}
	for k, was := range sent {
		l := now[k]
		if l.Inflight < was.Inflight || l.Pending < was.Pending || l.PrefillTokens < was.PrefillTokens || l.ActiveBlocks < was.ActiveBlocks {
			return true
		}
	}
	return false
}

// Publish reports this replica's load now (it also does every interval,
// and when load ends).
func (s *Sync) Publish() { s.publish(s.local()) }

func (s *Sync) publish(loads []Entry) {
	s.setMine(loads)
	sent := map[Key]router.Load{} // the loads above zero
	for _, e := range loads {
		if e.Load != (router.Load{}) {
			sent[Key{e.Model, e.Worker}] = e.Load
		}
	}
	s.mu.Lock()
	s.sent, s.sentAt = sent, time.Now()
	s.mu.Unlock()
	b, err := json.Marshal(report{Replica: s.cfg.ID, Instance: s.instance, IntervalMs: s.period.Milliseconds(), Loads: loads})
	if err != nil {
		return
	}
	err = s.nc.Publish(s.cfg.Subject, b)
	if errors.Is(err, nats.ErrReconnectBufExceeded) || errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, nats.ErrConnectionClosed) {
		return // disconnected or closed: said once, by the connection's handlers
	}
	// Any other error (a report over the server's max_payload) is said
	// once, not every interval, until a report goes out again.
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	s.mu.Lock()
	logIt := msg != "" && msg != s.pubErr
	s.pubErr = msg
	s.mu.Unlock()
	if logIt {
		s.log.Warn().Err(err).Msg("replicas: publish; this replica's load does not reach the others")
	}
}

func (s *Sync) receive(m *nats.Msg) {
	var r report
	if err := json.Unmarshal(m.Data, &r); err != nil || r.Replica == "" {
		s.mu.Lock()
		warn := !s.warnBad
		s.warnBad = true
		s.mu.Unlock()
		if warn { // once: a foreign publisher sends one every interval
			s.log.Warn().Str("subject", m.Subject).Msg("replicas: a malformed load report (another program or version on the subject?); ignored, as are the next ones")
		}
		return
	}
	if r.Instance == s.instance {
		return // our own (were it echoed)
	}
	if r.Leaving {
		s.leave(r.Replica + "/" + r.Instance)
		return
	}
	for i := range r.Loads { // a buggy or hostile publisher must not cancel the others' load, nor wrap the sum
		l := &r.Loads[i].Load
		l.Inflight, l.Pending = clamp(l.Inflight), clamp(l.Pending)
		l.PrefillTokens, l.ActiveBlocks = clamp(l.PrefillTokens), clamp(l.ActiveBlocks)
	}
	r.Loads = s.ours(r.Replica, r.Loads)
	iv := s.cfg.Interval
	if r.IntervalMs > 0 {
		iv = min(time.Duration(r.IntervalMs)*time.Millisecond, maxPeerInterval)
	}
	s.mu.Lock()
	if r.Replica == s.cfg.ID && !s.warnDup {
		s.warnDup = true
		s.log.Warn().Str("replica", r.Replica).Msg("replicas: another replica uses this replica's id; give each its own (replicas.id)")
	}
	key := r.Replica + "/" + r.Instance
	now := time.Now()
	_, known := s.peers[key]
	if !known {
		// A replica of this id that has missed two reports is one that
		// crashed and is back (a container restarted keeps its
		// hostname-pid): its last load would count twice with the new
		// one's until it expires. Two live replicas given one id both
		// report every interval, and both count. Before the cap: the
		// new one takes its former self's place.
		for k, p := range s.peers {
			if p.id == r.Replica && now.Sub(p.seen) > 2*p.interval {
				delete(s.peers, k)
				s.log.Info().Str("replica", p.id).Str("instance", p.instance).Str("by", r.Instance).
					Msg("replicas: a replica is back under its id; its former instance's load no longer counts")
			}
		}
	}
	if !known && len(s.peers) >= maxPeers {
		if !s.warnMax {
			s.warnMax = true
			s.log.Warn().Int("max", maxPeers).Msg("replicas: too many replicas report on the subject; the newest are ignored")
		}
		s.mu.Unlock()
		s.applySum() // a former instance may have gone
		return
	}
	if !known {
		s.log.Info().Str("replica", r.Replica).Str("instance", r.Instance).Msg("replicas: a replica reports; its load counts")
	}
	s.peers[key] = &peer{id: r.Replica, instance: r.Instance, loads: r.Loads, seen: now, interval: iv, ttl: max(3*iv, time.Second)}
	s.mu.Unlock()
	s.applySum()
}

// leave drops the peer of key, which said it is leaving.
func (s *Sync) leave(key string) {
	s.mu.Lock()
	p, known := s.peers[key]
	delete(s.peers, key)
	s.mu.Unlock()
	if known {
		s.log.Info().Str("replica", p.id).Str("instance", p.instance).Msg("replicas: a replica left; its load no longer counts")
		s.applySum()
	}
}

// workersOf is the workers of loads with their URL hashes.
func workersOf(loads []Entry) map[Key]string {
	m := make(map[Key]string, len(loads))
	for _, e := range loads {
		m[Key{e.Model, e.Worker}] = e.URLHash
	}
	return m
}

func (s *Sync) setMine(loads []Entry) {
	m := workersOf(loads)
	s.mu.Lock()
	s.mine, s.mineAt = m, time.Now()
	s.mu.Unlock()
}

// ours is the entries of replica's report on this replica's workers, at
// their URLs; the others are warned of, once per replica and backend.
// Replicas of one fleet must name the same models and backends: these
// shared nothing, or swapped two engines' load, with no word of it.
func (s *Sync) ours(replica string, loads []Entry) []Entry {
	kept, odd := s.splitEntries(loads)
	s.mu.Lock()
	stale := time.Since(s.mineAt) > expiryCheck // not once per report of a misconfigured fleet
	s.mu.Unlock()
	if len(odd) > 0 && stale { // a reload may have added them since the last Publish
		s.setMine(s.local())
		kept, odd = s.splitEntries(loads)
	}
	for _, e := range odd {
		s.warnMismatch(replica, e)
	}
	return kept
}

// maxUnknownKept bounds the unhashed entries on workers this replica does
// not have that one report may leave kept: unbounded, a publisher on the
// subject made every replica keep and sum every entry it sent (the
// twenty-ninth session's review: 50 reports of 20,000 entries kept
// 840,000, and took 69 ms to sum at each report).
const maxUnknownKept = 1024

// splitEntries splits loads into those on this replica's workers and those
// that are not (unknown, or at another URL); unhashed entries are kept, on
// unknown workers up to maxUnknownKept.
func (s *Sync) splitEntries(loads []Entry) (kept, odd []Entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	kept = loads[:0:0]
	unknown := 0
	for _, e := range loads {
		h, known := s.mine[Key{e.Model, e.Worker}]
		if !known && e.URLHash == "" {
			unknown++
		}
		if e.URLHash != "" && (!known || h != "" && h != e.URLHash) || !known && unknown > maxUnknownKept {
			odd = append(odd, e)
		} else {
			kept = append(kept, e)
		}
	}
	return kept, odd
}

func (s *Sync) warnMismatch(replica string, e Entry) {
	s.mu.Lock()
	h, known := s.mine[Key{e.Model, e.Worker}]
	k := replica + "\x00" + e.Model + "\x00" + e.Worker
	logIt := !s.mismatched[k] && len(s.mismatched) < maxMismatches
	if logIt {
		s.mismatched[k] = true
	}
	s.mu.Unlock()
	if !logIt {
		return
	}
	ev := s.log.Warn().Str("replica", replica).Str("model", e.Model).Str("backend", e.Worker)
	if !known {
		ev.Msg("replicas: a replica reports load on a backend this replica does not have; ignored (replicas must name the same models and backends)")
	} else {
		ev.Str("url_hash", e.URLHash).Str("ours", h).Msg("replicas: a replica reports load on a backend of this id at another URL; ignored (replicas must name the same backends with the same URLs)")
	}
}

// clamp bounds one reported load figure to [0, router.MaxRemoteLoad].
func clamp(v int64) int64 { return min(max(v, 0), router.MaxRemoteLoad) }

// expire drops the peers silent for three of their intervals (at least a
// second); it reports whether any went.
func (s *Sync) expire(now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	gone := false
	for key, p := range s.peers {
		if now.Sub(p.seen) > p.ttl {
			delete(s.peers, key)
			gone = true
			s.log.Info().Str("replica", p.id).Str("instance", p.instance).Msg("replicas: a replica stopped reporting; its load no longer counts")
		}
	}
	return gone
}

// applySum hands the peers' load, summed per worker, to apply.
func (s *Sync) applySum() {
	s.mu.Lock()
	sum := map[Key]router.Load{}
	for _, p := range s.peers {
		for _, e := range p.loads {
			k := Key{e.Model, e.Worker}
			l := sum[k]
			// Both terms are at most router.MaxRemoteLoad: no wrap.
			l.Inflight = clamp(l.Inflight + e.Inflight)
			l.Pending = clamp(l.Pending + e.Pending)
			l.PrefillTokens = clamp(l.PrefillTokens + e.PrefillTokens)
			l.ActiveBlocks = clamp(l.ActiveBlocks + e.ActiveBlocks)
			sum[k] = l
		}
	}
	// Under the lock: two reports arriving together must not apply their
	// sums in the wrong order.
	s.apply(sum)
	s.mu.Unlock()
}

// Peers is how many other replicas are reporting.
func (s *Sync) Peers() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.peers)
}

// Connected reports whether the NATS connection is up.
func (s *Sync) Connected() bool { return s.up.Load() }

// Close stops reporting and leaves NATS, telling the others, who drop
// this replica's load at once (after their expiry if the word is lost).
func (s *Sync) Close() {
	select {
	case <-s.stop:
		return
	default:
	}
	close(s.stop)
	<-s.done
	s.closing.Store(true)
	if s.up.Load() {
		if b, err := json.Marshal(report{Replica: s.cfg.ID, Instance: s.instance, IntervalMs: s.period.Milliseconds(), Loads: []Entry{}, Leaving: true}); err == nil &&
			s.nc.Publish(s.cfg.Subject, b) == nil {
			s.nc.FlushTimeout(leaveFlush)
		}
	}
	s.sub.Unsubscribe()
	s.nc.Close()
	<-s.whyDone // its read of nats.go's last error returns once Close has
	// Its handlers run after Close, on nats.go's goroutine: none logs
	// once Close has returned.
	select {
	case <-s.closed:
	case <-time.After(time.Second):
	}
}

// leaveFlush bounds how long Close waits for the server to take the
// leaving report: a shutdown is not held up by a slow NATS.
const leaveFlush = 500 * time.Millisecond

// refused reports whether err is a NATS server's refusal of this client's
// authorization (nats.go passes the server's words on).
func refused(err error) bool {
	msg := strings.ToLower(err.Error())
	return strings.Contains(msg, "authorization violation") || strings.Contains(msg, "authentication expired") ||
		strings.Contains(msg, "authentication revoked")
}

// redactURLs is the comma-separated NATS URLs with their passwords (or
// tokens) hidden, for the log.
func redactURLs(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		if u, err := url.Parse(strings.TrimSpace(p)); err == nil && u.User != nil {
			if _, has := u.User.Password(); has {
				parts[i] = u.Redacted()
			} else {
				u.User = url.User("xxxxx") // a bare token
				parts[i] = u.String()
			}
		}
	}
	return strings.Join(parts, ",")
}
