package backends

import (
	"crypto/tls"
	"errors"
	"io"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"
)

// ProbeConfig sets how engines are probed.
type ProbeConfig struct {
	Interval time.Duration // between probes of one engine
	Timeout  time.Duration // per probe
	Rise     int           // consecutive successes to become healthy
	Fall     int           // consecutive failures to become unhealthy
}

// Prober actively checks engines' health endpoints and reports transitions.
// A backend starts healthy (optimistic) so traffic flows before the first
// probe, which takes it out if it fails.
type Prober struct {
	cfg    ProbeConfig
	client *fasthttp.Client
	// insecure probes the https engines configured to skip certificate
	// checks; client checks every certificate.
	insecure *fasthttp.Client
	mu       sync.Mutex
	target   map[string]*probeTarget
	stop     chan struct{}
	wg       sync.WaitGroup
	running  bool // guarded by mu
	stopped  bool // guarded by mu: Stop was called, nothing starts again
}

type probeTarget struct {
	ProbeURL
	onChange func(healthy bool, why string)
	quit     chan struct{}

	// Guarded by Prober.mu: a target's probe loop and Add (which carries
	// them over to the next target of the same engine) both use them.
	healthy   bool
	probed    bool   // a probe has answered: until then the engine is healthy on trust
	why       string // what the last failed probe said
	successes int
	failures  int
}

// NewProber makes a Prober; call Add for each engine, then Start.
func NewProber(cfg ProbeConfig) *Prober {
	if cfg.Interval <= 0 {
		cfg.Interval = 2 * time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = time.Second
	}
	if cfg.Rise <= 0 {
		cfg.Rise = 1
	}
	if cfg.Fall <= 0 {
		cfg.Fall = 2
	}
	// A bounded body: fasthttp allocates a Content-Length body up
	// front, and an absurd one from a broken engine would panic.
	// Idle connections last just past the next probe: a connection
	// to an engine a reload removed closes soon after its last probe
	// (a retiring in-process mock waits for its connections to end).
	// WriteTimeout bounds the TLS handshake too: fasthttp runs it
	// inside the request's write, before any read deadline, and
	// DoTimeout waits for it (a silent https engine hung probes).
	p := &Prober{cfg: cfg, target: map[string]*probeTarget{}, stop: make(chan struct{})}
	p.client, p.insecure = engineClients(func() *fasthttp.Client {
		return &fasthttp.Client{NoDefaultUserAgentHeader: true, MaxIdleConnDuration: cfg.Interval + time.Second,
			MaxResponseBodySize: 1 << 20, WriteTimeout: cfg.Timeout}
	})
	return p
}

// engineClients makes the two clients probes and scrapes use from one
// recipe: one checks an https engine's certificate, the other (for
// insecure_skip_verify) does not; both retry only a stale connection.
func engineClients(newClient func() *fasthttp.Client) (verified, insecure *fasthttp.Client) {
	verified, insecure = newClient(), newClient()
	verified.RetryIfErr, insecure.RetryIfErr = retryStale, retryStale
	insecure.TLSConfig = &tls.Config{InsecureSkipVerify: true}
	return verified, insecure
}

// ProbeURL is what a probe asks: a GET of URL (http or https) that passes
// with a 200.
type ProbeURL struct {
	URL string
	// APIKey goes as a bearer token ("": none): an OpenAI-compatible
	// server without a /health endpoint is probed on /v1/models, which
	// may want the key.
	APIKey string
	// Insecure: an https engine whose certificate is not checked.
	Insecure bool
	// Slow is how long the engine itself takes to answer a healthy probe,
	// added to the probe's timeout: SGLang's /health waits a second before
	// it looks whether its engine produced anything.
	Slow time.Duration
}

// Add registers an engine, or replaces the registration of id; onChange is
// called when the engine goes down (with why the last probe failed), and
// with every probe that passes while it is up (which ends an ejection for
// a failed connection). A replaced registration of the same ProbeURL is
// the same engine: its health so far carries over (a reload that rebuilds
// a backend must not make a dead engine healthy again), and onChange hears
// at once if it is down.
func (p *Prober) Add(id string, u ProbeURL, onChange func(healthy bool, why string)) {
	p.mu.Lock()
	t := &probeTarget{ProbeURL: u, onChange: onChange, healthy: true, quit: make(chan struct{})}
	if old, ok := p.target[id]; ok {
		close(old.quit)
		if old.ProbeURL == u {
			t.healthy, t.probed, t.why, t.successes, t.failures = old.healthy, old.probed, old.why, old.successes, old.failures
		}
	}
	p.target[id] = t
	if p.running && !p.stopped {
		p.run(t)
	}
	healthy, why := t.healthy, t.why
	p.mu.Unlock()
	if !healthy {
		onChange(false, why)
	}
}

// Remove stops probing an engine.
func (p *Prober) Remove(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.target[id]; ok {
		close(t.quit)
		delete(p.target, id)
	}
}

// Start begins probing every registered engine.
func (p *Prober) Start() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running || p.stopped {
		return
	}
	p.running = true
	for _, t := range p.target {
		p.run(t)
	}
}

func (p *Prober) run(t *probeTarget) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		tick := time.NewTicker(p.cfg.Interval)
		defer tick.Stop()
		for {
			p.probe(t)
			select {
			case <-tick.C:
			case <-t.quit:
				return
			case <-p.stop:
				return
			}
		}
	}()
}

// retryStale retries a probe or scrape once, and only on a kept-alive
// connection the engine closed while it was idle. A refused connection or a
// failed TLS handshake is the answer: fasthttp's default tries a GET five
// times, five handshakes an untrusted engine logs for every probe.
func retryStale(_ *fasthttp.Request, attempts int, err error) (resetTimeout, retry bool) {
	return false, attempts < 2 && (errors.Is(err, io.EOF) || errors.Is(err, fasthttp.ErrConnectionClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE))
}

func (p *Prober) probe(t *probeTarget) {
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(t.URL)
	if t.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+t.APIKey)
	}
	c := p.client
	if t.Insecure {
		c = p.insecure
	}
	err := c.DoTimeout(req, resp, p.cfg.Timeout+t.Slow)
	if OutOfFiles(err) {
		return // kvproxy's own want of descriptors: no word on the engine
	}
	ok := err == nil && resp.StatusCode() == fasthttp.StatusOK
	why := ""
	switch {
	case err != nil:
		why = err.Error()
	case !ok:
		why = "status " + strconv.Itoa(resp.StatusCode())
	}
	p.mu.Lock()
	notify, healthy := t.record(ok, why, p.cfg)
	p.mu.Unlock()
	if notify {
		t.onChange(healthy, why)
	}
}

// record counts a probe's result and says whether to tell the backend,
// and what.
func (t *probeTarget) record(ok bool, why string, cfg ProbeConfig) (notify, healthy bool) {
	first := !t.probed
	t.probed = true
	changed := false
	if ok {
		t.successes++
		t.failures = 0
	} else {
		t.failures++
		t.successes = 0
		changed = why != t.why
		t.why = why
	}
	switch {
	case !t.healthy && t.successes >= cfg.Rise:
		t.healthy = true
		return true, true
	case t.healthy && (t.failures >= cfg.Fall || first && !ok):
		// Fall guards an engine that has answered against a flapping
		// probe; one that never has (at start, or a new backend) is not
		// trusted past its first failure.
		t.healthy = false
		return true, false
	case ok && t.healthy:
		// A worker taken out by a failed request (not by probes) comes back
		// on the next good probe. One taken out by probes waits for Rise.
		return true, true
	case !t.healthy && changed:
		// Still down, for another reason: the listing's probe_error said
		// "connection refused" for good once the engine came back hung
		// (the twenty-ninth session's trial).
		return true, false
	}
	return false, t.healthy
}

// Stop ends every probe loop and waits for them; Start and Add start no
// loop after it. Safe to call more than once, and concurrently with Start.
func (p *Prober) Stop() {
	p.mu.Lock()
	if !p.stopped {
		p.stopped = true
		close(p.stop)
	}
	p.mu.Unlock()
	p.wg.Wait() // no wg.Add after stopped is set: they happen under mu
}
