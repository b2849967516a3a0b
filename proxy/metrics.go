package proxy

import (
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/fasthttpadaptor"
)

type metrics struct {
	requests   *prometheus.CounterVec
	ok         sync.Map // backend id → its requests counter for status 200
	ttft       *prometheus.HistogramVec
	ttftOf     sync.Map // backend id → its TTFT observer
	duration   *prometheus.HistogramVec
	durationOf sync.Map // backend id → its duration observer
	tokens     *prometheus.CounterVec
	tokensMu   sync.RWMutex
	tokensOf   map[[2]string]*[3]prometheus.Counter // model, tenant → prompt, completion, cached
	hitRatio   prometheus.Histogram
	route      prometheus.Histogram
	handler    fasthttp.RequestHandler
}

func newMetrics(reg *prometheus.Registry, s *Server) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_requests_total", Help: "Proxied requests by backend and HTTP status (backend empty: answered by kvproxy).",
		}, []string{"backend", "code"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvproxy_ttft_seconds", Help: "Time from request arrival to the first streamed token, by backend.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
		}, []string{"backend"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvproxy_request_duration_seconds", Help: "Time from request arrival to the end of its answer, by backend (every status, streams included).",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 16),
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
	reg.MustRegister(m.requests, m.ttft, m.duration, m.tokens, m.hitRatio, m.route, &loadCollector{s: s})
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
	return m
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

// observeTTFT records a stream's time to first token on its backend.
func (m *metrics) observeTTFT(backend string, seconds float64) {
	o, ok := m.ttftOf.Load(backend)
	if !ok {
		o, _ = m.ttftOf.LoadOrStore(backend, m.ttft.WithLabelValues(backend))
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

var (
	inflightDesc = prometheus.NewDesc("kvproxy_inflight_requests", "Requests in flight per backend.", []string{"backend"}, nil)
	blocksDesc   = prometheus.NewDesc("kvproxy_active_blocks", "Active KV blocks per backend, as tracked by the router.", []string{"backend"}, nil)
	indexDesc    = prometheus.NewDesc("kvproxy_indexed_blocks", "Blocks in the prefix index per backend.", []string{"backend"}, nil)
	healthyDesc  = prometheus.NewDesc("kvproxy_backend_healthy", "1 when the backend receives traffic.", []string{"backend"}, nil)
	tenantDesc   = prometheus.NewDesc("kvproxy_tenant_inflight_requests", "Requests in flight per tenant with a max_concurrency.", []string{"tenant"}, nil)
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
}

func (c *loadCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.st.Load()
	for name, t := range st.auth.tenants {
		if t.maxInflight > 0 {
			ch <- prometheus.MustNewConstMetric(tenantDesc, prometheus.GaugeValue, float64(t.inflight.Load()), name)
		}
	}
	// One series per backend id. A backend a reload removed, or moved to
	// another model, is listed apart while it drains, and its requests are
	// still in flight on that engine: they count under its id, beside a
	// new backend of the same id if there is one. One a reload replaced in
	// place is already counted in its successor's load.
	rows := c.s.backendRows(st)
	draining := map[string]int64{}
	for _, r := range rows {
		if r.Draining && !r.handedOver {
			draining[r.ID] += r.Inflight
		}
	}
	for _, r := range rows {
		if r.Draining {
			continue
		}
		inflight := r.Inflight + draining[r.ID]
		delete(draining, r.ID)
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(inflight), r.ID)
		ch <- prometheus.MustNewConstMetric(blocksDesc, prometheus.GaugeValue, float64(r.ActiveBlocks), r.ID)
		ch <- prometheus.MustNewConstMetric(indexDesc, prometheus.GaugeValue, float64(r.IndexedBlocks), r.ID)
		h := 0.0
		if r.Healthy {
			h = 1
		}
		ch <- prometheus.MustNewConstMetric(healthyDesc, prometheus.GaugeValue, h, r.ID)
	}
	for id, n := range draining { // removed: no live backend of that id
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(n), id)
	}
}
