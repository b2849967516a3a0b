package proxy

import (
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/fasthttpadaptor"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/internal/buildinfo"
)

type metrics struct {
	requests    *prometheus.CounterVec
	ok          sync.Map // backend id → its requests counter for status 200
	ttft        *prometheus.HistogramVec
	ttftOf      sync.Map // backend id → its TTFT observer
	duration    *prometheus.HistogramVec
	durationOf  sync.Map // backend id → its duration observer
	tpot        *prometheus.HistogramVec
	tpotOf      sync.Map // backend id → its time-per-output-token observer
	tokens      *prometheus.CounterVec
	tokensMu    sync.RWMutex
	tokensOf    map[[2]string]*[3]prometheus.Counter // model, tenant → prompt, completion, cached
	hitRatio    prometheus.Histogram
	route       prometheus.Histogram
	queueWait   *prometheus.HistogramVec // model
	ejections   *prometheus.CounterVec   // backend, reason (the eject* constants)
	reroutes    *prometheus.CounterVec   // backend that refused
	migrations  *prometheus.CounterVec   // backend that failed mid-stream, result
	reloads     *prometheus.CounterVec   // result: ok, rejected
	reloadOK    prometheus.Gauge
	limited     *prometheus.CounterVec // tenant, limit: requests, tokens, concurrency
	panics      prometheus.Counter
	unavailable *prometheus.CounterVec // reason (unavailableReason)
	// acceptErrors counts accept errors kvproxy served on through.
	acceptErrors prometheus.Counter
	// connsRefused counts client connections refused over the cap;
	// connsEvicted the idle ones closed to make room under it.
	connsRefused, connsEvicted prometheus.Counter
	// adminConnsRefused counts admin_listen's connections refused over its cap.
	adminConnsRefused prometheus.Counter
	handler           fasthttp.RequestHandler
}

// newMetrics makes the metrics the request path and the backends count,
// before the backends are built; register exposes them.
func newMetrics() *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_requests_total", Help: "Proxied requests by backend and status: the HTTP status, 499 for a client that left, or for a stream that failed after its 200 the 502 or 504 its error event stands for (backend empty: answered by kvproxy; dry runs, /v1/models and /health are not counted).",
		}, []string{"backend", "code"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvproxy_ttft_seconds", Help: "Time from request arrival to the first streamed token, by backend.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 16), // 5 ms to 164 s: a prefill queued behind a loaded engine's can take a minute
		}, []string{"backend"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvproxy_request_duration_seconds", Help: "Time from request arrival to the end of its answer, by backend (every status, streams included; requests kvproxy answers itself are not observed).",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 18), // 5 ms to 11 min: long generations
		}, []string{"backend"}),
		tpot: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvproxy_time_per_output_token_seconds", Help: "A stream's mean time between output tokens after the first (inter-token latency), one observation per stream, by backend.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14), // 1 ms to 8 s
		}, []string{"backend"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_tokens_total", Help: "Tokens of the completion requests engines took (and of pass-through answers with a usage), by model, tenant and type: prompt, completion (output) and cached (prompt tokens the engine found in its cache); the engine's usage where it reported one, else kvproxy's estimate.",
		}, []string{"model", "tenant", "type"}),
		tokensOf: map[[2]string]*[3]prometheus.Counter{},
		hitRatio: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvproxy_prefix_hit_ratio", Help: "Cached prefix blocks on the chosen worker / prompt blocks, at routing time.",
			Buckets: []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1},
		}),
		route: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvproxy_route_seconds", Help: "Time to choose a worker (excluding tokenization).",
			Buckets: prometheus.ExponentialBuckets(1e-6, 2, 16),
		}),
	}
	m.queueWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvproxy_queue_wait_seconds", Help: "Time a request waited in kvproxy's queue for a backend slot (every backend of its model at max_concurrency), by model, once each time it was routed: 0 when a slot was free; waits that ended unserved (queue_timeout, displaced, the client gone) included.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15), // 1 ms to 16 s: queue_timeout is 10 s by default
	}, []string{"model"})
	m.ejections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvproxy_backend_ejections_total", Help: "Backends taken out of selection after failures, by backend and reason: connect (refused, reset, cut off, TLS), status (5xx, 503), timeout (silent), error_answers (500s or credential refusals in a row), probe (health probe failing).",
	}, []string{"backend", "reason"})
	m.migrations = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvproxy_stream_migrations_total", Help: "Streams whose backend failed mid-answer, by that backend and result: continued on another backend (ok), or ended with an error event because none could continue it, its moves (limits.migration_limit) were spent or it had the tokens it asked for (failed).",
	}, []string{"backend", "result"})
	m.reroutes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvproxy_reroutes_total", Help: "Requests sent on to another backend after this one refused them (connection refused, 429, 503, credentials, 404) or failed them before any answer (500, 502, 504), by that backend.",
	}, []string{"backend"})
	m.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvproxy_config_reloads_total", Help: "Configuration reloads (SIGHUP, POST /admin/reload) by result: ok or rejected.",
	}, []string{"result"})
	m.reloads.WithLabelValues("ok")
	m.reloads.WithLabelValues("rejected")
	m.reloadOK = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvproxy_config_last_reload_successful", Help: "1 when the last reload was applied (or none was tried), 0 when it was rejected.",
	})
	m.reloadOK.Set(1)
	m.limited = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvproxy_rate_limited_total", Help: "Requests refused with 429 by a tenant's limit, by tenant and limit: requests (requests_per_second), tokens (tokens_per_minute) or concurrency (max_concurrency).",
	}, []string{"tenant", "limit"})
	m.panics = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvproxy_handler_panics_total", Help: "Requests whose handler panicked: answered 500, logged with the stack (\"request handler panicked\"). Any is a bug.",
	})
	m.acceptErrors = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvproxy_accept_errors_total", Help: "Client connections the listener failed to accept (out of file descriptors, EMFILE/ENFILE, or kernel memory): kvproxy retries, 5 ms doubling to 1 s, and serves on; the connections wait in the kernel's backlog meanwhile.",
	})
	m.connsRefused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvproxy_client_connections_refused_total", Help: "Client connections answered 503 and closed at once because limits.max_connections were open (kvproxy_client_connections) and none was idle.",
	})
	m.adminConnsRefused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvproxy_admin_connections_refused_total", Help: "Connections to admin_listen answered 503 and closed at once because it had its 64 open (kvproxy_admin_connections) and none was idle.",
	})
	m.connsEvicted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvproxy_client_connections_evicted_total", Help: "Idle keep-alive client connections closed to make room for a new one when limits.max_connections were open.",
	})
	m.unavailable = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvproxy_unavailable_total", Help: "503s kvproxy answered itself, by reason: queue_full, queue_timeout (saturation: every backend at max_concurrency), no_healthy_backend (an outage), pinned_backend_unavailable, response_backend_unavailable, backend_removed, shutting_down, out_of_file_descriptors (kvproxy's open files limit), body_memory_full (limits.body_memory_mb held by other large bodies).",
	}, []string{"reason"})
	for _, why := range unavailableReasons {
		m.unavailable.WithLabelValues(string(why))
	}
	return m
}

// register adds the metrics to reg, with the collectors that read s at
// scrape time; s must be complete (its state and replicas set).
func (m *metrics) register(reg *prometheus.Registry, s *Server) {
	build := buildinfo.Read()
	reg.MustRegister(m.requests, m.ttft, m.duration, m.tpot, m.tokens, m.hitRatio, m.route, m.queueWait, m.ejections, m.reroutes, m.migrations, m.reloads, m.reloadOK, m.limited, m.panics, m.unavailable, m.acceptErrors, m.connsRefused, m.connsEvicted, m.adminConnsRefused,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvproxy_client_connections", Help: "Client connections open (limits.max_connections caps them).",
		}, func() float64 { return float64(s.openConns.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvproxy_admin_connections", Help: "Connections open on admin_listen (64 at most; not counted in kvproxy_client_connections).",
		}, func() float64 { return float64(s.adminConns.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvproxy_body_memory_bytes", Help: "Memory held by bodies over 1 MiB: request bodies and engine answers read whole (limits.body_memory_mb bounds it).",
		}, func() float64 { return float64(s.bodyMem.Used()) }),
		&loadCollector{s: s}, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvproxy_build_info", Help: "1, labelled with the running build: its version, commit (revision) and Go version.",
			ConstLabels: prometheus.Labels{"version": build.Version, "revision": build.Revision, "goversion": build.GoVersion},
		}, func() float64 { return 1 }))
	if r := s.replicas; r != nil {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvproxy_replicas_connected", Help: "1 while connected to NATS, sharing load with the other replicas (replicas.nats).",
		}, func() float64 {
			if r.Connected() {
				return 1
			}
			return 0
		}), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvproxy_replicas_peers", Help: "Other kvproxy replicas whose load reports count.",
		}, func() float64 { return float64(r.Peers()) }))
	}
	// Goroutines, heap and RSS: what a soak test and an operator watch for leaks.
	reg.Register(collectors.NewGoCollector())
	reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.handler = fasthttpadaptor.NewFastHTTPHandler(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
}

func (m *metrics) serve(ctx *fasthttp.RequestCtx) { m.handler(ctx) }

// countRequest counts one completion request. A backend's 200s, nearly all
// requests, skip the vector's label lookup.
func (m *metrics) countRequest(backend string, status int) {
	if status != fasthttp.StatusOK {
		m.requests.WithLabelValues(backend, strconv.Itoa(status)).Inc()
		return
	}
	c, ok := m.ok.Load(backend)
	if !ok {
		c, _ = m.ok.LoadOrStore(backend, m.requests.WithLabelValues(backend, "200"))
	}
	c.(prometheus.Counter).Inc()
}

// forgetBackend drops the series of a backend id no longer configured (a
// reload removed it and its last request ended): a fleet whose backends
// come and go under new ids grew 22 series for each id it ever had (the
// soak trial). An id configured again starts its series anew.
func (m *metrics) forgetBackend(id string) {
	for _, cache := range []*sync.Map{&m.ok, &m.ttftOf, &m.durationOf, &m.tpotOf} {
		cache.Delete(id)
	}
	match := prometheus.Labels{"backend": id}
	for _, v := range []interface{ DeletePartialMatch(prometheus.Labels) int }{m.requests, m.ttft, m.duration, m.tpot, m.ejections, m.reroutes, m.migrations} {
		v.DeletePartialMatch(match)
	}
}

// observeTTFT records a stream's time to first token on its backend.
func (m *metrics) observeTTFT(backend string, seconds float64) {
	o, ok := m.ttftOf.Load(backend)
	if !ok {
		o, _ = m.ttftOf.LoadOrStore(backend, m.ttft.WithLabelValues(backend))
	}
	o.(prometheus.Observer).Observe(seconds)
}

// observeTPOT records a stream's mean time per output token after the first.
func (m *metrics) observeTPOT(backend string, seconds float64) {
	o, ok := m.tpotOf.Load(backend)
	if !ok {
		o, _ = m.tpotOf.LoadOrStore(backend, m.tpot.WithLabelValues(backend))
	}
	o.(prometheus.Observer).Observe(seconds)
}

// observeDuration records a proxied request's time from arrival to end.
func (m *metrics) observeDuration(backend string, seconds float64) {
	o, ok := m.durationOf.Load(backend)
	if !ok {
		o, _ = m.durationOf.LoadOrStore(backend, m.duration.WithLabelValues(backend))
	}
	o.(prometheus.Observer).Observe(seconds)
}

// countTokens adds a completion request's tokens to its model and tenant.
func (m *metrics) countTokens(model, tenant string, prompt, completion, cached int) {
	key := [2]string{model, tenant}
	m.tokensMu.RLock()
	c := m.tokensOf[key]
	m.tokensMu.RUnlock()
	if c == nil {
		c = &[3]prometheus.Counter{m.tokens.WithLabelValues(model, tenant, "prompt"),
			m.tokens.WithLabelValues(model, tenant, "completion"), m.tokens.WithLabelValues(model, tenant, "cached")}
		m.tokensMu.Lock()
		m.tokensOf[key] = c
		m.tokensMu.Unlock()
	}
	c[0].Add(float64(prompt))
	c[1].Add(float64(completion))
	c[2].Add(float64(cached))
}

// countEjection counts a backend's ejection under reason (the eject*
// constants). A nil m (a backend built outside a Server) counts nothing.
func (m *metrics) countEjection(backend, reason string) {
	if m != nil {
		m.ejections.WithLabelValues(backend, reason).Inc()
	}
}

// countReload counts a reload's result.
func (m *metrics) countReload(err error) {
	if err != nil {
		m.reloads.WithLabelValues("rejected").Inc()
		m.reloadOK.Set(0)
		return
	}
	m.reloads.WithLabelValues("ok").Inc()
	m.reloadOK.Set(1)
}

var (
	inflightDesc = prometheus.NewDesc("kvproxy_inflight_requests", "Requests in flight per backend.", []string{"backend"}, nil)
	blocksDesc   = prometheus.NewDesc("kvproxy_active_blocks", "Active KV blocks per backend, as tracked by the router.", []string{"backend"}, nil)
	indexDesc    = prometheus.NewDesc("kvproxy_indexed_blocks", "Blocks in the prefix index per backend.", []string{"backend"}, nil)
	healthyDesc  = prometheus.NewDesc("kvproxy_backend_healthy", "1 while the backend is healthy (its probe passes and it is not ejected; it may still be full or cooling down: /admin/backends available).", []string{"backend"}, nil)
	tenantDesc   = prometheus.NewDesc("kvproxy_tenant_inflight_requests", "Requests in flight per tenant with a max_concurrency, those queued for a backend slot included.", []string{"tenant"}, nil)
	modelUpDesc  = prometheus.NewDesc("kvproxy_model_healthy_backends", "Healthy backends per configured model (0: the model's requests are answered 503).", []string{"model"}, nil)
	queuedDesc   = prometheus.NewDesc("kvproxy_queue_waiting", "Requests waiting for a backend slot (limits.max_queue), per configured model.", []string{"model"}, nil)
	tokCacheDesc = prometheus.NewDesc("kvproxy_tokenizer_cache_bytes", "Bytes of token ids and message text the model's tokenizer cache holds (models[].tokenizer_cache_mb bounds it; with tokenizer: engine, the engine's answers, up to 32 MiB).", []string{"model"}, nil)
	infoDesc     = prometheus.NewDesc("kvproxy_backend_info", "1 for each configured backend, with its model, kind and role: join on backend to break the per-backend series down by model.", []string{"backend", "model", "kind", "role"}, nil)
	feedDesc     = prometheus.NewDesc("kvproxy_kv_events_connected", "1 while the backend's ZMQ KV event feed is connected (every data-parallel rank's); only backends with kv_events mode zmq.", []string{"backend"}, nil)
)

// loadCollector reads the router's load at scrape time, so the hot path
// keeps no second set of counters.
type loadCollector struct{ s *Server }

func (c *loadCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- inflightDesc
	ch <- blocksDesc
	ch <- indexDesc
	ch <- healthyDesc
	ch <- tenantDesc
	ch <- modelUpDesc
	ch <- queuedDesc
	ch <- tokCacheDesc
	ch <- infoDesc
	ch <- feedDesc
}

func (c *loadCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.st.Load()
	for name, t := range st.auth.tenants {
		if t.maxInflight > 0 {
			ch <- prometheus.MustNewConstMetric(tenantDesc, prometheus.GaugeValue, float64(t.inflight.Load()), name)
		}
	}
	// One series per backend id, of the requests holding a slot on any
	// backend of that id: the live one and those a reload removed,
	// replaced or moved that still drain on that engine. Each request
	// holds its slot on one of them, so it counts once whatever the
	// reloads did; the router's load would not do: a worker a reload
	// hands over or that a re-added backend takes back already holds the
	// requests of the one draining (found by the twelfth session's
	// operator trial: 3 streams counted 6 after e3 was removed and added
	// again while they ran).
	rows := c.s.backendRows(st)
	c.collectModels(ch, st, rows)
	inflight := c.s.inflightByID(st)
	for _, r := range rows {
		if r.Draining {
			continue
		}
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(inflight[r.ID]), r.ID)
		delete(inflight, r.ID)
		ch <- prometheus.MustNewConstMetric(blocksDesc, prometheus.GaugeValue, float64(r.ActiveBlocks), r.ID)
		ch <- prometheus.MustNewConstMetric(indexDesc, prometheus.GaugeValue, float64(r.IndexedBlocks), r.ID)
		h := 0.0
		if r.Healthy {
			h = 1
		}
		ch <- prometheus.MustNewConstMetric(healthyDesc, prometheus.GaugeValue, h, r.ID)
		role := r.Role
		if role == "" {
			role = config.RoleBoth
		}
		ch <- prometheus.MustNewConstMetric(infoDesc, prometheus.GaugeValue, 1, r.ID, r.Model, r.Kind, role)
		if ev := r.KVEvents; ev != nil && ev.Connected != nil {
			ch <- prometheus.MustNewConstMetric(feedDesc, prometheus.GaugeValue, boolGauge(*ev.Connected), r.ID)
		}
	}
	for id, n := range inflight { // removed: no live backend of that id
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(n), id)
	}
}

// inflightByID counts the requests holding a slot per backend id, on the
// backends of st and on those still draining from earlier reloads.
func (s *Server) inflightByID(st *state) map[string]int64 {
	n := map[string]int64{}
	for id, b := range st.backends {
		n[id] += b.inflight.Load()
	}
	s.retiring.Range(func(k, _ any) bool {
		if b := k.(*backend); st.backends[b.cfg.ID] != b { // st may predate the reload
			n[b.cfg.ID] += b.inflight.Load()
		}
		return true
	})
	return n
}

// collectModels reports, per configured model (aliases are not models),
// its healthy backends, 0 included, and its requests waiting in the queue.
func (c *loadCollector) collectModels(ch chan<- prometheus.Metric, st *state, rows []backendJSON) {
	healthy := map[string]int{}
	for _, r := range rows {
		if !r.Draining && r.Healthy && r.Role != config.RolePrefill { // a prefill engine serves no request alone
			healthy[r.Model]++
		}
	}
	for _, p := range st.pools {
		ch <- prometheus.MustNewConstMetric(modelUpDesc, prometheus.GaugeValue, float64(healthy[p.cfg.Name]), p.cfg.Name)
		ch <- prometheus.MustNewConstMetric(queuedDesc, prometheus.GaugeValue, float64(p.waiting.Load()), p.cfg.Name)
		ch <- prometheus.MustNewConstMetric(tokCacheDesc, prometheus.GaugeValue, float64(p.tokenizerCacheBytes()), p.cfg.Name)
	}
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
