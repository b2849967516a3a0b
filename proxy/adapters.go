package proxy

import (
	"bytes"
	"iter"
	"slices"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/router"
)

// adapterPollEvery is how often an engine's LoRA adapters are listed: vLLM
// loads and unloads them at run time (/v1/load_lora_adapter).
const adapterPollEvery = 10 * time.Second

// pollAdapters lists the engine's LoRA adapters when adapterPollEvery has
// passed since the last time (scrape loop only). Engines of kinds that do
// not list their adapters as vLLM does stay unknown.
func (b *backend) pollAdapters(scraper *backends.MetricsScraper) {
	if b.cfg.Kind != config.KindVLLM && b.cfg.Kind != config.KindMock {
		return
	}
	now := time.Now()
	if now.Sub(b.adaptersPolled) < adapterPollEvery {
		return
	}
	b.adaptersPolled = now
	list, err := scraper.Models(b.base+"/v1/models", b.cfg.APIKey, b.cfg.InsecureSkipVerify)
	if err != nil {
		return // unknown, or as it last listed them
	}
	b.adapters.Store(&list.Adapters)
	b.maxModelLen.Store(int64(list.MaxModelLen))
	unlisted := len(list.Bases) > 0 && !slices.Contains(list.Bases, b.cfg.ServedModel)
	if unlisted && !b.unlistedWarned {
		// Each request would get the engine's 404, and the backend looked
		// healthy until one came (found by the newcomer trial, with a
		// kvmock serving its default name).
		b.log.Warn().Str("backend", b.cfg.ID).Str("served_model", b.cfg.ServedModel).Strs("engine_models", list.Bases).
			Msg("the engine does not list the model kvproxy sends it: its requests will get 404 (set backends[].served_model, or the engine's --served-model-name)")
	}
	b.unlistedWarned = unlisted
}

// maxModelLen is the context length the model's engines take: the
// largest any of them lists (a request is sent to an engine it fits,
// avoidForLength), and no more than maxPrompt, kvproxy's own limit
// (limits.max_prompt_tokens: a client sizing its prompts by the list had
// them refused); 0 when no engine lists one.
func (p *modelPool) maxModelLen(maxPrompt int) int {
	most := int64(0)
	for _, b := range *p.workers.Load() {
		if b != nil {
			most = max(most, b.maxModelLen.Load())
		}
	}
	if most > 0 && maxPrompt > 0 {
		most = min(most, int64(maxPrompt))
	}
	return int(most)
}

// avoidForLength appends to avoid the engines whose context is too short
// for a request that needs need tokens (its longest prompt and the output
// it asks for), as their /v1/models lists it (max_model_len), when a
// healthy engine of the model has room for it, or does not say: a fleet
// whose engines run different context lengths serves each request where
// it fits, not where its prefix is cached, which would refuse it with 400.
// When none fits, the request goes to the engines of the longest context
// listed, whose refusal answers it (naming the context /v1/models gives),
// and which take it if kvproxy's count of a chat prompt was a few tokens
// over the engine's. Engines avoid holds already (another adapter's) are
// not counted as room: a long prompt for an adapter only short engines
// serve is theirs to refuse, not a 503.
func (p *modelPool) avoidForLength(avoid []router.WorkerID, need int) []router.WorkerID {
	type engine struct {
		b *backend
		n int64 // its max_model_len, read once: the scrape loop sets it
	}
	var buf [16]engine // on the stack: most fleets have no more
	left := buf[:0]
	short, room := false, false
	longest := int64(0) // among healthy engines that list one
	for b := range p.engines() {
		if b.prefillOnly() || slices.Contains(avoid, b.worker) {
			continue // a prefill engine serves no request whole
		}
		n := b.maxModelLen.Load()
		left = append(left, engine{b, n})
		if n > 0 && n < int64(need) {
			short = true
		} else if !room && b.healthy() {
			room = true
		}
		if n > longest && b.healthy() {
			longest = n
		}
	}
	if !short {
		return avoid
	}
	least := int64(need) // what an engine must list not to be left out
	if !room {
		least = longest
	}
	for _, e := range left {
		if e.n > 0 && e.n < least {
			avoid = append(avoid, e.b.workerIDs()...)
		}
	}
	return avoid
}

// serves reports whether the engine is known to serve the adapter, and
// whether it is known at all.
func (b *backend) serves(lora string) (yes, known bool) {
	list := b.adapters.Load()
	if list == nil {
		return false, false
	}
	return slices.Contains(*list, lora), true
}

// adapter is name when it names a LoRA adapter of the model, configured or
// listed by one of its engines (the configuration's or the engine list's
// copy of it), else "".
func (p *modelPool) adapter(name string) string {
	if name == p.cfg.Name {
		return ""
	}
	names := p.names.Load()
	if i := slices.Index(names.adapters, name); i >= 0 {
		return names.adapters[i]
	}
	if slices.Contains(names.aliases, name) {
		return ""
	}
	for b := range p.engines() {
		if list := b.adapters.Load(); list != nil {
			if j := slices.Index(*list, name); j >= 0 {
				return (*list)[j]
			}
		}
	}
	return ""
}

// listsReadWait bounds how long a request for a model name nobody knows
// waits, just after kvproxy starts, for the engines' model lists to be read.
const listsReadWait = 2 * time.Second

// awaitPoolOfAdapter is st.poolOfAdapter, but a name not found before the
// engines' model lists were first read waits for them (at most
// listsReadWait): an adapter only the engines list was a 404 for the first
// moment after kvproxy started, while a client sees it listed a moment
// later.
func (s *Server) awaitPoolOfAdapter(st *state, name string, t *tenant) *modelPool {
	if p := st.poolOfAdapter(name, t); p != nil {
		return p
	}
	select {
	case <-s.listsRead:
		return nil
	default:
	}
	wait := time.NewTimer(listsReadWait)
	defer wait.Stop()
	select {
	case <-s.listsRead:
	case <-wait.C:
	}
	return st.poolOfAdapter(name, t)
}

// poolOfAdapter is the pool one of whose engines lists the adapter name,
// for a model name the configuration does not know: one tenant t may use,
// when t is not nil (engines of two models may list one name).
func (st *state) poolOfAdapter(name string, t *tenant) *modelPool {
	for _, p := range st.pools {
		if p.adapter(name) != "" && (t == nil || t.mayUse(p)) {
			return p
		}
	}
	return nil
}

// avoidForAdapter adds to avoid the workers of the engines known not to
// serve the adapter lora, unless every engine is: a configured adapter no
// engine lists yet is asked of all (vLLM's LoRA resolvers load an adapter
// when a request first names it), each answering for itself.
func (p *modelPool) avoidForAdapter(avoid []router.WorkerID, lora string) []router.WorkerID {
	// Each engine's list is read once: the scrape loop replaces it, and one
	// read as unknown, then as known without the adapter, left the request
	// no engine at all (a 503, TestFailedReloadKeepsTheNames once in a
	// thousand runs).
	var no []*backend
	some := false
	for b := range p.engines() {
		if yes, known := b.serves(lora); yes || !known {
			some = true
		} else {
			no = append(no, b)
		}
	}
	if !some {
		return avoid // none may serve it: all are asked
	}
	for _, b := range no {
		avoid = append(avoid, b.workerIDs()...)
	}
	return avoid
}

// avoidFullBatches adds to avoid, of the engines it leaves, those whose
// batch holds all the adapters it can (vLLM's max_lora) without lora, where
// the request would wait for a place, unless every one does. It is a
// preference, applied after what an engine must have (the adapter, the
// context length): a long prompt waits for the long engine's batch rather
// than be sent where it does not fit.
func (p *modelPool) avoidFullBatches(avoid []router.WorkerID, lora string) []router.WorkerID {
	var full []*backend // each read once: the scrape loop changes it
	room := false
	for b := range p.engines() {
		switch {
		case slices.Contains(avoid, b.worker):
		case b.loraFull(lora):
			full = append(full, b)
		case b.healthy(): // a down engine's batch is not read: no room
			room = true
		}
	}
	if !room {
		return avoid
	}
	for _, b := range full {
		avoid = append(avoid, b.workerIDs()...)
	}
	return avoid
}

// engines yields the model's backends, one each (not their data-parallel
// ranks' workers, which the list holds too).
func (p *modelPool) engines() iter.Seq[*backend] {
	ws := *p.workers.Load()
	return func(yield func(*backend) bool) {
		for i, b := range ws {
			if b != nil && b.worker == router.WorkerID(i) && !yield(b) {
				return
			}
		}
	}
}

// loraFull reports whether the engine last said its batch holds all the
// adapters it can, none of them lora.
func (b *backend) loraFull(lora string) bool {
	ss := b.scrape.Load()
	return ss != nil && ss.ok && ss.m.LoRA.Full(lora)
}

// listedAdapters appends the cards of the adapters the model's engines list
// that the configuration does not name, each once.
func (p *modelPool) listedAdapters(data []modelJSON, maxPrompt int) []modelJSON {
	seen, names := map[string]bool{}, p.names.Load()
	for b := range p.engines() {
		list := b.adapters.Load()
		if list == nil {
			continue
		}
		for _, a := range *list {
			if !seen[a] && !slices.Contains(names.adapters, a) && a != p.cfg.Name && !slices.Contains(names.aliases, a) {
				seen[a] = true
				data = append(data, modelJSON{ID: a, Object: "model", Created: startTime, OwnedBy: "kvproxy", Parent: p.cfg.Name, MaxModelLen: p.maxModelLen(maxPrompt)})
			}
		}
	}
	return data
}

// lacksAdapter records an engine's 404 for the adapter lora: its list leaves
// the adapter out until the next poll says otherwise (an unknown list stays
// unknown).
func (b *backend) lacksAdapter(lora string) {
	for {
		old := b.adapters.Load()
		if old == nil || !slices.Contains(*old, lora) {
			return
		}
		list := slices.DeleteFunc(slices.Clone(*old), func(a string) bool { return a == lora })
		if b.adapters.CompareAndSwap(old, &list) {
			return
		}
	}
}

// adapterUnknown reports whether an engine's 404 says it does not serve the
// adapter the request names (vLLM: "The model `x` does not exist."), not
// that it lacks the path: only that answer takes the adapter off its list.
func (x *exchange) adapterUnknown(resp *fasthttp.Response) bool {
	body, _ := plainBody(resp)
	return bytes.Contains(body, []byte("does not exist")) && bytes.Contains(body, []byte(x.lora))
}
