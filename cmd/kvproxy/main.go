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
	"time"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/mockengine"
	"github.com/kvproxy/kvproxy/proxy"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "tokenize" {
		os.Exit(tokenizeCmd(os.Args[2:]))
	}
	os.Exit(run())
}

func run() int {
	cfgPath := flag.String("config", "config.example.yaml", "path to the YAML config")
	listen := flag.String("listen", "", "listen address, overrides the config's listen")
	drain := flag.Duration("drain-timeout", 30*time.Second, "how long SIGTERM waits for in-flight requests")
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

	mocks, err := startMocks(cfg, log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy:", err)
		return 1
	}
	defer func() {
		for _, m := range mocks {
			m.Close()
		}
	}()

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

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	select {
	case err := <-errc:
		log.Error().Err(err).Msg("server stopped")
		return 1
	case sig := <-sigs:
		log.Info().Str("signal", sig.String()).Dur("drain_timeout", *drain).Msg("draining")
	}
	ctx, cancel := context.WithTimeout(context.Background(), *drain)
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

// startMocks runs the simulated engines of kind: mock backends in-process.
func startMocks(cfg *config.Config, log zerolog.Logger) ([]*mockengine.Engine, error) {
	var out []*mockengine.Engine
	for _, b := range cfg.Backends {
		if b.Kind != config.KindMock {
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
			return out, fmt.Errorf("mock backend %s: %w", b.ID, err)
		}
		u, _ := url.Parse(b.URL)
		addr, err := e.Start(u.Host)
		if err != nil {
			return out, fmt.Errorf("mock backend %s: %w", b.ID, err)
		}
		log.Info().Str("backend", b.ID).Str("addr", addr).Msg("simulated engine started")
		out = append(out, e)
	}
	return out, nil
}
