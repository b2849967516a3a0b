package proxy

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"time"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

type modelJSON struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	Root    string `json:"root,omitempty"`
	// Parent is the base model of a LoRA adapter, as vLLM lists adapters.
	Parent string `json:"parent,omitempty"`
	// MaxModelLen is the context length the model's engines list (the
	// largest: requests go where they fit), which clients size prompts by;
	// left out while unknown.
	MaxModelLen int `json:"max_model_len,omitempty"`
}

// modelCards lists m, its aliases and its adapters as /v1/models does.
func modelCards(data []modelJSON, m *config.Model, st *state) []modelJSON {
	maxLen := 0
	if p := st.models[m.Name]; p != nil {
		maxLen = p.maxModelLen(st.cfg.Limits.MaxPromptTokens)
	}
	data = append(data, modelJSON{ID: m.Name, Object: "model", Created: startTime, OwnedBy: "kvproxy", MaxModelLen: maxLen})
	for _, a := range m.Aliases {
		data = append(data, modelJSON{ID: a, Object: "model", Created: startTime, OwnedBy: "kvproxy", Root: m.Name, MaxModelLen: maxLen})
	}
	for _, a := range m.Adapters {
		data = append(data, modelJSON{ID: a, Object: "model", Created: startTime, OwnedBy: "kvproxy", Parent: m.Name, MaxModelLen: maxLen})
	}
	return data
}

var startTime = time.Now().Unix()

// handleModels lists the models the client's tenant may use.
func (s *Server) handleModels(ctx *fasthttp.RequestCtx, st *state) {
	s.requestIDs(ctx)
	t := st.auth.client(ctx)
	var data []modelJSON
	for i := range st.cfg.Models {
		if t.mayUse(st.models[st.cfg.Models[i].Name]) {
			data = modelCards(data, &st.cfg.Models[i], st)
		}
	}
	for _, p := range st.pools {
		if t.mayUse(p) {
			data = p.listedAdapters(data, st.cfg.Limits.MaxPromptTokens)
		}
	}
	// Engines of two models may list one adapter name: once, as the
	// first model's, which a request of that name goes to (poolOfAdapter).
	seen := make(map[string]bool, len(data))
	data = slices.DeleteFunc(data, func(m modelJSON) bool {
		dup := seen[m.ID]
		seen[m.ID] = true
		return dup
	})
	writeJSON(ctx, map[string]any{"object": "list", "data": data})
}

// poolFor is the model pool of the model a request names (named: a name,
// alias or adapter), or when it names none, the one model tenant t may
// use. nil when there is none: why is the log's reason, and noModel when
// the request must name one.
func (s *Server) poolFor(st *state, t *tenant, model string, named bool) (p *modelPool, why string) {
	if !named {
		for _, q := range st.pools {
			if t.mayUse(q) {
				if p != nil {
					return nil, noModel // several: as vLLM, only one served may go unnamed
				}
				p = q
			}
		}
		if p == nil {
			return nil, noModel
		}
		return p, ""
	}
	p = st.models[model]
	if p != nil && t.mayUse(p) {
		return p, ""
	}
	if q := s.awaitPoolOfAdapter(st, model, t); q != nil {
		return q, ""
	}
	if q := st.served[model]; q != nil && t.mayUse(q) {
		return q, ""
	}
	// A model the tenant may not use took the time an unknown one takes
	// (the first read of the engines' adapter lists, after a start).
	if p == nil {
		p = st.poolOfAdapter(model, nil) // for the log: an adapter of another model
	}
	return nil, unknownModel(p)
}

const noModel = "no model"

// modelNotFound answers a request for a model that does not exist, or
// that the client's tenant may not use: the same words, so a key tells
// nothing of the models it may not use.
func modelNotFound(ctx *fasthttp.RequestCtx, model string) {
	writeError(ctx, fasthttp.StatusNotFound, fmt.Sprintf("the model %q does not exist", model), "invalid_request_error", "model", "model_not_found")
}

// unknownModel is the log's reason for a modelNotFound of pool p.
func unknownModel(p *modelPool) string {
	if p != nil {
		return "model not allowed for the tenant (tenants[].models)"
	}
	return "unknown model"
}

var modelPathPrefix = []byte("/v1/models/")

// handleModel answers GET /v1/models/{id}: one model (ids may contain "/").
func (s *Server) handleModel(ctx *fasthttp.RequestCtx, st *state) {
	s.requestIDs(ctx)
	t := st.auth.client(ctx)
	id := string(ctx.Path()[len(modelPathPrefix):])
	for i := range st.cfg.Models {
		if !t.mayUse(st.models[st.cfg.Models[i].Name]) {
			continue
		}
		for _, card := range modelCards(nil, &st.cfg.Models[i], st) {
			if card.ID == id {
				writeJSON(ctx, card)
				return
			}
		}
	}
	if p := s.awaitPoolOfAdapter(st, id, t); p != nil {
		writeJSON(ctx, modelJSON{ID: id, Object: "model", Created: startTime, OwnedBy: "kvproxy", Parent: p.cfg.Name, MaxModelLen: p.maxModelLen(st.cfg.Limits.MaxPromptTokens)})
		return
	}
	if p := st.served[id]; p != nil && t.mayUse(p) { // an engine's name for the model, as an alias
		writeJSON(ctx, modelJSON{ID: id, Object: "model", Created: startTime, OwnedBy: "kvproxy", Root: p.cfg.Name, MaxModelLen: p.maxModelLen(st.cfg.Limits.MaxPromptTokens)})
		return
	}
	modelNotFound(ctx, id)
}

// handleHealth is readiness: 200 while a backend that serves requests
// (not a prefill engine alone) is healthy, with ?model=NAME one of that
// model's (by name or alias), else 503. The healthy backends of each model
// are named to whom /v1/models names the models: its tenant's to a client,
// all to an admin, all when no keys are configured.
func (s *Server) handleHealth(ctx *fasthttp.RequestCtx, st *state) {
	if s.draining.Load() {
		// Shutting down: out of service, whatever the engines' health
		// (admin_listen serves probes through the drain).
		ctx.SetStatusCode(fasthttp.StatusServiceUnavailable)
		writeJSON(ctx, map[string]any{"status": "draining"})
		return
	}
	// Healthy, not available: a backend at max_concurrency or cooling down
	// after a 429 is busy, and a proxy whose backends are all busy is not
	// one to take out of service.
	healthy, byModel := 0, make(map[string]int, len(st.pools))
	for _, b := range st.backends {
		if b.healthy() && !b.prefillOnly() {
			healthy++
			byModel[b.pool.cfg.Name]++
		}
	}
	t, admin := st.auth.client(ctx), st.auth.isAdmin(ctx)
	var shown map[string]int
	if t != nil || admin {
		shown = make(map[string]int, len(st.pools))
		for _, p := range st.pools {
			if admin || t.mayUse(p) {
				shown[p.cfg.Name] = byModel[p.cfg.Name]
			}
		}
	}
	if name := ctx.QueryArgs().Peek("model"); name != nil {
		if t == nil && !admin {
			unauthorized(ctx)
			return
		}
		if admin {
			t = &tenant{} // one that may use every model
		}
		// As a request would find it (poolFor), without waiting for the
		// engines' model lists: a probe must answer at once.
		p := st.models[string(name)]
		if !t.mayUse(p) {
			p = nil
		}
		if p == nil {
			p = st.poolOfAdapter(string(name), t)
		}
		if q := st.served[string(name)]; p == nil && t.mayUse(q) {
			p = q
		}
		if p == nil {
			modelNotFound(ctx, string(name))
			return
		}
		healthy = byModel[p.cfg.Name]
	}
	body := map[string]any{"status": "ok", "healthy_backends": healthy}
	if shown != nil {
		body["models"] = shown
	}
	if healthy == 0 {
		ctx.SetStatusCode(fasthttp.StatusServiceUnavailable)
		body["status"] = "unavailable"
	}
	writeJSON(ctx, body)
}

// handleLive is liveness: 200 while kvproxy serves, whatever its engines'
// health, so that a probe does not restart it (and lose its index) during
// an engine outage, which /health reports.
func (s *Server) handleLive(ctx *fasthttp.RequestCtx, _ *state) {
	writeJSON(ctx, map[string]any{"status": "live"})
}

// backendJSON is one row of /admin/backends. Load figures are advisory
// snapshots: a torn read between fields is possible and harmless.
type backendJSON struct {
	ID         string `json:"id"`
	URL        string `json:"url"`
	Model      string `json:"model"`
	Kind       string `json:"kind"`
	Role       string `json:"role,omitempty"` // prefill: it only computes prompts for the others
	InstanceID uint64 `json:"instance_id"`
	Healthy    bool   `json:"healthy"`
	// Down: why it is unhealthy (absent while healthy).
	Down *downJSON `json:"down,omitempty"`
	// Available: takes new requests (healthy, below max_concurrency, not
	// cooling down after a 429 for CoolingMs more).
	Available bool  `json:"available"`
	CoolingMs int64 `json:"cooling_ms,omitempty"`
	// Draining: a reload removed or replaced this backend; it takes nothing
	// new and leaves once its Inflight requests have ended (or
	// limits.drain_timeout has passed).
	Draining      bool  `json:"draining,omitempty"`
	Inflight      int64 `json:"inflight"`
	PrefillTokens int64 `json:"prefill_tokens"`
	ActiveBlocks  int64 `json:"active_blocks"`
	IndexedBlocks int64 `json:"indexed_blocks"`
	// UnsolicitedAnswers counts the engine connections closed because the
	// engine sent bytes no request asked for, past an answer or while the
	// connection was pooled: an engine, or a box before it, answering twice.
	UnsolicitedAnswers int64 `json:"unsolicited_answers,omitempty"`

	KVEvents *eventCounters `json:"kv_events"`
	// Adapters: the LoRA adapters the engine lists (absent while unknown).
	Adapters *[]string   `json:"adapters,omitempty"`
	Scrape   *scrapeJSON `json:"engine_metrics"`
	// The kv policy's coefficients for this backend (fitted online).
	PrefillMsPerToken float64 `json:"prefill_ms_per_token"`
	QueueMsPerToken   float64 `json:"queue_ms_per_token"`
	TTFTSamples       int64   `json:"ttft_samples"`
	// Inputs of the kv policy's miss externality and wait for KV memory:
	// requests awaiting their first token, the engine's KV capacity in the
	// router's blocks (reported by vLLM's cache_config_info, else estimated
	// from KV usage), the mean request lifetime (0 until known).
	Pending        int64   `json:"pending"`
	CacheBlocksEst float64 `json:"cache_blocks_estimated"`
	MeanLifetimeMs float64 `json:"mean_lifetime_ms"`
	// The load the other kvproxy replicas report on the backend (replicas.nats).
	Remote router.Load `json:"remote"`
}

type scrapeJSON struct {
	OK      bool    `json:"ok"`
	Error   string  `json:"error,omitempty"`
	Waiting int     `json:"waiting"`
	Running int     `json:"running"`
	KVUsage float64 `json:"kv_usage"`
	AgeMs   int64   `json:"age_ms"`
	// LoRA: the adapters in the engine's batch (vLLM's lora_requests_info).
	LoRA *backends.LoRAInfo `json:"lora,omitempty"`
}

func (s *Server) backendRows(st *state) []backendJSON {
	var rows []backendJSON
	for _, p := range st.pools {
		status := map[router.WorkerID]router.WorkerStatus{}
		for _, w := range p.rt.Workers() {
			status[w.ID] = w
		}
		for _, b := range *p.workers.Load() {
			if b == nil || st.backends[b.cfg.ID] != b {
				continue
			}
			w := status[b.worker]
			rows = append(rows, backendJSON{
				ID: b.cfg.ID, URL: b.cfg.URL, Model: b.cfg.Model, Kind: b.cfg.Kind, Role: b.cfg.Role,
				InstanceID: w.InstanceID, Healthy: b.healthy(), Available: w.Available, CoolingMs: b.coolingLeft().Milliseconds(),
				Inflight: b.inflight.Load(), PrefillTokens: int64(w.PrefillTokens),
				ActiveBlocks: int64(w.ActiveBlocks), IndexedBlocks: int64(w.IndexedBlocks),
				UnsolicitedAnswers: b.up.Unsolicited.Load(),
				KVEvents:           b.eventCounters(),
				PrefillMsPerToken:  w.PrefillMsPerToken, QueueMsPerToken: w.QueueMsPerToken, TTFTSamples: w.TTFTSamples,
				Pending: w.Pending, CacheBlocksEst: math.Round(w.CacheBlocks), MeanLifetimeMs: math.Round(w.LifetimeMs),
				Remote: w.Remote,
			})
			row := &rows[len(rows)-1]
			row.Down = b.whyDown()
			if b.feed != nil { // load and index over all data-parallel ranks
				row.sumLoad(b, status)
			}
			row.Adapters = b.adapters.Load()
			if ss := b.scrape.Load(); ss != nil {
				row.Scrape = &scrapeJSON{OK: ss.ok, Error: ss.err, Waiting: ss.m.Waiting, Running: ss.m.Running,
					KVUsage: ss.m.KVUsage, AgeMs: time.Since(ss.at).Milliseconds(), LoRA: ss.m.LoRA}
			}
		}
	}
	s.retiring.Range(func(k, _ any) bool {
		b := k.(*backend)
		if st.backends[b.cfg.ID] == b { // st predates the reload: listed above
			return true
		}
		// Its engine's health apart from the draining (which makes a
		// backend unhealthy to the router: a reload looked like an
		// outage here), and the router load it holds, or shares with its
		// successor (the replicas trial: zeros).
		row := backendJSON{ID: b.cfg.ID, URL: b.cfg.URL, Model: b.cfg.Model, Kind: b.cfg.Kind, Role: b.cfg.Role,
			Draining: true, Inflight: b.inflight.Load(), Healthy: b.engineHealthy()}
		if !row.Healthy {
			row.Down = b.whyDown()
		}
		status := map[router.WorkerID]router.WorkerStatus{}
		for _, w := range b.pool.rt.Workers() {
			status[w.ID] = w
		}
		row.sumLoad(b, status)
		rows = append(rows, row)
		return true
	})
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].ID < rows[j].ID })
	return rows
}

// sumLoad sets the row's router load and index to the sums over the
// backend's workers (its data-parallel ranks).
func (row *backendJSON) sumLoad(b *backend, status map[router.WorkerID]router.WorkerStatus) {
	row.IndexedBlocks, row.PrefillTokens, row.ActiveBlocks, row.Pending = 0, 0, 0, 0
	row.Remote = router.Load{}
	for _, id := range b.workerIDs() {
		ws := status[id]
		row.Remote.Inflight += ws.Remote.Inflight
		row.Remote.Pending += ws.Remote.Pending
		row.Remote.PrefillTokens += ws.Remote.PrefillTokens
		row.Remote.ActiveBlocks += ws.Remote.ActiveBlocks
		row.IndexedBlocks += int64(ws.IndexedBlocks)
		row.Pending += ws.Pending
		row.PrefillTokens += ws.PrefillTokens
		row.ActiveBlocks += ws.ActiveBlocks
	}
}

func (s *Server) handleAdminBackends(ctx *fasthttp.RequestCtx, st *state) {
	writeJSON(ctx, s.backendRows(st))
}

func writeJSON(ctx *fasthttp.RequestCtx, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(ctx, fasthttp.StatusInternalServerError, "could not encode the answer", "server_error", "", "")
		return
	}
	ctx.Response.Header.SetContentType("application/json")
	ctx.SetBody(b)
}

type indexLookup struct {
	Model  string      `json:"model"`
	Hashes []blockHash `json:"hashes"`
}

// blockHash is a block hash as JSON carries it: a decimal string (as a dry
// run gives it) or an integer.
type blockHash uint64

func (h *blockHash) UnmarshalJSON(b []byte) error {
	str := string(b)
	if len(b) > 0 && b[0] == '"' {
		if err := json.Unmarshal(b, &str); err != nil { // escapes: "\u0031" is "1"
			return err
		}
	}
	v, err := strconv.ParseUint(str, 10, 64)
	if err != nil {
		return fmt.Errorf("block hash %s: want an unsigned 64-bit integer or its decimal string", b)
	}
	*h = blockHash(v)
	return nil
}

// handleIndexLookup answers, for a list of block hashes, how many of them each
// backend holds in the index (POST /admin/index/lookup). It lets operators
// and tests compare the router's picture with an engine's real cache.
func (s *Server) handleIndexLookup(ctx *fasthttp.RequestCtx, st *state) {
	body, ok := s.requestBody(ctx, st.cfg.Limits.MaxRequestBodyBytes)
	if !ok {
		return
	}
	var q indexLookup
	if err := json.Unmarshal(body, &q); err != nil {
		badRequest(ctx, "", "want {\"model\": name, \"hashes\": [block hashes, as decimal strings or integers]}")
		return
	}
	if len(q.Hashes) == 0 {
		badRequest(ctx, "hashes", "hashes must be a non-empty array of block hashes (a dry run's block_hashes)")
		return
	}
	p := st.models[q.Model]
	switch {
	case p == nil && len(st.pools) == 1 && q.Model == "":
		p = st.pools[0]
	case p == nil && q.Model != "":
		p = s.awaitPoolOfAdapter(st, q.Model, nil) // an adapter's hashes are its model's index's
		if p == nil {
			p = st.served[q.Model]
		}
	}
	if p == nil {
		writeError(ctx, fasthttp.StatusNotFound, "unknown model "+strconv.Quote(q.Model), "invalid_request_error", "model", "model_not_found")
		return
	}
	names := map[router.WorkerID]string{}
	for _, w := range p.rt.Workers() {
		if !w.Removed {
			names[w.ID] = w.Name
		}
	}
	held := map[string]int{}
	var buf []router.Overlap
	for _, h := range q.Hashes {
		buf = p.rt.Index().Match([]kv.BlockHash{kv.BlockHash(h)}, buf[:0])
		for _, o := range buf {
			if n, ok := names[o.Worker]; ok {
				held[n]++
			}
		}
	}
	writeJSON(ctx, map[string]any{"held": held})
}
