package main

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/mockengine"
)

// mockFleet runs, in-process, the simulated engines of the kind: mock
// backends of the configuration in force. A reload starts the mocks it adds
// (start), then either keeps them and retires the mocks it dropped (commit)
// or, rejected, stops what it started (abort). Callers serialise reloads.
type mockFleet struct {
	log zerolog.Logger
	// listen opens a mock's listener (net.Listen; tests wrap it).
	listen   func(network, addr string) (net.Listener, error)
	mu       sync.Mutex
	running  map[string]*mockRun // by backend id
	retiring map[*mockRun]bool
	retired  sync.WaitGroup
}

// mockRun is one simulated engine and its KV event publisher (if any).
type mockRun struct {
	id   string
	key  mockKey
	ln   *connListener
	e    *mockengine.Engine
	feed *mockengine.EventFeed
	pub  *mockengine.Publisher
}

// mockKey is what a mock was started with. A running mock cannot change
// it in place: its address and cache are the engine itself.
type mockKey struct {
	url, servedModel    string
	mock                config.MockEngine
	events              config.KVEvents
	blockSize           int
	tokenizer, template string
	adapters            string // the model's, joined: the LoRA modules it serves
}

func keyOf(cfg *config.Config, b config.Backend) mockKey {
	k := mockKey{url: b.URL, servedModel: b.ServedModel, mock: b.Mock, events: b.KVEvents}
	if m, ok := cfg.ModelByName(b.Model); ok {
		k.blockSize, k.tokenizer, k.template = m.BlockSize, m.Tokenizer, m.Template
		k.adapters = strings.Join(m.Adapters, "\x00")
	}
	return k
}

func newMockFleet(log zerolog.Logger) *mockFleet {
	return &mockFleet{log: log, listen: net.Listen, running: map[string]*mockRun{}, retiring: map[*mockRun]bool{}}
}

// start runs the mocks of cfg not running yet and returns them; nothing is
// left running if it fails. A running mock whose settings differ in cfg is
// an error: it keeps serving as it is.
func (f *mockFleet) start(cfg *config.Config) ([]*mockRun, error) {
	// Every refused engine is named: a change of the model's settings
	// changes all of its engines.
	var changed []string
	f.mu.Lock()
	for _, b := range cfg.Backends {
		if r := f.running[b.ID]; r != nil && b.Kind == config.KindMock && r.key != keyOf(cfg, b) {
			changed = append(changed, b.ID)
		}
	}
	f.mu.Unlock()
	if len(changed) > 0 {
		return nil, fmt.Errorf("backends %s: a running mock engine's url, mock, kv_events and model settings cannot change on reload; restart kvproxy, or remove the backend in one reload and add it back in the next", strings.Join(changed, ", "))
	}
	var started []*mockRun
	for i, b := range cfg.Backends {
		if b.Kind != config.KindMock {
			continue
		}
		key := keyOf(cfg, b)
		f.mu.Lock()
		r := f.running[b.ID]
		draining := false
		for old := range f.retiring {
			draining = draining || old.id == b.ID
		}
		f.mu.Unlock()
		if r == nil && draining {
			f.abort(started)
			return nil, fmt.Errorf("backends[%d] (%s): the mock engine a previous reload removed is still draining (up to limits.drain_timeout); reload again once it has stopped", i, b.ID)
		}
		if r != nil {
			continue // unchanged: checked above
		}
		r, err := f.startOne(cfg, b, key)
		if err != nil {
			f.abort(started)
			return nil, err
		}
		started = append(started, r)
	}
	return started, nil
}

func (f *mockFleet) startOne(cfg *config.Config, b config.Backend, key mockKey) (*mockRun, error) {
	e, err := mockengine.New(mockConfig(cfg, b, key))
	if err != nil {
		return nil, fmt.Errorf("mock backend %s: %w", b.ID, err)
	}
	u, _ := url.Parse(b.URL)
	ln, err := f.listen("tcp", u.Host)
	if err != nil {
		e.Close()
		return nil, fmt.Errorf("mock backend %s: %w", b.ID, err)
	}
	addr := ln.Addr().String()
	r := &mockRun{id: b.ID, key: key, e: e, ln: newConnListener(ln)}
	go e.Serve(r.ln)
	if b.KVEvents.Mode == config.EventsZMQ {
		pub, err := mockengine.NewPublisher(mockengine.PublisherConfig{
			Endpoint: b.KVEvents.Endpoint, ReplayEndpoint: b.KVEvents.Replay, Topic: b.KVEvents.Topic,
		})
		if err != nil {
			e.Close()
			r.ln.Close()
			return nil, fmt.Errorf("mock backend %s: event publisher: %w", b.ID, err)
		}
		r.pub = pub
		r.feed = e.PublishEvents(pub)
		f.log.Info().Str("backend", b.ID).Str("publisher", pub.Endpoint()).Msg("simulated engine publishes KV events")
	}
	f.log.Info().Str("backend", b.ID).Str("addr", addr).Msg("simulated engine started")
	return r, nil
}

// mockConfig is the simulated engine of backend b, as key describes it.
func mockConfig(cfg *config.Config, b config.Backend, key mockKey) mockengine.Config {
	mc := mockengine.DefaultConfig()
	mc.ID = b.ID
	mc.Model = b.ServedModel
	if m, ok := cfg.ModelByName(b.Model); ok {
		mc.LoRAModules = m.Adapters // the adapters it is configured to serve
	}
	mc.BlockSize = key.blockSize
	if key.tokenizer != config.TokenizerEngine {
		// With tokenizer "engine", kvproxy asks the engine's /tokenize:
		// the simulated one answers with its default tokenizer's ids,
		// which its cache keys on too. It was refused as an unknown
		// tokenizer (the twenty-sixth session's docs review).
		mc.Tokenizer = key.tokenizer
	}
	mc.Template = key.template
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
	mc.MaxLoRAs = b.Mock.MaxLoRAs
	mc.DuplicateBlocks = b.Mock.DuplicateBlocks
	return mc
}

// retirements tells when the proxy is done with a backend's engine
// (proxy.Server.AwaitRetired).
type retirements interface {
	AwaitRetired(ctx context.Context, id, url string) error
}

// commit makes started part of the fleet and retires every mock cfg no
// longer has, once srv (which has applied cfg) has retired its backend:
// its requests are over, none can be routed to it any more and the proxy's
// pooled connections to it are closed. It then waits for its other
// connections (probes, clients of its own) to close, all of it bounded by
// cfg's drain_timeout. Its own idleness is not enough: a request routed
// just before the reload may still be dialing, its connection in the
// kernel's backlog and counted nowhere, and stopping the engine then
// resets it (a 502 in a test's run under load). Nor is closing its
// listener first: a connection the kernel already accepted would be reset.
func (f *mockFleet) commit(cfg *config.Config, started []*mockRun, srv retirements) {
	keep := map[string]bool{}
	for _, b := range cfg.Backends {
		if b.Kind == config.KindMock {
			keep[b.ID] = true
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range started {
		f.running[r.id] = r
	}
	for id, r := range f.running {
		if keep[id] {
			continue
		}
		delete(f.running, id)
		f.retiring[r] = true
		f.retired.Add(1)
		go func() {
			defer f.retired.Done()
			ctx, cancel := context.WithTimeout(context.Background(), cfg.Limits.DrainTimeout)
			srv.AwaitRetired(ctx, r.id, r.key.url)
			r.ln.waitClosed(ctx)
			cancel()
			r.close()
			f.mu.Lock()
			delete(f.retiring, r)
			f.mu.Unlock()
			f.log.Info().Str("backend", r.id).Msg("simulated engine stopped")
		}()
	}
}

// abort stops mocks start returned for a reload that was rejected.
func (f *mockFleet) abort(started []*mockRun) {
	for _, r := range started {
		r.close()
	}
}

// close stops every mock, running or retiring.
func (f *mockFleet) close() {
	f.mu.Lock()
	var all []*mockRun
	for _, r := range f.running {
		all = append(all, r)
	}
	for r := range f.retiring {
		all = append(all, r)
	}
	f.running = map[string]*mockRun{}
	f.mu.Unlock()
	for _, r := range all {
		r.close()
	}
	f.retired.Wait()
}

// close stops the engine and its publisher. Safe to call more than once.
func (r *mockRun) close() {
	if r.feed != nil {
		r.feed.Stop()
	}
	if r.pub != nil {
		r.pub.Close()
	}
	r.e.Close()
	// The engine closes only the listeners its Serve has taken: one
	// started just before (a reload rejected at its next mock) would be
	// closed later by Serve's goroutine, its port still taken when the
	// answer said the reload was rejected. Closing twice is harmless.
	r.ln.Close()
}

// connListener is a listener that knows how many of its connections are
// open.
type connListener struct {
	net.Listener
	mu      sync.Mutex
	open    int
	changed chan struct{} // closed and replaced when open drops
}

func newConnListener(ln net.Listener) *connListener {
	return &connListener{Listener: ln, changed: make(chan struct{})}
}

func (l *connListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	l.open++
	l.mu.Unlock()
	return &countedConn{Conn: c, l: l}, nil
}

// waitClosed waits until every accepted connection is closed, or ctx ends.
func (l *connListener) waitClosed(ctx context.Context) {
	for {
		l.mu.Lock()
		open, ch := l.open, l.changed
		l.mu.Unlock()
		if open == 0 {
			return
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return
		}
	}
}

type countedConn struct {
	net.Conn
	l    *connListener
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() {
		c.l.mu.Lock()
		c.l.open--
		close(c.l.changed)
		c.l.changed = make(chan struct{})
		c.l.mu.Unlock()
	})
	return c.Conn.Close()
}
