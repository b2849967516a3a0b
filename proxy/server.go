package proxy

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/kv"
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
	// HealthInterval between engine probes; 0 means 2s, negative disables.
	HealthInterval time.Duration
}

// Server is a running kvproxy: its model pools, backends and HTTP server.
type Server struct {
	cfg      *config.Config
	log      zerolog.Logger
	models   map[string]*modelPool // by name and alias
	pools    []*modelPool
	backends []*backend
	metrics  *metrics
	watcher  *hangupWatcher
	srv      *fasthttp.Server
	health   *backends.Prober

	reqPrefix string
	reqSeq    atomic.Uint64
	bufs      sync.Pool
}

type modelPool struct {
	cfg      config.Model
	enc      *tokenize.Encoder
	rt       *router.Router
	byWorker []*backend // indexed by router.WorkerID
}

type backend struct {
	cfg    config.Backend
	pool   *modelPool
	worker router.WorkerID
	up     *backends.Upstream
	host   string
}

// New builds the pools and backends of cfg; Serve starts answering.
func New(cfg *config.Config, opts Options) (*Server, error) {
	s := &Server{cfg: cfg, log: opts.Logger, models: map[string]*modelPool{}, watcher: newHangupWatcher()}
	var rb [6]byte
	rand.Read(rb[:])
	s.reqPrefix = hex.EncodeToString(rb[:])
	for _, mc := range cfg.Models {
		tok, err := tokenize.Get(mc.Tokenizer)
		if err != nil {
			return nil, fmt.Errorf("model %s: %w", mc.Name, err)
		}
		tmpl, err := tokenize.GetTemplate(mc.Template)
		if err != nil {
			return nil, fmt.Errorf("model %s: %w", mc.Name, err)
		}
		rt, err := router.New(routerConfig(cfg, mc))
		if err != nil {
			return nil, fmt.Errorf("model %s: %w", mc.Name, err)
		}
		p := &modelPool{cfg: mc, enc: tokenize.NewEncoder(tok, tmpl, 0), rt: rt}
		s.pools = append(s.pools, p)
		s.models[mc.Name] = p
		for _, a := range mc.Aliases {
			s.models[a] = p
		}
	}
	for _, bc := range cfg.Backends {
		p := s.models[bc.Model]
		u, _ := url.Parse(bc.URL)
		host := u.Host
		if u.Port() == "" {
			host = net.JoinHostPort(u.Hostname(), "80")
		}
		b := &backend{cfg: bc, pool: p, host: u.Host, up: &backends.Upstream{
			Addr:        host,
			DialTimeout: cfg.Limits.UpstreamConnectTime,
			ReadTimeout: cfg.Limits.StreamIdleTimeout,
			MaxIdle:     cfg.Limits.MaxConnsPerBackend,
		}}
		b.worker = p.rt.AddWorker(bc.ID)
		for int(b.worker) >= len(p.byWorker) {
			p.byWorker = append(p.byWorker, nil)
		}
		p.byWorker[b.worker] = b
		s.backends = append(s.backends, b)
	}
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	s.metrics = newMetrics(reg, s)
	s.srv = &fasthttp.Server{
		Handler:               s.handle,
		Name:                  "kvproxy",
		NoDefaultServerHeader: true,
		MaxRequestBodySize:    cfg.Limits.MaxRequestBodyBytes,
		ReadTimeout:           60 * time.Second, // a whole request must arrive within this
		IdleTimeout:           120 * time.Second,
		// No WriteTimeout: it would cut long streams; streams have an idle timer.
		ReadBufferSize:               16 << 10,
		DisablePreParseMultipartForm: true,
		ErrorHandler:                 s.transportError,
		Logger:                       fasthttpLogger{s.log},
	}
	interval := opts.HealthInterval
	if interval == 0 {
		interval = 2 * time.Second
	}
	if interval > 0 {
		s.health = backends.NewProber(backends.ProbeConfig{Interval: interval, Timeout: time.Second, Rise: 1, Fall: 2})
		for _, b := range s.backends {
			b := b
			s.health.Add(b.cfg.ID, "http://"+b.up.Addr+"/health", func(healthy bool) {
				b.pool.rt.SetAvailable(b.worker, healthy)
				if healthy {
					s.log.Info().Str("backend", b.cfg.ID).Msg("backend healthy")
				} else {
					s.log.Warn().Str("backend", b.cfg.ID).Msg("backend unhealthy")
				}
			})
		}
	}
	return s, nil
}

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
	return rc
}

// Serve answers on ln until Shutdown.
func (s *Server) Serve(ln net.Listener) error {
	if s.health != nil {
		s.health.Start()
	}
	return s.srv.Serve(ln)
}

// Shutdown stops accepting, waits for in-flight requests, and stops probes.
func (s *Server) Shutdown() error {
	if s.health != nil {
		s.health.Stop()
	}
	err := s.srv.Shutdown()
	for _, b := range s.backends {
		b.up.CloseIdle()
	}
	return err
}

// Idle reports whether every load counter of every worker is zero.
func (s *Server) Idle() bool {
	for _, p := range s.pools {
		if !p.rt.Idle() {
			return false
		}
	}
	return true
}

func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	path := string(ctx.Path())
	method := string(ctx.Method())
	switch path {
	case "/v1/chat/completions", "/v1/completions":
		if method != fasthttp.MethodPost {
			methodNotAllowed(ctx, "POST")
			return
		}
		s.handleCompletion(ctx, path == "/v1/chat/completions")
	case "/v1/models":
		s.handleModels(ctx)
	case "/health", "/healthz":
		s.handleHealth(ctx)
	case "/metrics":
		s.metrics.serve(ctx)
	case "/admin/backends":
		s.handleAdminBackends(ctx)
	default:
		writeError(ctx, fasthttp.StatusNotFound, "unknown path "+strconv.Quote(path), "invalid_request_error", "", "not_found")
	}
}

func methodNotAllowed(ctx *fasthttp.RequestCtx, allow string) {
	ctx.Response.Header.Set("Allow", allow)
	writeError(ctx, fasthttp.StatusMethodNotAllowed, "method not allowed; use "+allow, "invalid_request_error", "", "method_not_allowed")
}

// transportError answers requests fasthttp rejects before the handler:
// oversized bodies, malformed HTTP, timeouts.
func (s *Server) transportError(ctx *fasthttp.RequestCtx, err error) {
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		writeError(ctx, fasthttp.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds the limit of %d bytes", s.cfg.Limits.MaxRequestBodyBytes), "invalid_request_error", "", "request_too_large")
	default:
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			writeError(ctx, fasthttp.StatusRequestTimeout, "request not received in time", "invalid_request_error", "", "request_timeout")
			return
		}
		writeError(ctx, fasthttp.StatusBadRequest, "malformed HTTP request", "invalid_request_error", "", "bad_request")
	}
}

func (s *Server) newRequestID() string {
	return "req-" + s.reqPrefix + "-" + strconv.FormatUint(s.reqSeq.Add(1), 36)
}

type fasthttpLogger struct{ l zerolog.Logger }

func (f fasthttpLogger) Printf(format string, args ...any) {
	f.l.Debug().Msgf(format, args...)
}

// scratch holds per-request buffers reused across requests.
type scratch struct {
	tokens []uint32
	hashes []kv.BlockHash
}

func (s *Server) getScratch() *scratch {
	if v := s.bufs.Get(); v != nil {
		return v.(*scratch)
	}
	return &scratch{}
}

func (s *Server) putScratch(sc *scratch) {
	if cap(sc.tokens) > 1<<20 {
		sc.tokens = nil // don't pin the memory of one huge prompt
	}
	sc.tokens, sc.hashes = sc.tokens[:0], sc.hashes[:0]
	s.bufs.Put(sc)
}
