// Command kvproxy is an OpenAI-compatible reverse proxy that routes each
// request to the engine already caching the longest part of its prompt.
//
//	kvproxy -config config.yaml [-listen 127.0.0.1:8080]
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/signal"
	"syscall"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/mockengine"
	"github.com/kvproxy/kvproxy/proxy"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "tokenize" {
		os.Exit(tokenizeCmd(os.Args[2:], os.Stdin, os.Stdout, os.Stderr))
	}
	os.Exit(run())
}

func run() int {
	cfgPath := flag.String("config", "config.example.yaml", "path to the YAML config")
	listen := flag.String("listen", "", "listen address, overrides the config's listen")
	drainFlag := flag.Duration("drain-timeout", 0, "how long SIGTERM waits for in-flight requests (default: limits.drain_timeout)")
	flag.Parse()

	log := zerolog.New(os.Stderr).With().Timestamp().Logger()
	cfg, err := config.Load(*cfgPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy:", err)
		return 2
	}
	if *listen != "" {
		cfg.Listen = *listen
	}
	if lvl, err := zerolog.ParseLevel(cfg.LogLevel); err == nil {
		log = log.Level(lvl)
	}

	mocks := map[string]*mockengine.Engine{}
	defer func() {
		for _, m := range mocks {
			m.Close()
		}
	}()
	if err := startMocks(cfg, mocks, log); err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy:", err)
		return 1
	}

	srv, err := proxy.New(cfg, proxy.Options{Logger: log})
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy:", err)
		return 1
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy:", err)
		return 1
	}
	log.Info().Str("listen", ln.Addr().String()).Int("backends", len(cfg.Backends)).
		Str("policy", cfg.Router.Policy).Msg("kvproxy serving")

	reload := func() (*config.Config, error) {
		next, err := config.Load(*cfgPath)
		if err != nil {
			return nil, err
		}
		next.Listen = cfg.Listen
		if err := startMocks(next, mocks, log); err != nil {
			return nil, err
		}
		return next, nil
	}
	proxy.ReloadFunc = reload

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
wait:
	for {
		select {
		case err := <-errc:
			log.Error().Err(err).Msg("server stopped")
			return 1
		case sig := <-sigs:
			if sig == syscall.SIGHUP {
				next, err := reload()
				if err == nil {
					err = srv.Reload(next)
				}
				if err != nil {
					log.Error().Err(err).Msg("reload rejected; the current configuration keeps serving")
				}
				continue
			}
			break wait
		}
	}
	drain := cfg.Limits.DrainTimeout
	if *drainFlag > 0 {
		drain = *drainFlag
	}
	log.Info().Str("drain_timeout", drain.String()).Msg("draining")
	ctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- srv.Shutdown() }()
	select {
	case <-done:
		log.Info().Msg("drained, exiting")
	case <-ctx.Done():
		log.Warn().Msg("drain timeout, exiting with requests in flight")
	}
	return 0
}

// startMocks runs, in-process, the simulated engines of kind: mock backends
// not yet running.
func startMocks(cfg *config.Config, running map[string]*mockengine.Engine, log zerolog.Logger) error {
	for _, b := range cfg.Backends {
		if b.Kind != config.KindMock || running[b.ID] != nil {
			continue
		}
		m, _ := cfg.ModelByName(b.Model)
		mc := mockengine.DefaultConfig()
		mc.ID = b.ID
		mc.Model = b.ServedModel
		mc.BlockSize = m.BlockSize
		mc.Tokenizer = m.Tokenizer
		mc.Template = m.Template
		if b.Mock.CacheBlocks > 0 {
			mc.CacheBlocks = b.Mock.CacheBlocks
		}
		if b.Mock.HostCacheBlocks > 0 {
			mc.HostCacheBlocks = b.Mock.HostCacheBlocks
		}
		if b.Mock.MaxNumSeqs > 0 {
			mc.MaxNumSeqs = b.Mock.MaxNumSeqs
		}
		if b.Mock.MaxNumBatchedTokens > 0 {
			mc.MaxNumBatchedTokens = b.Mock.MaxNumBatchedTokens
		}
		if b.Mock.Speedup > 0 {
			mc.Speedup = b.Mock.Speedup
		}
		if b.Mock.Seed != 0 {
			mc.Seed = b.Mock.Seed
		}
		e, err := mockengine.New(mc)
		if err != nil {
			return fmt.Errorf("mock backend %s: %w", b.ID, err)
		}
		u, _ := url.Parse(b.URL)
		addr, err := e.Start(u.Host)
		if err != nil {
			return fmt.Errorf("mock backend %s: %w", b.ID, err)
		}
		if b.KVEvents.Mode == config.EventsZMQ {
			pub, err := mockengine.NewPublisher(mockengine.PublisherConfig{
				Endpoint: b.KVEvents.Endpoint, ReplayEndpoint: b.KVEvents.Replay, Topic: b.KVEvents.Topic,
			})
			if err != nil {
				e.Close()
				return fmt.Errorf("mock backend %s: event publisher: %w", b.ID, err)
			}
			e.PublishEvents(pub)
			log.Info().Str("backend", b.ID).Str("publisher", pub.Endpoint()).Msg("simulated engine publishes KV events")
		}
		log.Info().Str("backend", b.ID).Str("addr", addr).Msg("simulated engine started")
		running[b.ID] = e
	}
	return nil
}
