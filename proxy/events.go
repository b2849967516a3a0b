package proxy

import (
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

// startEvents begins following the backend's KV events (mode zmq or http);
// its workers then leave approximate mode.
func (b *backend) startEvents() {
	mode := b.cfg.KVEvents.Mode
	if b.feed != nil {
		return
	}
	if mode == config.EventsNone {
		// The worker may be handed over from a configuration with events:
		// without them, the router must record its own decisions again.
		b.pool.rt.SetApproximate(b.worker, true)
		return
	}
	f, err := backends.StartKVFeed(backends.KVFeedConfig{
		Backend: b.cfg.ID, Mode: mode, BlockSize: b.pool.cfg.BlockSize, DPSize: b.cfg.KVEvents.DPSize, MaxBlocks: b.pool.rt.IndexCapacity(),
		ZMQ: backends.ZMQConfig{Endpoint: b.cfg.KVEvents.Endpoint, ReplayEndpoint: b.cfg.KVEvents.Replay, Topic: b.cfg.KVEvents.Topic,
			OnChange: (&feedLog{log: b.log, backend: b.cfg.ID}).change},
	}, rankWorkers{b.pool.rt, b.rankGroup})
	if err != nil { // config validation makes this unreachable
		b.log.Error().Err(err).Str("backend", b.cfg.ID).Msg("kv events not started")
		return
	}
	b.setFeed(f)
}

// rankWorkers is the router as a feed sees it: the data-parallel ranks it
// adds join the peer group of the backend that has the feed now (a reload
// that keeps the feed may change the role: rankGroup is handed over with it).
type rankWorkers struct {
	*router.Router
	group *atomic.Int32
}

func (w rankWorkers) AddWorker(name string) router.WorkerID {
	id := w.Router.AddWorker(name)
	for { // a reload may change the group meanwhile (then adoptRanks sets it too)
		g := w.group.Load()
		w.SetPeerGroup(id, int(g))
		if w.group.Load() == g {
			return id
		}
	}
}

// setFeed sets b's event feed under its lock: a request its predecessor
// took may be releasing a slot now that b owns the count (shareSlots runs
// first), and reads the feed for b's workers (the reload chaos trial's race
// detector).
func (b *backend) setFeed(f *backends.KVFeed) {
	b.mu.Lock()
	b.feed = f
	b.mu.Unlock()
}

// feedLog writes what an operator needs of an event feed's health: its
// first connection, a problem (a warning, then at most once a minute while
// the same kind of problem lasts, as a dial retried every few seconds
// would), and the connection that ends a problem. The details stay in
// /admin/backends' kv_events. The feeds of a backend's data-parallel
// ranks share it.
type feedLog struct {
	log     zerolog.Logger
	backend string

	mu        sync.Mutex
	connected bool   // a connection has been logged and no problem since
	kind      string // the kind of problem last warned of, while it lasts
	lastWarn  time.Time
}

func (f *feedLog) change(problem string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if problem == "" {
		if !f.connected {
			f.log.Info().Str("backend", f.backend).Msg("kv event feed connected")
		}
		f.connected, f.kind = true, ""
		return
	}
	f.connected = false
	kind, _, _ := strings.Cut(problem, " ") // dial, connection, malformed, cleared:, replay
	if kind == f.kind && time.Since(f.lastWarn) < time.Minute {
		return
	}
	f.kind, f.lastWarn = kind, time.Now()
	f.log.Warn().Str("backend", f.backend).Str("problem", problem).Msg("kv event feed problem (the index of this backend may be behind; see kv_events in /admin/backends)")
}

// sameFeed reports whether next, replacing b, follows the same engine's
// events the same way, so b's feed can go on as next's.
func (b *backend) sameFeed(next *backend) bool {
	return b.feed != nil && b.pool == next.pool && b.cfg.URL == next.cfg.URL && b.cfg.KVEvents == next.cfg.KVEvents
}

// stopEvents ends the feed and drops every block the backend's workers hold.
func (b *backend) stopEvents() {
	if b.feed != nil {
		b.feed.Close()
	}
}

// workerIDs are the router workers of the backend: rank 0, the ranks it
// took over from the backend it replaced (adoptRanks), and one per
// data-parallel rank its events have named.
func (b *backend) workerIDs() []router.WorkerID {
	ids := append([]router.WorkerID{b.worker}, b.ranks...)
	if b.feed == nil {
		return ids
	}
	for _, id := range b.feed.Applier().WorkerIDs() {
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	return ids
}

// dataParallel reports whether b routes to its engine's data-parallel
// ranks: it has rank workers (from dp_size, or from the ranks its events
// name). Without events the engine balances over its ranks itself.
func (b *backend) dataParallel() bool {
	return len(b.ranks) > 0 || b.feed != nil && b.feed.Applier().MultiRank()
}

// rankWorkers are the live router workers of the data-parallel ranks r > 0
// of b's id in its pool, whichever backend of that id registered them.
func (b *backend) rankWorkers() []router.WorkerStatus {
	var out []router.WorkerStatus
	for _, w := range b.pool.rt.Workers() {
		if !w.Removed && w.Name != b.cfg.ID && b.owns(w.Name) {
			out = append(out, w)
		}
	}
	return out
}

// adoptRanks makes b, before it takes requests, the owner of the rank
// workers of its id that it still has (keepsRank): those of prev, the
// backend b replaces in a reload (nil if none), or of a removed one of the
// same id still draining. The others leave the router: a rank worker no
// backend owns outlived its backend (requests chosen for it got 503), and
// one past the new configuration's ranks sent requests with a rank header
// the engine may not have.
func (b *backend) adoptRanks(prev *backend) {
	for _, w := range b.rankWorkers() {
		if !b.keepsRank(prev, dpRank(w.Name)) {
			b.pool.rt.RemoveWorker(w.ID)
			continue
		}
		b.mu.Lock() // read by a release's markFull, as the feed is (setFeed)
		b.ranks = append(b.ranks, w.ID)
		b.mu.Unlock()
		b.pool.rt.SetAvailable(w.ID, true) // as rank 0 (newBackend); b's state applies from now on
		b.pool.rt.SetPeerGroup(w.ID, peerGroup(b.cfg.Role))
	}
}

// keepsRank reports whether data-parallel rank r > 0 of the engine behind
// b's id is still one of b's: zmq events subscribe to ranks below dp_size;
// http ones are pushed by the engine, which prev knew at the same URL, and
// are below dp_size when it is set (a lowered dp_size kept the ranks it
// dropped; found by the ninth session's second review).
func (b *backend) keepsRank(prev *backend, r int) bool {
	dp := b.cfg.KVEvents.DPSize
	switch b.cfg.KVEvents.Mode {
	case config.EventsZMQ:
		return r > 0 && r < dp
	case config.EventsHTTP:
		return r > 0 && prev != nil && prev.cfg.URL == b.cfg.URL && (dp <= 0 || r < dp)
	}
	return false
}

// rankBackend is the backend a data-parallel rank's worker ("id#r") belongs
// to, and the rank; nil for any other name.
func (st *state) rankBackend(name string) (*backend, int) {
	i := strings.LastIndexByte(name, '#')
	if i < 0 {
		return nil, 0
	}
	return st.backends[name[:i]], dpRank(name)
}

// dpRank parses the data-parallel rank out of a worker name ("id#3").
func dpRank(name string) int {
	if i := strings.LastIndexByte(name, '#'); i >= 0 {
		if r, err := strconv.Atoi(name[i+1:]); err == nil {
			return r
		}
	}
	return 0
}

// handleKVEvents takes a pushed JSON batch (POST /v1/kv_events) for a
// backend in http event mode. A malformed batch changes nothing.
func (s *Server) handleKVEvents(ctx *fasthttp.RequestCtx, st *state) {
	body, ok := s.requestBody(ctx, st.cfg.Limits.MaxRequestBodyBytes)
	if !ok {
		return
	}
	batch, err := kv.ParseHTTPBatch(body)
	if err != nil {
		var be *kv.HTTPBatchError
		param := ""
		if errors.As(err, &be) {
			param = be.Path
		}
		badRequest(ctx, param, "malformed KV event batch: "+err.Error())
		return
	}
	b := st.backends[batch.EngineID]
	switch {
	case b == nil:
		badRequest(ctx, "engine_id", "no backend has id "+strconv.Quote(batch.EngineID))
		return
	case b.feed == nil || b.cfg.KVEvents.Mode != config.EventsHTTP:
		badRequest(ctx, "engine_id", "backend "+strconv.Quote(batch.EngineID)+" does not take pushed events (set kv_events.mode: http)")
		return
	case batch.Model != "" && batch.Model != b.cfg.Model && batch.Model != b.cfg.ServedModel:
		badRequest(ctx, "model", "backend "+strconv.Quote(batch.EngineID)+" serves "+strconv.Quote(b.cfg.Model)+", not "+strconv.Quote(batch.Model))
		return
	}
	applied := b.feed.Push(batch)
	b.eventsPushed.Add(uint64(len(batch.Events)))
	// Not those of a KV cache group other than the one followed.
	writeJSON(ctx, map[string]any{"applied": applied})
}

// scrapeStatus is a backend's last /metrics scrape.
type scrapeStatus struct {
	ok  bool
	err string
	m   backends.EngineMetrics
	at  time.Time
}

// scrapeLoop reads every backend's /metrics once a second and feeds the
// engine's own load view to the router.
func (s *Server) scrapeLoop(stop <-chan struct{}) {
	scraper := &backends.MetricsScraper{Timeout: 800 * time.Millisecond}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	first := true
	for {
		st := s.st.Load()
		var wg sync.WaitGroup
		for _, b := range st.backends {
			wg.Add(1)
			go func(b *backend) {
				defer wg.Done()
				b.pollAdapters(scraper)
				m, ranks, err := scraper.ScrapeRanks(b.base+"/metrics", b.cfg.InsecureSkipVerify, nil)
				ss := &scrapeStatus{ok: err == nil, m: m, at: time.Now()}
				if err != nil {
					ss.err = err.Error()
				} else {
					b.setEngineLoad(m, ranks)
				}
				b.scrape.Store(ss)
			}(b)
		}
		wg.Wait()
		if first {
			close(s.listsRead)
			first = false
		}
		select {
		case <-stop:
			return
		case <-tick.C:
		}
	}
}

// setEngineLoad gives the backend's workers the load its engine reports:
// each data-parallel rank's worker that of its own engine (vLLM's series
// labelled engine="r"), as a request routed to a rank goes to that engine.
// A backend with no rank workers (events off, or no other rank seen yet)
// is one worker for the whole engine, which places requests among its
// ranks itself: it gets the total.
func (b *backend) setEngineLoad(total backends.EngineMetrics, ranks []backends.RankMetrics) {
	ids := b.workerIDs()
	if len(ids) == 1 {
		b.setWorkerLoad(b.worker, total)
		return
	}
	for _, rm := range ranks {
		w := b.worker
		if rm.Rank > 0 {
			id, ok := b.pool.rt.WorkerByName(backends.WorkerName(b.cfg.ID, rm.Rank))
			if !ok || !slices.Contains(ids, id) {
				continue // a rank this backend has no worker for
			}
			w = id
		}
		b.setWorkerLoad(w, rm.EngineMetrics)
	}
}

func (b *backend) setWorkerLoad(w router.WorkerID, m backends.EngineMetrics) {
	b.pool.rt.SetEngineLoad(w, m.Waiting, m.Running, m.KVUsage)
	if m.CacheBlocks > 0 {
		blocks := float64(m.CacheBlocks) // in the router's blocks
		if bs := b.pool.cfg.BlockSize; m.CacheBlockSize > 0 && bs > 0 {
			blocks = blocks * float64(m.CacheBlockSize) / float64(bs)
		}
		b.pool.rt.SetEngineCapacity(w, blocks)
	}
}

// eventCounters are shown per backend in /admin/backends.
type eventCounters struct {
	Mode          string           `json:"mode"`
	Connected     *bool            `json:"connected,omitempty"`
	Events        uint64           `json:"events_received"`
	LastSeq       *int64           `json:"last_seq,omitempty"`
	Replays       uint64           `json:"replays"`
	Clears        uint64           `json:"clears"`
	OrphanBlocks  uint64           `json:"orphan_blocks"`
	SizeMismatch  uint64           `json:"block_size_mismatch"`
	UnknownCopies uint64           `json:"unknown_copies"`             // offloaded copies of blocks not indexed
	OverCapacity  uint64           `json:"over_capacity_blocks"`       // stored blocks past what the feed tracks
	Malformed     uint64           `json:"malformed_events,omitempty"` // zmq: events skipped in applied batches
	DecodeErrors  uint64           `json:"decode_errors,omitempty"`    // zmq: whole batches unreadable (each clears)
	BlocksPerTier map[string]int64 `json:"blocks_per_tier"`
	// Stale: the zmq feed has been down too long to vouch for the index;
	// the backend is routed on kvproxy's own records until it is back.
	Stale     bool   `json:"stale,omitempty"`
	LastError string `json:"last_error,omitempty"`
}

func (b *backend) eventCounters() *eventCounters {
	if b.feed == nil {
		return &eventCounters{Mode: config.EventsNone}
	}
	fs := b.feed.Stats()
	as := fs.Apply
	c := &eventCounters{Mode: b.cfg.KVEvents.Mode, Clears: as.Clears, OrphanBlocks: as.OrphanBlocks, SizeMismatch: as.BlockSizeMismatch,
		UnknownCopies: as.UnknownCopies, OverCapacity: as.OverCapacity, BlocksPerTier: map[string]int64{}, Events: b.eventsPushed.Load()}
	for t := kv.Tier(0); t < kv.NumTiers; t++ {
		c.BlocksPerTier[t.String()] = as.Blocks[t]
	}
	if zs := fs.ZMQ; zs != nil {
		c.Connected, c.LastSeq = &zs.Connected, &zs.LastSeq
		c.Events, c.Replays, c.LastError = zs.Events, zs.Replays, zs.LastError
		c.Malformed, c.DecodeErrors, c.Stale = zs.MalformedEvents, zs.DecodeErrors, zs.Stale
	}
	return c
}
