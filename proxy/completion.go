package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"
	"unsafe"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
	"github.com/kvproxy/kvproxy/tokenize"
)

// maxAttempts bounds how many workers one request may try when engines
// refuse it before accepting it (connection refused, 429/503).
const maxAttempts = 3

// exchange is one proxied request from routing to the end of its answer.
type exchange struct {
	// sc is the request's scratch (handleCompletion's), until a stream
	// sheds it before waiting for its first event (shedScratch).
	sc *scratch
	s  *Server
	// answerHeld is the budget share of the attempt's answer read whole,
	// until it is relayed (then the request holds it) or let go.
	answerHeld int64
	id         string // the request's id, to the client and in the log
	engineID   string // the id sent to the engine
	model      string
	lora       string // the LoRA adapter the request names, "" for the base model
	path       string // the engine's endpoint
	stream     bool
	start      time.Time // the request's arrival
	sent       time.Time // the current attempt's, to the engine
	p          *modelPool
	b          *backend
	d          router.Decision
	active     *router.Active
	ab         *backends.Abort // &abort: one for every attempt, as a client leaves once
	abort      backends.Abort
	first      attempt    // the first attempt's hang-up handler
	watch      *connWatch // the current attempt's hang-up watch
	rank       int        // data-parallel rank of the chosen worker
	// released: the backend slot was returned
	released bool
	live     bool // counted in s.live (add, until done)
	// pass: a pass-through request (passthroughPaths): its answer is
	// relayed as it comes, unread.
	pass bool
	// choices is how many the request asks for: n times its prompts (0: n
	// not a plain number). A stream of one ends at its finish_reason when
	// the engine sends no [DONE]; one of several, once each has finished.
	choices int

	status       int
	refused      int    // the status of the last refusal that made it retry
	refusal      []byte // the last engine refusal's error body, in OpenAI's shape (nil: only refused connections)
	refusalCode  int    // its status
	refusalRetry string // its Retry-After
	refusalBy    string // its backend
	ttft         time.Duration
	queued       time.Duration // waited for a backend slot (route), all attempts
	firstSent    time.Duration // from arrival to the first engine request: kvproxy's own time
	tenant       string        // the client's tenant ("" without keys)
	promptTokens int           // as kvproxy counted them for routing
	outputTokens int           // streams: the chunks that carried output
	accepted     bool          // the engine took the request (answered 200)
	slot         *tenantSlot
	usage        tokenUsage
	errMsg       string
	remote       net.IP   // the client's address
	resp         *respIDs // a Responses API request's ids; nil for others
	api          api      // the endpoint the request came to
	budget       *bucket  // the tenant's token budget (nil: none), charged promptTokens
	priority     int      // its place in a queue for a backend slot: lower first (vLLM's sense)
	// prefillBy is the prefill engine that computed the prompt
	// (disaggregated prefill), prefillTime how long it took, prefillErr why
	// it did not when it was tried and failed.
	prefillBy, prefillErr string
	prefillTime           time.Duration
	// heard is when the engine last sent bytes of the current attempt,
	// coarseNow; 0 before the first.
	heard atomic.Int64
	// unresponsive says why the exchange was aborted when its engine
	// stopped answering its health probe (cutUnresponsive); nil otherwise.
	unresponsive atomic.Pointer[string]
	// migrations is how many more times the request may move to another
	// engine when its engine fails after taking it (limits.migration_limit);
	// mig continues a stream there from where it stopped, nil when it
	// cannot be.
	migrations int
	mig        *migration
	// resend: the engine took the request and dropped it before answering;
	// the next is sent it whole (a disaggregated prefill's KV, which that
	// engine may have pulled and freed, not included).
	resend bool
	// wholeAnswer: the engine answered the stream with its whole answer
	// as JSON, so its first token says nothing of its prefill time.
	wholeAnswer bool
	// addedUsage: the engine was asked for the usage chunk the client did
	// not ask for (usageFor), which the relay meters and keeps from it.
	addedUsage bool
	// retriedAfter is what the attempts before the one an engine answered
	// failed with (their errMsg): logged apart, not as the request's error
	// (alerts on that fired on successes).
	retriedAfter string
	// cutB is the backend whose failing probe cuts the exchange (its
	// engine's), set under the live set's lock (liveExchanges.move).
	cutB *backend
}

// errCutMsg answers the requests still in flight at the drain deadline.
const errCutMsg = "kvproxy is shutting down: the request was cut at the drain deadline; retry"

// The per-request headers' names as fasthttp normalizes them, so setting
// them skips the normalizing.
var (
	hdrRequestID = []byte("X-Request-Id")
	hdrWorker    = []byte("X-Kvproxy-Worker") // WorkerHeader
)

// traceHeaders are the client headers an engine gets: W3C trace context
// (vLLM joins the client's OpenTelemetry trace with them) and baggage.
// Others stay here: they may carry the client's credentials.
var traceHeaders = [3][]byte{[]byte("Traceparent"), []byte("Tracestate"), []byte("Baggage")}

// traceValues are a request's traceHeaders values (nil: absent).
type traceValues [len(traceHeaders)][]byte

// traceOf is h's traceHeaders values, pointing into h.
func traceOf(h *fasthttp.RequestHeader) (t traceValues) {
	for i, name := range traceHeaders {
		t[i] = h.PeekBytes(name)
	}
	return t
}

// stringBytes is s's bytes, for fasthttp calls that copy them.
func stringBytes(s string) []byte { return unsafe.Slice(unsafe.StringData(s), len(s)) }

// admitted is a request past the checks every proxied request passes.
type admitted struct {
	rid      string // the request's id, to the client and in the log
	engineID string // the id sent to the engine
	start    time.Time
	t        *tenant
	body     []byte      // decoded (Content-Encoding), within the size limit
	slot     *tenantSlot // the tenant's max_concurrency; the handler calls handlerDone
}

// admit names the request and checks what comes before reading it: the
// proxy is not draining, the API key, the tenant's request rate and
// max_concurrency, the body.
// When it reports false the request has been answered.
func (s *Server) admit(ctx *fasthttp.RequestCtx, st *state) (admitted, bool) {
	start := ctx.Time() // fasthttp reads the clock just before calling the handler
	rid, engineID := s.requestIDs(ctx)
	if s.draining.Load() {
		s.shuttingDown(ctx, "kvproxy is shutting down; retry")
		return admitted{}, false
	}
	t := st.auth.client(ctx)
	if t == nil {
		unauthorized(ctx)
		s.logRejected(ctx, rid, "", "", fasthttp.StatusUnauthorized, start, "invalid api key")
		return admitted{}, false
	}
	if ok, wait := t.requests.take(1, &ctx.Response.Header); !ok {
		s.rateLimited(ctx, rid, t.name, "", start, wait, "requests") // before the body is read
		return admitted{}, false
	}
	// The slot is taken before the body is decoded: decoding takes up to
	// the body limit of memory, and a tenant's max_concurrency bounds how
	// many of its bodies are decoded at once (twenty small compressed
	// bombs at once took 1.8 GB when it came after).
	slot, ok := t.acquire()
	if !ok {
		s.metrics.limited.WithLabelValues(t.name, "concurrency").Inc()
		ctx.Response.Header.Set("Retry-After", "1")
		writeError(ctx, fasthttp.StatusTooManyRequests, fmt.Sprintf("too many requests in flight: the limit is %d at once; retry when one has ended", t.maxInflight), "rate_limit_error", "", "concurrency_limit_exceeded")
		s.logRejected(ctx, rid, t.name, "", fasthttp.StatusTooManyRequests, start, "tenant max_concurrency")
		return admitted{}, false
	}
	body, ok := s.requestBody(ctx, st.cfg.Limits.MaxRequestBodyBytes)
	if !ok {
		slot.release()
		s.logRejected(ctx, rid, t.name, "", ctx.Response.StatusCode(), start, bodyRefusal(ctx.Response.StatusCode()))
		return admitted{}, false
	}
	return admitted{rid, engineID, start, t, body, slot}, true
}

// requestIDs names a request and answers with its id (x-request-id): rid
// names it to the client and in the log, the client's own id when it sent
// a plain one; the engine gets engineID, unique in flight (vLLM keys
// requests by it), with the client's appended.
func (s *Server) requestIDs(ctx *fasthttp.RequestCtx) (rid, engineID string) {
	rid = s.newRequestID()
	engineID = rid
	if cid := clientRequestID(ctx); cid != "" {
		rid, engineID = cid, rid+"."+cid
	}
	ctx.Response.Header.SetCanonical(hdrRequestID, stringBytes(rid))
	return rid, engineID
}

// outcome of one attempt at a backend.
type outcome int

const (
	done      outcome = iota // answered (or failed) towards the client
	retryable                // the engine never took the request: try another
)

// api is the endpoint a generation request came to.
type api int

const (
	apiCompletions api = iota
	apiChat
	apiResponses   // rendered as the chat request vLLM makes of it
	apiMessages    // Anthropic's Messages API, likewise
	apiCountTokens // Anthropic's count_tokens: a message's prompt tokens, counted here
)

func (s *Server) handleCompletion(ctx *fasthttp.RequestCtx, st *state, kind api) {
	chat := kind != apiCompletions
	in, ok := s.admit(ctx, st)
	if !ok {
		return
	}
	defer in.slot.handlerDone()
	rid, engineID, start, t, body := in.rid, in.engineID, in.start, in.t, in.body
	sc := s.getScratch()
	defer s.putScratch(sc)
	req := &sc.req
	var pe *paramError
	switch kind {
	case apiResponses:
		pe = req.parseResponses(body)
	case apiMessages, apiCountTokens:
		pe = req.parseAnthropic(body, kind == apiCountTokens)
	default:
		pe = req.parse(body, chat)
	}
	if pe != nil {
		badRequest(ctx, pe.param, pe.msg)
		s.logRejected(ctx, rid, t.name, "", fasthttp.StatusBadRequest, start, pe.msg)
		return
	}
	// As vLLM allows: no model means the one served (to the tenant).
	p, why := s.poolFor(st, t, req.model, req.fields.Model != nil)
	switch {
	case why == noModel:
		badRequest(ctx, "model", "you must provide a model parameter (several models are served)")
		s.logRejected(ctx, rid, t.name, "", fasthttp.StatusBadRequest, start, why)
		return
	case p == nil:
		// A model the tenant may not use does not exist for it.
		modelNotFound(ctx, req.model)
		s.logRejected(ctx, rid, t.name, req.model, fasthttp.StatusNotFound, start, why)
		return
	case req.fields.Model == nil:
		req.model = p.cfg.Name
	}
	lora := p.adapter(req.model) // the LoRA adapter the request names
	lim := st.cfg.Limits
	list := "messages"
	if kind == apiResponses {
		list = "input"
	}
	if len(req.messages) > lim.MaxMessages {
		badRequest(ctx, list, fmt.Sprintf("%d messages exceed the limit of %d", len(req.messages), lim.MaxMessages))
		s.logRejected(ctx, rid, t.name, req.model, fasthttp.StatusBadRequest, start, "too many messages")
		return
	}

	// tokens are what the request is routed on; counted is the prompt's
	// size for the limits. A token budget never takes the client's word
	// for it: a tenant with one has its prompt counted by kvproxy even when
	// it sends nvext.token_data (for others, max_prompt_tokens applies to
	// token_data as given: counting would cost what token_data saves, and
	// the engine still checks its context). A prompt the engine could not
	// tokenize counts at 4 bytes a token rather than none.
	salt, ns := t.salt, t.ns
	if req.cacheSalt != "" {
		salt = composeSalt(t.salt, req.cacheSalt)
		ns = kv.NewNamespace(salt)
	}
	// The tokenizer's message cache is kept apart per cache namespace, as
	// the KV index is: a cached message tokenizes faster, which would tell
	// a tenant what another one sent.
	scope := tokenize.CacheScope(ns)
	tokens := sc.tokens
	counted := 0
	hint := req.nv.TokenData
	// A prompt over max_prompt_tokens is refused once it is known to be:
	// tokenizing the rest would cost CPU for nothing (an attacker's 16 MB
	// prompt took 13 s). count_tokens too: counting without a bound let one
	// tenant's 30 MB prompts take both cores for half a minute (security
	// review), and a prompt no engine would take has no use for its count.
	tokLimit, within := lim.MaxPromptTokens, true
	switch {
	case len(hint) > 0 && t.tokens == nil:
		tokens = hint
	case req.hasTokens:
		tokens = req.promptTokens
	case p.engineTok != nil:
		ids, err := p.engineTok.tokens(p, req, chat, lim.MaxPromptTokens, ns)
		if err != nil && kind == apiCountTokens {
			// A count must be the engine's, not kvproxy's guess. The
			// client hears the engine's words on its request, never how
			// an engine failed (a connection error names its address).
			msg := "could not count the tokens: no engine's /tokenize answered"
			if rr := new(requestRefused); errors.As(err, rr) {
				msg = "could not count the tokens: " + rr.said
			}
			writeError(ctx, fasthttp.StatusServiceUnavailable, msg, "service_unavailable", "", "tokenizer_unavailable")
			s.logRejected(ctx, rid, t.name, req.model, fasthttp.StatusServiceUnavailable, start, "engine tokenization failed: "+err.Error())
			return
		}
		if err != nil {
			// Route by load alone rather than fail the request.
			s.log.Warn().Str("request_id", rid).Err(err).Msg("engine tokenization failed")
			ids, counted = nil, (req.textBytes()+3)/4
		}
		tokens = ids
	case chat:
		tokens, within = p.enc.EncodeChatToolsLimitIn(scope, tokens[:0], req.messages, req.tools, req.addGenPrompt, tokLimit)
		sc.tokens = tokens
	default:
		tokens, within = p.enc.EncodePromptLimit(tokens[:0], req.promptText, tokLimit)
		sc.tokens = tokens
	}
	counted = max(counted, len(tokens))
	if !within {
		// Stopped over the limit, maybe before tokenizing (a prompt whose
		// size in bytes alone puts it over): it has more than tokLimit.
		counted = max(counted, tokLimit+1)
	}
	if len(hint) > 0 {
		tokens = hint
		counted = max(counted, len(hint)) // a client's word may count against it, never for it
	}
	// A batch is routed by its first prompt; the engine computes them all.
	// Each must fit max_prompt_tokens, and all count for the budget.
	longest, at := counted, 0 // at: the longest prompt's place in a batch
	batchPrompt := func(i, n int) {
		if n > longest {
			longest, at = n, i+1
		}
		counted += n
	}
	for i, ids := range req.batchTokens {
		batchPrompt(i, len(ids))
	}
	for i, text := range req.batchTexts {
		if !within {
			break // refused: the prompt that passed the limit is the one to name
		}
		n := (len(text) + 3) / 4
		if p.enc != nil {
			sc.batch, within = p.enc.EncodePromptLimit(sc.batch[:0], text, tokLimit)
			n = len(sc.batch)
		}
		if !within {
			n = max(n, tokLimit+1)
			longest, at = n, i+1
		}
		batchPrompt(i, n)
	}
	if longest > lim.MaxPromptTokens {
		param, what := "prompt", "the prompt"
		switch {
		case chat:
			param = list
		case len(req.batchTokens)+len(req.batchTexts) > 0:
			param, what = fmt.Sprintf("prompt[%d]", at), fmt.Sprintf("prompt %d of the batch", at)
		}
		msg := fmt.Sprintf("%s has %d tokens, more than the limit of %d", what, longest, lim.MaxPromptTokens)
		if !within { // not counted to its end
			msg = fmt.Sprintf("%s has more tokens than the limit of %d", what, lim.MaxPromptTokens)
		}
		if kind == apiMessages || kind == apiCountTokens {
			// Anthropic's words, which its clients look for (Claude Code
			// compacts the conversation on "prompt is too long"); a count
			// cut short gives what it had counted, a lower bound.
			msg = fmt.Sprintf("prompt is too long: %d tokens > %d maximum", longest, lim.MaxPromptTokens)
			if !within {
				msg = fmt.Sprintf("prompt is too long: at least %d tokens > %d maximum", max(longest, lim.MaxPromptTokens+1), lim.MaxPromptTokens)
			}
		}
		writeError(ctx, fasthttp.StatusBadRequest, msg, "invalid_request_error", param, "context_length_exceeded")
		s.logRejected(ctx, rid, t.name, req.model, fasthttp.StatusBadRequest, start, "prompt too long")
		return
	}
	// count_tokens and dry runs compute nothing on an engine: no tokens
	// are spent (Anthropic's counts do not count against its token rate
	// limits either); max_prompt_tokens bounds the tokenizing they cost,
	// and the tenant's requests_per_second their number.
	dryRun := req.nv.has("query_instance_id")
	if !dryRun && kind != apiCountTokens {
		if ok, wait := t.tokens.take(float64(counted), &ctx.Response.Header); !ok {
			s.rateLimited(ctx, rid, t.name, req.model, start, wait, "tokens")
			return
		}
	}
	if kind == apiCountTokens {
		ctx.SetContentType("application/json")
		ctx.SetBody(strconv.AppendInt([]byte(`{"input_tokens":`), int64(counted), 10))
		ctx.Response.AppendBodyString("}")
		s.log.Info().Str("request_id", rid).IPAddr("remote", s.st.Load().clientIP(ctx)).Str("path", string(ctx.Path())).
			Str("model", req.model).Str("tenant", t.name).Int("prompt_tokens", counted).
			Int("status", 200).Dur("duration", time.Since(start)).Msg("request")
		return
	}
	if lora != "" {
		ns = kv.RequestNamespace(salt, lora) // the engine caches an adapter's blocks apart
	}
	sc.hashes = kv.HashBlocks(sc.hashes[:0], tokens, p.cfg.BlockSize, ns)
	rr := &sc.route
	*rr = router.Request{Hashes: sc.hashes, PromptTokens: counted, Unstreamed: !req.stream, CandidateBuf: sc.cands}
	if lora != "" {
		rr.Avoid = p.avoidForAdapter(nil, lora)
	}
	rr.Avoid = p.avoidForLength(rr.Avoid, longest+max(req.maxTokens, 1))
	rr.Avoid, _ = p.avoidForRole(rr.Avoid, false) // a prefill engine only computes prompts for the others
	if lora != "" {
		rr.Avoid = p.avoidFullBatches(rr.Avoid, lora)
	}

	if name, inst, isNum, ok := req.nv.pinned(); ok {
		w, found := p.rt.WorkerByName(name)
		if !found && isNum {
			w, found = p.rt.WorkerByInstance(inst)
		}
		if b := p.backend(w); !found || b == nil || b.isDraining() {
			if s.st.Load().models[p.cfg.Name] != p {
				// A reload rebuilt the model since the request came: its
				// backends are the new pool's now. Not the client's fault.
				s.routeFailed(ctx, rid, t.name, req.model, start, errModelReloaded)
				return
			}
			badRequest(ctx, "nvext.backend_instance_id", fmt.Sprintf("no backend %s serves model %q", string(req.nv.BackendInstanceID), req.model))
			s.logRejected(ctx, rid, t.name, req.model, fasthttp.StatusBadRequest, start, "unknown pinned backend")
			return
		}
		rr.Pin, rr.Pinned = w, true
	} else if len(req.nv.BackendInstanceID) > 0 && string(req.nv.BackendInstanceID) != "null" {
		badRequest(ctx, "nvext.backend_instance_id", "backend_instance_id must be a backend id string or a numeric instance id")
		s.logRejected(ctx, rid, t.name, req.model, fasthttp.StatusBadRequest, start, "bad backend_instance_id")
		return
	}
	var ids *respIDs
	if kind == apiResponses {
		if ids = s.previousResponse(ctx, st, p, req, rr, rid, t.name, start); ids == nil {
			return
		}
		if ids.owner != "" {
			sc.hashes = sc.hashes[:0] // not the prompt's prefix (previousResponse)
		}
	}

	if dryRun {
		t0 := time.Now()
		d, err := p.rt.Select(rr)
		s.metrics.route.Observe(time.Since(t0).Seconds())
		if err != nil {
			s.noWorker(ctx, rid, t.name, req.model, start, err)
			return
		}
		sc.keepCandidates(d.Candidates)
		var prefill *router.Decision
		if avoid, ok := p.avoidForRole(nil, true); ok && s.disaggregates(req, kind, rr) {
			if pd, err := p.rt.Select(&router.Request{Hashes: rr.Hashes, PromptTokens: rr.PromptTokens, Unstreamed: true, Avoid: avoid}); err == nil {
				prefill = &pd
			}
		}
		s.writeDecision(ctx, req.stream, p.rt.Config().Policy, d, prefill, tokens, sc.hashes)
		s.log.Info().Str("request_id", rid).IPAddr("remote", s.st.Load().clientIP(ctx)).Str("path", string(ctx.Path())).
			Str("model", req.model).Str("tenant", t.name).Str("backend", d.Name).
			Int("overlap_blocks", d.Overlap).Int("total_blocks", d.Total).Bool("dry_run", true).
			Int("status", 200).Dur("duration", time.Since(start)).Msg("request")
		return
	}

	path := "/v1/completions"
	switch kind {
	case apiChat:
		path = "/v1/chat/completions"
	case apiResponses:
		path = "/v1/responses"
	case apiMessages:
		path = "/v1/messages"
	}
	x := s.newExchange(rid, engineID, path, req.stream, start, p, req.model)
	x.sc = sc
	x.tenant, x.promptTokens, x.slot, x.resp, x.api, x.budget = t.name, counted, in.slot, ids, kind, t.tokens
	x.choices = req.choices()
	prio := t.queuePriority(req.priority, req.priorityGiven && !req.priorityOdd)
	x.priority, req.dropPriority, req.priorityTo = prio, t.capped, prio
	x.migrations = lim.MigrationLimit
	if x.migrations > 0 && req.stream && ctx.Request.Header.IsHTTP11() && migratable(req, kind, rr) {
		// The copy of the body a move resends is charged as bodies are:
		// it doubled what each large stream held, unseen by the budget
		// (the twenty-ninth session's review). With no room, the stream
		// cannot move.
		m := newMigration(ctx, req, kind, rr, salt, longest+max(req.maxTokens, 1))
		if n := int64(len(req.body)); n <= backends.Untracked {
			x.mig = m
		} else if s.bodyMem.Take(n) {
			m.held, x.mig = n, m
		}
	}
	s.dispatch(ctx, st, sc, x, salt)
}

// newExchange starts the exchange of a request for the model pool p, to be
// sent to its engine's path. model is the name the client asked for.
func (s *Server) newExchange(rid, engineID, path string, stream bool, start time.Time, p *modelPool, model string) *exchange {
	// model points into the request body; a streamed answer's exchange
	// outlives it.
	lora := p.adapter(model)
	switch {
	case model == p.cfg.Name:
		model = p.cfg.Name
	case lora != "":
		model = lora
	default:
		model = strings.Clone(model)
	}
	x := &exchange{s: s, id: rid, engineID: engineID, model: model, lora: lora, path: path, stream: stream, start: start, p: p, usage: tokenUsage{-1, -1, -1}}
	x.ab = &x.abort
	return x
}

// dispatch routes the request in sc (sc.req parsed, sc.route filled), sends
// it to the chosen engine and relays the answer; an engine that refuses it
// before starting (connection refused, 429, 503) is avoided and the next
// best tried, up to maxAttempts and the retry budget. salt is the tenant's
// cache_salt, sent to engines that take one.
func (s *Server) dispatch(ctx *fasthttp.RequestCtx, st *state, sc *scratch, x *exchange, salt string) {
	returned := false
	defer func() {
		if !returned { // a panic, which handle answers: free what x holds
			x.abandon()
		}
	}()
	s.attempt(ctx, st, sc, x, salt)
	returned = true
	if !ctx.Response.IsBodyStream() {
		// No relay holds the exchange (refused, not routed, answered
		// whole): nothing moves it, and its body copy goes back now; it
		// stayed charged for good (the review).
		x.mig.letGo(s.bodyMem)
	}
}

// abandon frees what an exchange whose handler panicked holds: its hang-up
// watch, slots, engine connection and place in the drain. Each is freed at
// most once, whatever the exchange had already given back.
func (x *exchange) abandon() {
	x.letGoAnswer()
	x.mig.letGo(x.s.bodyMem)
	x.stopWatch()
	x.release()
	x.slot.release()
	x.ab.Abort()
	x.s.live.done(x)
}

// attempt is dispatch's work: routes, sends and relays, trying the next
// best engine when one refuses.
func (s *Server) attempt(ctx *fasthttp.RequestCtx, st *state, sc *scratch, x *exchange, salt string) {
	rr, req, rid, start := &sc.route, &sc.req, x.id, x.start
	x.remote = st.clientIP(ctx)
	s.retries.deposit(start)
	for attempt := 1; ; attempt++ {
		refusedBy := x.b
		// A retry is withdrawn before its route, so that a spent budget
		// answers with the refusal at once (routing first queued the
		// request for another engine's slot just to find that out), and
		// given back when no other engine takes it: a model's only engine
		// refusing every request drained the budget other models' retries
		// need (found by the ninth session's user trial and last review).
		if attempt > 1 && !s.retries.withdraw() {
			x.errMsg += "; the retry budget is spent"
			x.answerRefusal(ctx)
			return
		}
		if err := x.route(ctx.Conn(), st, rr); err != nil {
			if attempt > 1 {
				s.retries.refund()
			}
			if x.refused != 0 && (errors.Is(err, router.ErrNoWorker) || queueRefused(err)) {
				// Every engine left has refused it too, or is down, or
				// none had a slot for it in time: the client gets the
				// refusal, and the engine's failure is told and counted
				// (kvproxy's own 503 told of saturation only).
				if queueRefused(err) {
					x.errMsg += "; its retry: " + err.Error()
				}
				x.answerRefusal(ctx)
				return
			}
			if rr.Pinned && errors.Is(err, router.ErrWorkerUnavailable) && s.pinnedCooling(ctx, st, x.p, rr.Pin, rid, x.tenant, x.model, start) {
				return
			}
			if x.resp != nil && x.resp.owner != "" && errors.Is(err, router.ErrWorkerUnavailable) {
				msg := "backend " + x.resp.owner + ", which holds the previous response " + x.resp.prevTagged + ", is not available; retry"
				ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(x.resp.owner))
				s.unavailable(ctx, whyOwner, msg)
				s.logRejected(ctx, rid, x.tenant, x.model, fasthttp.StatusServiceUnavailable, start, "previous response's backend unavailable")
				return
			}
			s.routeFailed(ctx, rid, x.tenant, x.model, start, err)
			return
		}
		if attempt > 1 {
			s.metrics.reroutes.WithLabelValues(refusedBy.cfg.ID).Inc()
			// Bounded as rejections are: an engine down under load is
			// thousands of reroutes a second (kvproxy_reroutes_total counts them).
			if s.rejectLog.allow(x.tenant, "rerouting from backend "+refusedBy.cfg.ID, true) {
				s.log.Warn().Str("request_id", rid).Str("backend", refusedBy.cfg.ID).Str("to", x.b.cfg.ID).Str("reason", x.errMsg).Msg("rerouting")
			}
		}
		sc.keepCandidates(x.d.Candidates)
		x.d.Candidates = nil // the scratch's
		if attempt == 1 && !x.pass && s.disaggregates(req, x.api, rr) {
			// Disaggregated prefill, once the decode engine's slot is
			// held: its params stay good for the next engine if this one
			// refuses.
			req.kvParams = s.remotePrefill(ctx, sc, x, rr, salt)
		}
		if x.resend && req.kvParams != nil {
			req.kvParams = nil
			x.prefillErr = "the decode engine given its KV dropped the request; the next computes the prompt"
		}
		req.sendPriority = req.dropPriority && x.b.cfg.PriorityScheduling
		req.engineSampling = x.b.cfg.Kind != config.KindOpenAI
		req.addUsage = x.usageFor(req, x.b)
		x.addedUsage = req.addUsage
		engineSalt := ""
		if x.b.salted {
			engineSalt = salt
		}
		served := x.b.cfg.ServedModel
		if x.lora != "" {
			served = x.lora
		}
		body, err := req.forwardBody(sc.body[:0], served, engineSalt)
		sc.body = body
		if err != nil {
			x.release()
			writeError(ctx, fasthttp.StatusInternalServerError, "could not encode the request for the engine", "server_error", "", "")
			s.logRejected(ctx, rid, x.tenant, x.model, fasthttp.StatusInternalServerError, start, "request not encodable for the engine")
			return
		}
		s.live.add(x)
		res := x.forward(ctx, body, attempt < maxAttempts && !rr.Pinned)
		if res == done {
			return
		}
		s.live.done(x)
		// The next best, not the same engine again: none of its
		// data-parallel ranks either.
		rr.Avoid = append(append(rr.Avoid, x.d.Worker, x.b.worker), x.b.workerIDs()...)
	}
}

var (
	errQueueFull    = errors.New("every backend is at its concurrency limit and the wait queue is full")
	errQueueTimeout = errors.New("no backend had capacity within the queue timeout")
	// errQueueDisplaced: a more urgent request took its place in the full queue.
	errQueueDisplaced = errors.New("every backend is at its concurrency limit and a more urgent request took this one's place in the full wait queue")
	errClientGone     = errors.New("the client left while waiting")
	errCutQueued      = errors.New("cut at the drain deadline while waiting for a backend slot")
	errRemoved        = errors.New("the chosen backend was just removed")
	errModelReloaded  = errors.New("a reload changed or removed the model's configuration while the request waited")
)

// usageFor says whether b is asked for the usage of a stream whose client
// did not ask for it (no stream_options): kvproxy meters the engine's own
// count, not its estimate, the relay keeping the chunk from the client.
// Only of engines known to take stream_options (vLLM, SGLang, the mock):
// a server of kind openai may refuse a member it does not know; nor of one
// that sends the usage unasked (force_include_usage), whose clients had it
// (kept from them, the SDK trial).
func (x *exchange) usageFor(req *apiRequest, b *backend) bool {
	return x.stream && (x.api == apiChat || x.api == apiCompletions) && b.salted && !b.cfg.ForceIncludeUsage && req.fields.StreamOptions == nil
}

// queueRefused says that err is route's for a request no backend had a
// slot for: the queue was full, it was displaced, or it waited too long.
func queueRefused(err error) bool {
	return errors.Is(err, errQueueFull) || errors.Is(err, errQueueTimeout) || errors.Is(err, errQueueDisplaced)
}

// route picks a worker, registers the request and takes a slot on its
// backend. When every healthy backend is at its max_concurrency, it waits
// (bounded by limits.max_queue waiters and limits.queue_timeout) for a slot.
func (x *exchange) route(conn net.Conn, st *state, rr *router.Request) error {
	s, p := x.s, x.p
	var w *waiter // in p.queue while the request waits
	var queuedAt time.Time
	var routed, rechecked, waitedReload bool
	var timer *time.Timer
	var gone clientGone
	var cut <-chan struct{}
	var watch *connWatch
	counted := !x.live // a moving stream is counted in flight already
	defer func() {
		if w == nil {
			p.queueWait.Observe(0)
		} else {
			waited := time.Since(queuedAt)
			x.queued += waited
			p.queueWait.Observe(waited.Seconds())
			p.queue.leave(w, routed && p.anyAvailable())
			s.queued.Add(-1)
			p.waiting.Add(-1)
			if counted {
				s.queuedFirst.Add(-1)
			}
		}
		if timer != nil {
			timer.Stop()
			s.watcher.Unwatch(watch)
		}
	}()
	for {
		t0 := time.Now()
		d, active, err := p.rt.Route(rr)
		s.metrics.route.Observe(time.Since(t0).Seconds())
		if err == nil {
			rr.Repeat = true // counted once, whatever routes it again
			b, rank := p.backend(d.Worker), 0
			if b == nil {
				// A data-parallel rank of a backend: same endpoint, rank
				// header. The current configuration's backend, as for rank
				// 0: a reload may have replaced it since the request came.
				b, rank = s.st.Load().rankBackend(d.Name)
				if b != nil && b.pool != p {
					b = nil
				}
			}
			if b == nil && !waitedReload {
				// A rank of a backend a running reload adds: its feed
				// made the rank's worker before activate made the new
				// configuration current. Route again once it has.
				active.Free()
				waitedReload = true
				s.reloadMu.Lock()
				//lint:ignore SA2001 it waits for the reload
				s.reloadMu.Unlock()
				continue
			}
			if b == nil {
				active.Free()
				return errRemoved
			}
			if rank > 0 && !b.admitRank(d.Worker) {
				active.Free()
				continue
			}
			if hook := s.testRouted.Load(); hook != nil {
				(*hook)(b)
			}
			if !b.acquire() {
				// Lost the race for its last slot; it is now unselectable.
				active.Free()
				continue
			}
			if b.retiring.Load() {
				// A reload removed or replaced it since Route chose it: its
				// retirement read its inflight before this slot counted,
				// and may be over (its engine stopped). Route again: it is
				// unselectable now, or its successor is in the pool.
				b.release()
				p.queue.signal()
				active.Free()
				continue
			}
			if d.Total > 0 {
				s.metrics.hitRatio.Observe(float64(d.Overlap) / float64(d.Total))
			}
			x.d, x.active, x.b, x.rank = d, active, b, rank
			routed = true
			return nil
		}
		if !rr.Pinned && errors.Is(err, router.ErrNoWorker) && p.endCooling() {
			continue // the backends cooling down after a 429 were the last ones
		}
		if (errors.Is(err, router.ErrNoWorker) || errors.Is(err, router.ErrWorkerUnavailable)) && s.st.Load().models[p.cfg.Name] != p {
			// The pool it waits on was rebuilt: its engines serve the new
			// one now. A retry is routed there, pinned or not; this is no
			// outage.
			return errModelReloaded
		}
		lim := st.cfg.Limits
		if w == nil {
			// Join the queue, then route again: a slot freed before it
			// joined woke no one, and may already have left no backend
			// full.
			if s.queued.Add(1) > int64(lim.MaxQueue) {
				// Full: a less urgent waiter of the model makes room (it
				// leaves, and its count with it), or this one is refused.
				if !p.fullFor(rr) {
					s.queued.Add(-1)
					return err
				}
				if !p.queue.evict(x.priority) {
					s.queued.Add(-1)
					return errQueueFull
				}
			}
			w, queuedAt = p.queue.join(x.priority), time.Now()
			p.waiting.Add(1)
			if counted {
				s.queuedFirst.Add(1)
			}
			continue
		}
		if !p.fullFor(rr) {
			// No backend is full: none is healthy, or a slot was freed
			// since this Route (it signals only after that). Route again
			// once before giving up.
			if rechecked {
				return err
			}
			rechecked = true
			continue
		}
		rechecked = false
		p.queue.rest(w, p.anyAvailable())
		if timer == nil {
			timer = time.NewTimer(lim.QueueTimeout)
			gone = make(clientGone)
			watch = s.watcher.Watch(conn, gone)
			cut = s.live.cutSignal()
		}
		select {
		case <-w.wake:
			if p.queue.wasEvicted(w) {
				return errQueueDisplaced
			}
		case <-timer.C:
			return errQueueTimeout
		case <-gone:
			return errClientGone
		case <-cut:
			return errCutQueued
		}
	}
}

// clientGone is closed when a queued request's client hangs up.
type clientGone chan struct{}

func (g clientGone) hungUp() { close(g) } // the watcher calls it at most once

// attempt is what a client hanging up cancels: one attempt's engine
// exchange and router slot.
type attempt struct {
	ab     *backends.Abort
	active *router.Active
}

func (a *attempt) hungUp() {
	a.ab.Abort()
	a.active.Free()
}

// release frees the exchange's router slot and backend slot (idempotent for
// the router; the backend slot is returned once).
func (x *exchange) release() {
	x.active.Free()
	if x.b != nil && !x.released {
		x.released = true
		x.b.release() // a backend it leaves below max_concurrency wakes its queue
	}
}

func (s *Server) routeFailed(ctx *fasthttp.RequestCtx, rid, tenant, model string, start time.Time, err error) {
	switch {
	case queueRefused(err):
		why := whyQueueFull
		if errors.Is(err, errQueueTimeout) {
			why = whyQueueTimeout
		}
		s.unavailable(ctx, why, err.Error())
		ctx.Response.Header.Set("X-Kvproxy-Overloaded", "1")
		s.logRejected(ctx, rid, tenant, model, fasthttp.StatusServiceUnavailable, start, err.Error())
	case errors.Is(err, errClientGone):
		s.answerNothing(ctx)
		s.logRejected(ctx, rid, tenant, model, 499, start, err.Error())
	case errors.Is(err, errCutQueued):
		s.shuttingDown(ctx, errCutMsg)
		s.logRejected(ctx, rid, tenant, model, fasthttp.StatusServiceUnavailable, start, err.Error())
	case errors.Is(err, errRemoved), errors.Is(err, errModelReloaded):
		s.unavailable(ctx, whyRemoved, err.Error()+"; retry")
		s.logRejected(ctx, rid, tenant, model, fasthttp.StatusServiceUnavailable, start, err.Error())
	default:
		s.noWorker(ctx, rid, tenant, model, start, err)
	}
}

// pinnedCooling answers a request pinned to a backend that cools down
// after a 429 as the engine did: 429, to come back when the cooling ends.
// It reports false, answering nothing, when the backend is not cooling.
func (s *Server) pinnedCooling(ctx *fasthttp.RequestCtx, st *state, p *modelPool, w router.WorkerID, rid, tenant, model string, start time.Time) bool {
	b := p.backend(w)
	if b == nil { // a data-parallel rank ("id#r")
		for _, ws := range p.rt.Workers() {
			if ws.ID == w {
				b, _ = st.rankBackend(ws.Name)
			}
		}
	}
	if b == nil {
		return false
	}
	left := b.coolingLeft()
	if left == 0 {
		return false
	}
	secs := strconv.Itoa(int(math.Ceil(left.Seconds())))
	ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(b.cfg.ID))
	ctx.Response.Header.Set("Retry-After", secs)
	writeError(ctx, fasthttp.StatusTooManyRequests, "backend "+b.cfg.ID+" refused a request with 429 and takes new ones again in "+secs+"s", "rate_limit_error", "", "backend_cooling_down")
	s.logRejected(ctx, rid, tenant, model, fasthttp.StatusTooManyRequests, start, "pinned backend cooling down")
	return true
}

func (s *Server) rateLimited(ctx *fasthttp.RequestCtx, rid, tenant, model string, start time.Time, wait time.Duration, what string) {
	s.metrics.limited.WithLabelValues(tenant, what).Inc()
	secs := int(math.Ceil(wait.Seconds()))
	if secs < 1 {
		secs = 1
	}
	ctx.Response.Header.Set("Retry-After", strconv.Itoa(secs))
	// The OpenAI SDKs prefer this to Retry-After: a token bucket is often
	// refilled in less than the second Retry-After rounds up to.
	ctx.Response.Header.Set("Retry-After-Ms", strconv.FormatInt(max(1, (wait+time.Millisecond-1).Milliseconds()), 10))
	writeError(ctx, fasthttp.StatusTooManyRequests, "rate limit reached for "+what+"; retry after "+strconv.Itoa(secs)+"s", "rate_limit_error", "", "rate_limit_exceeded")
	s.logRejected(ctx, rid, tenant, model, fasthttp.StatusTooManyRequests, start, "rate limited: "+what)
}

func (s *Server) noWorker(ctx *fasthttp.RequestCtx, rid, tenant, model string, start time.Time, err error) {
	if errors.Is(err, router.ErrWorkerUnavailable) {
		s.unavailable(ctx, whyPinned, "the pinned backend is not available")
	} else {
		s.unavailable(ctx, whyNoBackend, "no healthy backend is available for model "+strconv.Quote(model))
	}
	s.logRejected(ctx, rid, tenant, model, fasthttp.StatusServiceUnavailable, start, err.Error())
}

// forward sends the request to the chosen engine and relays the answer. It
// returns retryable, with the slot freed and nothing written to the client,
// when mayRetry and the engine never took the request.
func (x *exchange) forward(ctx *fasthttp.RequestCtx, body []byte, mayRetry bool) outcome {
	s, b := x.s, x.b
	trace := traceOf(&ctx.Request.Header)
	fr := x.engineRequest(&trace, b, x.rank, body)
	defer fasthttp.ReleaseRequest(fr)
	if x.stream {
		fr.Header.Set("Accept", "text/event-stream")
	}

	// A non-streamed request's prefill ends, for the router, at its
	// predicted TTFT (router.Request.Unstreamed): no first token is seen.
	active := x.active
	at := &x.first
	if at.active != nil {
		// A retry: the previous attempt's hang-up may still be running.
		at = &attempt{}
	}
	*at = attempt{ab: x.ab, active: active}
	x.watch = s.watcher.Watch(ctx.Conn(), at)
	if x.resp != nil {
		x.resp.signer = respSigner{macs: x.s.st.Load().respMACs, backend: b.cfg.ID, tenant: x.tenant}
	}
	x.sent = time.Now()
	if x.firstSent == 0 {
		x.firstSent = x.sent.Sub(x.start)
	}
	x.heard.Store(0) // nothing from this attempt's engine yet
	resp := fasthttp.AcquireResponse()
	resp.Header.SetNoDefaultContentType(true) // an answer without one is told apart
	var stream *backends.Body
	var err error
	if x.stream || x.pass {
		stream, err = b.up.Do(fr, resp, true, x.ab)
	} else {
		x.answerHeld, err = b.up.DoWhole(fr, resp, x.ab, heldBy(ctx))
	}
	if err != nil {
		fasthttp.ReleaseResponse(resp)
		var ce *backends.ConnectError
		switch {
		case errors.Is(err, backends.ErrOverBudget):
			// The engine did its work; kvproxy has no room to read it. No
			// fault of the engine's, and another would do the work again.
			x.noRoom(ctx, "the engine's answer, larger than 1 MiB")
		case errors.Is(err, backends.ErrAborted) && s.live.isCut():
			x.status, x.errMsg = fasthttp.StatusServiceUnavailable, errCutMsg
			ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(b.cfg.ID))
			s.shuttingDown(ctx, errCutMsg)
		case errors.Is(err, backends.ErrAborted) && x.unresponsive.Load() != nil:
			if x.stream && mayRetry && x.migrations > 0 {
				// Its probe failed while it held the stream's headers
				// back: nothing reached the client (the chaos trial: a
				// stopped engine's streams got 504s, those it had begun
				// moved). The next attempt gets an abort of its own.
				why := *x.unresponsive.Load() // names the backend
				s.live.move(x, nil, new(backends.Abort))
				return x.resendAfter(why)
			}
			x.failUpstream(ctx, fasthttp.StatusGatewayTimeout, *x.unresponsive.Load())
		case errors.Is(err, backends.ErrAborted):
			x.status = 499 // client closed the request
			s.answerNothing(ctx)
		case backends.OutOfFiles(err):
			// kvproxy's own want of file descriptors: no fault of the
			// engine's (failDial).
			x.status, x.errMsg = fasthttp.StatusServiceUnavailable, "no engine connection: "+err.Error()
			ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(b.cfg.ID))
			s.unavailable(ctx, whyNoFiles, "kvproxy has run out of file descriptors (its open files limit); retry")
		case errors.As(err, &ce):
			b.failConn("connect: " + ce.Err.Error())
			x.errMsg = "backend " + b.cfg.ID + " refused the connection"
			var te *backends.TLSError
			if errors.As(err, &te) { // an https engine kvproxy does not trust, or one not speaking TLS: the detail is in the ejection's log line
				x.errMsg = "backend " + b.cfg.ID + " failed the TLS handshake"
			}
			if mayRetry {
				// An engine's own refusal, if one came, stays the answer:
				// it tells the client more than an engine that is down.
				x.refused = fasthttp.StatusBadGateway
				return x.endAttempt()
			}
			// As answerRefusal says it when every engine was down.
			ctx.Response.Header.Set("Retry-After", "1")
			x.failUpstream(ctx, fasthttp.StatusBadGateway, x.errMsg)
		case backends.IsTimeout(err):
			msg := b.silent()
			if x.stream {
				// Engines send a stream's headers at once: this one is stuck.
				b.fail(ejectTimeout, msg)
				if mayRetry && x.migrations > 0 {
					return x.resendAfter(msg)
				}
			} else {
				b.wholeTimedOut(msg)
				noRetry(ctx)
			}
			x.failUpstream(ctx, fasthttp.StatusGatewayTimeout, msg)
		case errors.Is(err, backends.ErrBeyondBudget):
			// As for an answer over 64 MiB: a retry would meet the same.
			x.failUpstream(ctx, fasthttp.StatusBadGateway, s.beyondBudget(b)+"; ask for less at once, or stream it")
		case errors.Is(err, fasthttp.ErrBodyTooLarge):
			// The request asked for more than kvproxy reads whole (many
			// choices with logprobs, unstreamed): the engine did its work,
			// and is not ejected for it. Pass-through answers are streamed.
			x.failUpstream(ctx, fasthttp.StatusBadGateway, "the answer of backend "+b.cfg.ID+" is larger than kvproxy reads whole (64 MiB); ask for less at once, or stream it")
		default:
			b.cutOff(err.Error())
			if mayRetry && x.migrations > 0 {
				// The engine took the request and failed before its first
				// byte: nothing reached the client.
				return x.resendWhole(err)
			}
			x.failUpstream(ctx, fasthttp.StatusBadGateway, "backend "+b.cfg.ID+" "+upstreamFault(err))
			x.errMsg += ": " + err.Error()
		}
		x.finish()
		return done
	}

	x.heard.Store(coarseNow()) // its answer began: the engine is alive to this request
	code := resp.StatusCode()
	if stream == nil || code != fasthttp.StatusOK {
		// An engine's error answer to a streaming request: read it whole.
		// A 204 or 304 has no body, and no body stream to read.
		if stream != nil && !x.readWhole(ctx, stream, resp, 1<<20) {
			fasthttp.ReleaseResponse(resp)
			x.finish()
			return done
		}
		if (code == fasthttp.StatusTooManyRequests || code == fasthttp.StatusServiceUnavailable) && mayRetry {
			// The engine refused before starting: another may take it. An
			// overloaded engine (503) also gets a short break, unless the
			// model's other backends are out too (ejectForAnswer).
			x.errMsg = "backend " + b.cfg.ID + " answered " + strconv.Itoa(code)
			x.refused = code
			plain, _ := plainBody(resp)
			x.refusal = append(x.refusal[:0], normalizeEngineError(code, plain)...)
			x.refusalCode, x.refusalBy = code, b.cfg.ID
			x.refusalRetry = string(resp.Header.Peek("Retry-After"))
			if code == fasthttp.StatusServiceUnavailable {
				b.ejectForAnswer(ejectStatus, x.errMsg)
			} else {
				b.coolDown(coolingFor(resp.Header.Peek("Retry-After")))
			}
			fasthttp.ReleaseResponse(resp)
			return x.endAttempt()
		}
		if (code == fasthttp.StatusInternalServerError || code == fasthttp.StatusBadGateway || code == fasthttp.StatusGatewayTimeout) && mayRetry {
			// The engine failed the request before any answer (a CUDA
			// error, a gateway before it timing out): another may serve
			// it. The client's own retry would not help: routed on the
			// same cache, it would come back here.
			plain, _ := plainBody(resp)
			if x.errMsg != "" && x.retriedAfter == "" { // an earlier refusal
				x.retriedAfter = x.errMsg
			}
			x.errMsg = "backend " + b.cfg.ID + " answered " + strconv.Itoa(code) + engineErrorKind(plain)
			if code == fasthttp.StatusInternalServerError {
				b.answeredError("status 500")
			} else {
				b.ejectForAnswer(ejectStatus, "status "+strconv.Itoa(code))
			}
			x.refused = code
			x.refusal = append(x.refusal[:0], normalizeEngineError(code, plain)...)
			x.refusalCode, x.refusalBy, x.refusalRetry = code, b.cfg.ID, ""
			x.resend = true // it may have pulled a disaggregated prefill's KV
			fasthttp.ReleaseResponse(resp)
			return x.endAttempt()
		}
		if code == fasthttp.StatusNotFound && x.lora != "" && !x.pass && x.adapterUnknown(resp) {
			// The engine does not serve the adapter (unloaded since its
			// list was read, or never listed): no fault of the engine's.
			// Another may serve it; if none does, the client gets the
			// engine's 404, as from vLLM itself.
			b.lacksAdapter(x.lora)
			if mayRetry {
				x.errMsg = "backend " + b.cfg.ID + " does not serve the adapter " + x.lora
				if x.refusal == nil {
					plain, _ := plainBody(resp)
					x.refusal = append(x.refusal[:0], normalizeEngineError(code, plain)...)
					x.refusalCode, x.refusalBy, x.refusalRetry = code, b.cfg.ID, ""
					x.refused = code
				}
				fasthttp.ReleaseResponse(resp)
				return x.endAttempt()
			}
			code = 0 // relayed below as the engine answered it
		}
		var answer, answerEnc []byte // decoded, for relayWhole
		switch {
		case code == fasthttp.StatusUnauthorized || code == fasthttp.StatusForbidden || code >= 300 && code < 400 ||
			code == fasthttp.StatusNotFound && !x.pass && !x.resp.lostPrevious(resp.Body()):
			// The engine gets kvproxy's key (backends[].api_key), never
			// the client's, and the model kvproxy routed to it: a refusal
			// or a 404 (an engine started with another --served-model-name)
			// is kvproxy's configuration at fault, which the client must
			// not take for its own mistake. The engine never took the
			// request: another may.
			plain, _ := plainBody(resp)
			// An engine without this API (vLLM before it had it) is no
			// worse an engine for chat: not a strike against it.
			optional := code == fasthttp.StatusNotFound && (x.api == apiResponses || x.api == apiMessages)
			var msg string
			switch {
			case optional:
				msg = "backend " + b.cfg.ID + " does not serve " + x.path + " (" + refusalDetail(code, plain) + "); its engine may not have this API"
			case code == fasthttp.StatusNotFound:
				msg = "backend " + b.cfg.ID + " does not serve the model or path (" + refusalDetail(code, plain) + "); check its url and served_model"
			default:
				b.logRedirect(code, resp)
				msg = configRefusal(b.cfg.ID, code, plain)
			}
			if !optional {
				b.answeredError(msg)
			}
			fasthttp.ReleaseResponse(resp)
			return x.badGateway(ctx, msg, mayRetry)
		case code == fasthttp.StatusInternalServerError:
			b.answeredError("status 500")
		case code >= 500:
			b.ejectForAnswer(ejectStatus, "status "+strconv.Itoa(code))
		case code == fasthttp.StatusOK && !x.pass:
			var err error
			answer, answerEnc, err = x.plainAnswer(ctx, resp)
			switch {
			case err == nil || errors.Is(err, fasthttp.ErrContentEncodingUnsupported): // a coding kvproxy does not know goes as it came
			case errors.Is(err, backends.ErrOverBudget):
				fasthttp.ReleaseResponse(resp)
				x.noRoom(ctx, "the engine's answer, larger than 1 MiB once decompressed")
				x.finish()
				return done
			case errors.Is(err, backends.ErrBeyondBudget) || errors.Is(err, fasthttp.ErrBodyTooLarge):
				// A compressed answer too large once decompressed (it went
				// to the client as it came, a gzip bomb of 1 GB: the
				// verifying trial).
				fasthttp.ReleaseResponse(resp)
				x.failUpstream(ctx, fasthttp.StatusBadGateway, s.tooLargeDecoded(b)+"; ask for less at once, or stream it")
				x.finish()
				return done
			default:
				answerEnc = nil // corrupt: no answer
			}
			if answerEnc == nil && !looksLikeJSONObject(answer) {
				// A gateway's login page, an engine that closed after its
				// headers, a body cut off (compressed or not: the review):
				// no answer, though a 200 (it was relayed as one, and the
				// engine, answering fastest, drew the traffic: the chaos
				// trial). Handled as a stream that is no event stream is.
				msg := "backend " + b.cfg.ID + " answered 200 with Content-Type " + quotedType(resp.Header.ContentType()) + " and no JSON answer"
				fasthttp.ReleaseResponse(resp)
				return x.noAnswer(ctx, msg, mayRetry)
			}
			b.succeed()
		case code == fasthttp.StatusOK:
			b.succeed()
		}
		if answer == nil {
			// An error answer, decoded up to the bound it was read with (a
			// gateway's compressed 400 quoting a long prompt lost the
			// engine's words at 1 MiB: the review), charged.
			answer, answerEnc, _ = x.plainAnswer(ctx, resp)
		}
		ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(b.cfg.ID))
		s.hold(ctx, x.answerHeld) // its copy goes out with the answer
		x.answerHeld = 0
		x.relayWhole(ctx, resp, answer, answerEnc)
		fasthttp.ReleaseResponse(resp)
		x.finish()
		return done
	}
	var src streamBody = stream
	if !x.pass {
		var refused bool
		if src, refused = sniffStream(stream, resp.Header.ContentType()); refused {
			// An answer that is no stream (a gateway's HTML page, Ollama's
			// native NDJSON at a /v1 path): the engine answered, wrongly. No
			// byte of it reaches the client, who gets kvproxy's 502 (relayed,
			// it read as a stream broken off, and the engine was taken for a
			// dead one, even a model's only one).
			msg := "backend " + b.cfg.ID + " answered a stream request with Content-Type " + quotedType(resp.Header.ContentType()) + " and no event stream"
			stream.Close()
			fasthttp.ReleaseResponse(resp)
			return x.noAnswer(ctx, msg, mayRetry)
		}
	}
	if !x.pass && isJSONType(resp.Header.ContentType()) {
		var err error
		if src, err = x.wholeStream(stream, resp, body, heldBy(ctx)); err != nil {
			fasthttp.ReleaseResponse(resp)
			ns := notStreamable("")
			switch {
			case errors.As(err, &ns):
				x.failUpstream(ctx, fasthttp.StatusBadGateway, "backend "+b.cfg.ID+" "+string(ns))
			case errors.Is(err, backends.ErrOverBudget):
				x.noRoom(ctx, "the engine's answer, larger than 1 MiB")
			case errors.Is(err, backends.ErrBeyondBudget):
				x.failUpstream(ctx, fasthttp.StatusBadGateway, s.beyondBudget(b)+"; ask for less at once")
			case mayRetry && x.migrations > 0 && !x.ab.Aborted() && !errors.Is(err, backends.ErrAborted) && !backends.IsTimeout(err):
				// Cut before the client had a byte of it, as for an
				// engine that took the request and dropped it.
				b.cutOff(err.Error())
				return x.resendWhole(err)
			default:
				x.failRead(ctx, err)
			}
			x.finish()
			return done
		}
	}
	ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(b.cfg.ID))
	ctx.SetStatusCode(fasthttp.StatusOK)
	x.status = fasthttp.StatusOK
	x.engineTook()
	x.slot.hand() // every way on from here streams the answer, and finish releases it
	if x.pass {
		x.active.PrefillDone() // the engine has done its work: the answer is here
		if ct := resp.Header.ContentType(); len(ct) > 0 {
			ctx.Response.Header.SetContentTypeBytes(ct)
		} else {
			ctx.Response.Header.SetNoDefaultContentType(true) // none, as the engine sent
		}
		// The bytes go as they came: so does their coding (an engine, or
		// a gateway in front of it, may compress unasked).
		if ce := resp.Header.ContentEncoding(); len(ce) > 0 {
			ctx.Response.Header.SetContentEncodingBytes(ce)
		}
		rr := &rawRelay{x: x, body: stream, resp: resp, coded: len(resp.Header.ContentEncoding()) > 0}
		size := resp.Header.ContentLength()
		if size < 0 && !ctx.Request.Header.IsHTTP11() {
			s.relayUntilClose(ctx, rr)
			return done
		}
		ctx.SetBodyStream(rr, max(size, -1))
		return done
	}
	rl := newRelay(x, src, resp)
	fr.SetBodyRaw(nil) // sent: its body (the scratch's) goes with shedScratch
	x.shedScratch()
	ok := rl.primeInHandler()
	ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(x.b.cfg.ID)) // the stream may have moved
	if !ok {
		// Over before its first event, with nothing of the engine's to
		// relay: the client gets the failure as an HTTP status, which its
		// SDK may retry, not a 200 whose stream holds an error.
		switch {
		case x.status == 499:
			s.answerNothing(ctx)
		case rl.failCode == "shutting_down":
			s.shuttingDown(ctx, rl.failMsg)
		default:
			msg, typ, code := rl.failMsg, rl.failTyp, rl.failCode
			if msg == "" {
				msg, typ, code = "the backend serving this request ended its stream before its first event", "upstream_error", "backend_failed"
			}
			writeError(ctx, x.status, msg, typ, "", code)
		}
		rl.Close()
		return done
	}
	ctx.Response.Header.SetContentType("text/event-stream")
	ctx.Response.Header.Set("Cache-Control", "no-cache")
	ctx.Response.Header.Set("X-Accel-Buffering", "no")
	if !ctx.Request.Header.IsHTTP11() {
		s.relayUntilClose(ctx, rl)
		return done
	}
	ctx.SetBodyStream(rl, -1)
	return done
}

// shedScratch lets go of the request's parsed text, tokens and engine body
// before its stream waits for the engine's first event, which may take the
// whole prefill: nothing needs them past the sending (a migration keeps
// copies of its own), and held by the waiting handler they cost about a
// megabyte a stream of 400 KB prompts (the review). Buffers of small
// requests stay for the next.
func (x *exchange) shedScratch() {
	if sc := x.sc; sc != nil {
		x.sc = nil
		sc.req.reset()
		sc.trim(64 << 10)
	}
}

// answerNothing closes the connection of a client that hung up (or shut
// its side down) before its answer began, with no answer: fasthttp would
// write its default, an empty 200, which a client that only half-closed
// would take for a success. nginx also closes without one (its 499).
func (s *Server) answerNothing(ctx *fasthttp.RequestCtx) {
	letGoBodies(ctx)
	conn := ctx.Conn()
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(func(net.Conn) { s.watcher.Closed(conn) }) // fasthttp reports no close of a hijacked connection
}

// relayUntilClose streams to an HTTP/1.0 client, which knows no chunked
// encoding (fasthttp would send it): the body ends when the connection
// closes.
//
// The hang-up watcher keeps watching the hijacked connection (fasthttp
// reports no close for it) until the relay has ended; then it forgets it,
// before fasthttp closes it.
func (s *Server) relayUntilClose(ctx *fasthttp.RequestCtx, rl interface {
	io.WriterTo
	io.Closer
}) {
	ctx.Response.Header.SetContentLength(-2) // no length, no chunks: Connection: close
	// handle sets Request-Id when the handler returns: too late for a
	// head written here.
	if bytes.HasPrefix(ctx.Path(), messagesPath) {
		ctx.Response.Header.SetBytesV("Request-Id", ctx.Response.Header.PeekBytes(hdrRequestID))
	}
	head := append([]byte(nil), ctx.Response.Header.Header()...)
	conn := ctx.Conn()
	// The request's bodies keep their room in the budget until the relay
	// ends, as a stream's do until its request's reset: given back before
	// the hijack, they stayed in memory uncounted, and streams over
	// HTTP/1.0 took more than the budget (the soak). Whether the hijack
	// handler runs or fasthttp closes the connection without it, the
	// relay's Close gives the room back.
	end := relayEnd{relay: rl, bodies: bodiesOf(ctx)}
	s.hijacks.Store(conn, end)
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(func(c net.Conn) {
		s.hijacks.Delete(conn)
		// fasthttp recovers no panic here: one would end the process,
		// not the stream.
		defer func() {
			if p := recover(); p != nil {
				s.log.Error().Interface("panic", p).Str("stack", string(debug.Stack())).Msg("HTTP/1.0 stream relay panicked")
			}
		}()
		defer s.watcher.Closed(conn) // after end.Close; fasthttp closes c after this returns
		defer end.Close()
		if _, err := c.Write(head); err == nil {
			rl.WriteTo(c)
		}
	})
}

// relayEnd ends an HTTP/1.0 stream's relay, then gives back its request
// bodies' room.
type relayEnd struct {
	relay  io.Closer
	bodies requestBodies
}

func (e relayEnd) Close() error {
	err := e.relay.Close()
	e.bodies.Close()
	return err
}

// plainBody is a whole engine answer's body, decompressed if the engine
// (or a gateway before it) sent it with a Content-Encoding kvproxy never
// asked for: it is read here, and goes to the client plain. A body that
// does not decompress (an unknown coding, corrupt, or beyond the bound
// once decompressed) is taken as it is, and enc names its coding for the
// client. It decodes 1 MiB at most, uncounted: for error answers and
// lists (a whole answer is plainAnswer's).
func plainBody(resp *fasthttp.Response) (body, enc []byte) {
	body, enc, _, _ = plainBodyUpTo(resp, backends.Untracked, budgetShare{})
	return body, enc
}

// plainAnswer is plainBody for a whole answer: up to maxWholeAnswer, its
// decoding charged to limits.body_memory_mb, and held with the request
// (a gzip bomb was decoded uncounted: the verifying trial); err is the
// decoding's error, if any.
func (s *Server) plainAnswer(ctx *fasthttp.RequestCtx, resp *fasthttp.Response) (body, enc []byte, err error) {
	body, enc, held, err := plainBodyUpTo(resp, maxWholeAnswer, budgetShare{s.bodyMem, heldBy(ctx)})
	s.hold(ctx, held)
	return body, enc, err
}

// noRoom answers 503 body_memory_full for the engine's answer (what), which
// kvproxy has no room to hold now: no fault of the engine's.
func (x *exchange) noRoom(ctx *fasthttp.RequestCtx, what string) {
	x.status, x.errMsg = fasthttp.StatusServiceUnavailable, "no room for the answer of backend "+x.b.cfg.ID+" in limits.body_memory_mb"
	ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(x.b.cfg.ID))
	x.s.overBudget(ctx, what)
}

// beyondBudget says that b's answer is larger than the whole body budget.
func (s *Server) beyondBudget(b *backend) string {
	return fmt.Sprintf("the answer of backend %s is larger than kvproxy holds at once (limits.body_memory_mb: %d MiB)", b.cfg.ID, s.bodyMem.Limit()>>20)
}

// plainAnswer is Server.plainAnswer for the attempt's answer: its decoding
// is held with the attempt (answerHeld), given back if the attempt ends
// without relaying it (a 200 that is no answer, retried: it stayed charged
// until the request ended).
func (x *exchange) plainAnswer(ctx *fasthttp.RequestCtx, resp *fasthttp.Response) (body, enc []byte, err error) {
	body, enc, held, err := plainBodyUpTo(resp, maxWholeAnswer, budgetShare{x.s.bodyMem, heldBy(ctx) + x.answerHeld})
	x.answerHeld += held
	return body, enc, err
}

// tooLargeDecoded says that b's answer is larger, decompressed, than
// kvproxy reads whole.
func (s *Server) tooLargeDecoded(b *backend) string {
	return fmt.Sprintf("the answer of backend %s is larger, once decompressed, than kvproxy reads whole (64 MiB, and limits.body_memory_mb: %d MiB)", b.cfg.ID, s.bodyMem.Limit()>>20)
}

func plainBodyUpTo(resp *fasthttp.Response, max int, share budgetShare) (body, enc []byte, held int64, err error) {
	coding := bytes.ToLower(bytes.TrimSpace(resp.Header.ContentEncoding()))
	if len(coding) == 0 || string(coding) == "identity" {
		return resp.Body(), nil, 0, nil
	}
	b, held, err := decoded(coding, resp.Body(), max, share)
	if err != nil {
		return resp.Body(), coding, 0, err
	}
	return b, nil, held, nil
}

// silent says that b's engine went silent past limits.stream_idle_timeout.
func (b *backend) silent() string {
	return "backend " + b.cfg.ID + " sent nothing for " + b.up.ReadTimeout.String() + " (limits.stream_idle_timeout)"
}

// noAnswer ends an attempt whose engine answered 200 with no answer (msg
// says what it sent): counted against it as an error answer, the request
// goes to the next engine, or the client gets a 502.
func (x *exchange) noAnswer(ctx *fasthttp.RequestCtx, msg string, mayRetry bool) outcome {
	x.b.answeredError(msg)
	return x.badGateway(ctx, msg, mayRetry)
}

// badGateway ends an attempt its engine gave no answer to (msg says why):
// the request goes to the next engine, or the client gets a 502.
func (x *exchange) badGateway(ctx *fasthttp.RequestCtx, msg string, mayRetry bool) outcome {
	if mayRetry {
		x.errMsg = msg
		if x.refusal == nil { // an engine's 429 or 503 says more
			x.refused = fasthttp.StatusBadGateway
		}
		return x.endAttempt()
	}
	x.failUpstream(ctx, fasthttp.StatusBadGateway, msg)
	x.finish()
	return done
}

// resendWhole ends an attempt whose engine took the request and failed
// (err) before the client had a byte of the answer: the next engine is
// sent it whole and computes it all (limits.migration_limit).
func (x *exchange) resendWhole(err error) outcome {
	return x.resendAfter("backend " + x.b.cfg.ID + " " + upstreamFault(err))
}

// resendAfter is resendWhole, the engine's failure said by msg.
func (x *exchange) resendAfter(msg string) outcome {
	x.migrations--
	x.resend = true
	x.errMsg = msg
	x.refused = fasthttp.StatusBadGateway
	return x.endAttempt()
}

// engineTook marks the exchange taken by its engine (it answered 200): what
// earlier attempts failed with is what it was retried after.
func (x *exchange) engineTook() {
	x.accepted = true
	if x.errMsg != "" {
		x.retriedAfter, x.errMsg = x.errMsg, ""
	}
}

// relayWhole passes a complete engine answer to the client.
// body is its body decoded (plainBody, plainAnswer), or as it came in
// coding enc.
func (x *exchange) relayWhole(ctx *fasthttp.RequestCtx, resp *fasthttp.Response, body, enc []byte) {
	code := resp.StatusCode()
	x.status = code
	if code == fasthttp.StatusOK {
		x.active.PrefillDone()
		x.engineTook()
		x.usage.read(body)
	} else {
		if x.errMsg != "" && x.retriedAfter == "" { // what earlier attempts failed with
			x.retriedAfter = x.errMsg
		}
		x.errMsg = "engine answered " + strconv.Itoa(code) + engineErrorKind(body) // in the engine's words
		body = normalizeEngineError(code, body)
		if code == fasthttp.StatusNotFound && x.resp.lostPrevious(body) {
			body = previousNotFound(body)
		}
	}
	if x.resp != nil && enc == nil {
		if code == fasthttp.StatusOK {
			x.resp.learn(body)
			body = x.resp.rewrite(body)
		} else {
			body = x.resp.rewriteError(body)
		}
	}
	if code == fasthttp.StatusTooManyRequests || code == fasthttp.StatusServiceUnavailable {
		if ra := resp.Header.Peek("Retry-After"); len(ra) > 0 {
			ctx.Response.Header.SetBytesV("Retry-After", ra)
		} else {
			ctx.Response.Header.Set("Retry-After", "1")
		}
	}
	ctx.SetStatusCode(code)
	ct := resp.Header.ContentType()
	if code != fasthttp.StatusOK || len(ct) == 0 {
		ct = []byte("application/json")
	}
	ctx.Response.Header.SetContentTypeBytes(ct)
	if enc != nil && code == fasthttp.StatusOK {
		ctx.Response.Header.SetContentEncodingBytes(enc)
	}
	ctx.SetBody(body)
}

// logRedirect warns, for an engine's redirect (a 3xx code), where it
// redirects to. An engine's redirect names an address of its own, which is
// no answer for the client (an http URL for an engine behind https, a path
// with a missing slash), and which only the operator may see.
func (b *backend) logRedirect(code int, resp *fasthttp.Response) {
	if code >= 300 && code < 400 {
		b.log.Warn().Str("backend", b.cfg.ID).Int("status", code).Str("location", redirectTarget(resp.Header.Peek("Location"))).
			Msg("the engine answered with a redirect: check the backend's url")
	}
}

// redirectTarget is a redirect's Location for the log, without what may be
// a secret in it: user info and the query (a login page's token).
func redirectTarget(loc []byte) string {
	u, err := url.Parse(string(loc))
	if err != nil {
		return "(not a URL)"
	}
	u.User = nil
	if u.RawQuery != "" || u.ForceQuery {
		u.RawQuery, u.ForceQuery = "…", false
	}
	u.Fragment, u.RawFragment = "", ""
	return u.String()
}

// readWhole reads an engine's streamed answer whole into resp's body, at
// most limit bytes, and releases the stream. When the read fails it
// answers the client as the failure says and returns false.
func (x *exchange) readWhole(ctx *fasthttp.RequestCtx, stream *backends.Body, resp *fasthttp.Response, limit int64) bool {
	raw, err := readRest(stream, resp, limit)
	if err != nil {
		x.failRead(ctx, err)
		return false
	}
	resp.SetBodyRaw(raw)
	resp.StreamBody = false
	return true
}

// readRest reads a streamed answer whole, up to limit bytes, and releases
// the stream.
func readRest(stream *backends.Body, resp *fasthttp.Response, limit int64) ([]byte, error) {
	var buf bytes.Buffer
	if n := resp.Header.ContentLength(); n > 0 && int64(n) < limit {
		// One buffer, not a doubling series; the declared length only up
		// to a few MiB before the bytes come (an engine may declare more
		// and stall).
		buf.Grow(min(n, 4<<20))
	}
	var err error
	if resp.BodyStream() != nil {
		_, err = buf.ReadFrom(io.LimitReader(stream, limit))
	}
	stream.Close()
	if err == io.EOF {
		err = nil
	}
	return buf.Bytes(), err
}

// failRead answers the client for an engine answer whose body could not
// be read (err), as the cause says.
func (x *exchange) failRead(ctx *fasthttp.RequestCtx, err error) {
	aborted := errors.Is(err, backends.ErrAborted) || x.ab.Aborted()
	switch {
	case aborted && x.s.live.isCut():
		x.status, x.errMsg = fasthttp.StatusServiceUnavailable, errCutMsg
		x.s.shuttingDown(ctx, errCutMsg)
	case aborted && x.unresponsive.Load() != nil:
		x.failUpstream(ctx, fasthttp.StatusGatewayTimeout, *x.unresponsive.Load())
	case aborted: // the client hung up: the engine is not at fault
		x.status = 499
		x.s.answerNothing(ctx)
	case backends.IsTimeout(err):
		msg := x.b.silent()
		x.b.fail(ejectTimeout, msg+" mid-answer")
		x.failUpstream(ctx, fasthttp.StatusGatewayTimeout, msg)
	default:
		x.b.cutOff(err.Error())
		x.failUpstream(ctx, fasthttp.StatusBadGateway, "backend "+x.b.cfg.ID+" "+upstreamFault(err))
		x.errMsg += ": " + err.Error()
	}
}

// answerRefusal answers with the last engine refusal that made the request
// retry, as the engine gave it (status, error, Retry-After), when no other
// engine may take it; with a 502 when every attempt found its engine down.
func (x *exchange) answerRefusal(ctx *fasthttp.RequestCtx) {
	if x.refusal == nil {
		x.failUpstream(ctx, x.refused, x.errMsg)
	} else {
		x.status = x.refusalCode
		ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(x.refusalBy))
		ctx.SetStatusCode(x.refusalCode)
		ctx.Response.Header.SetContentType("application/json")
		ctx.SetBody(x.refusal)
	}
	// An engine's failure (500, 502, 504) gets no Retry-After of kvproxy's
	// own: the request, tried elsewhere, may be the cause.
	if ra := x.refusalRetry; ra != "" || x.refusalCode != fasthttp.StatusNotFound && x.refusalCode != fasthttp.StatusInternalServerError &&
		x.refusalCode != fasthttp.StatusBadGateway && x.refusalCode != fasthttp.StatusGatewayTimeout {
		if ra == "" {
			ra = "1"
		}
		ctx.Response.Header.Set("Retry-After", ra)
	}
	x.logLine()
}

// noRetry says to the client's SDK not to send the request again
// (x-should-retry: false, which the OpenAI and Anthropic SDKs obey), for a
// 504 of a non-streamed answer its engine did not finish within
// stream_idle_timeout: an SDK sent it twice more, to the same engine (it
// caches the prompt), for the same wait, and three such in a row ejected
// the engine (the twenty-ninth session's SDK trial).
func noRetry(ctx *fasthttp.RequestCtx) { ctx.Response.Header.Set("X-Should-Retry", "false") }

// upstreamFault tells the client how an engine's answer failed. The error
// itself stays in the log: a dial error names the engine's address, and
// fasthttp's parse errors quote the bytes the engine sent.
func upstreamFault(err error) string {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return "closed the connection before its answer was complete"
	}
	if errors.Is(err, backends.ErrAborted) {
		return "failed: the exchange was aborted"
	}
	return "sent an answer kvproxy could not read"
}

func (x *exchange) failUpstream(ctx *fasthttp.RequestCtx, status int, msg string) {
	x.status = status
	x.errMsg = msg
	if x.b != nil {
		ctx.Response.Header.SetCanonical(hdrWorker, stringBytes(x.b.cfg.ID))
	}
	// The codes of a stream cut the same way (sse.go), so a client reads
	// one code whichever way it asked.
	typ, code := "upstream_error", "backend_failed"
	switch status {
	case fasthttp.StatusGatewayTimeout:
		typ, code = "timeout_error", "backend_timeout"
	case fasthttp.StatusTooManyRequests:
		typ, code = "rate_limit_error", "rate_limit_exceeded"
	}
	writeError(ctx, status, msg, typ, "", code)
}

// engineRequest is x's request to backend b's engine (its data-parallel
// rank), with body; release it with fasthttp.ReleaseRequest.
func (x *exchange) engineRequest(trace *traceValues, b *backend, rank int, body []byte) *fasthttp.Request {
	fr := fasthttp.AcquireRequest()
	fr.Header.SetMethod(fasthttp.MethodPost)
	fr.SetRequestURI(x.path)
	fr.Header.SetHost(b.host)
	fr.Header.SetContentType("application/json")
	fr.Header.SetCanonical(hdrRequestID, stringBytes(x.engineID))
	if b.authHeader != "" {
		fr.Header.Set("Authorization", b.authHeader)
	}
	if rank > 0 || b.dataParallel() {
		// Rank 0 too: without the header vLLM balances the request over
		// its ranks itself, away from the one whose cache was chosen.
		fr.Header.Set("X-Data-Parallel-Rank", strconv.Itoa(rank))
	}
	for i, h := range traceHeaders {
		if v := trace[i]; len(v) > 0 {
			fr.Header.SetCanonical(h, v)
		}
	}
	fr.SetBodyRaw(body)
	return fr
}

// endAttempt ends an attempt the engine never took: its watch and slots
// go, and the next attempt takes new ones.
func (x *exchange) endAttempt() outcome {
	x.letGoAnswer()
	x.stopWatch()
	x.release()
	x.released = false
	return retryable
}

// letGoAnswer gives back the budget share of an attempt's answer that was
// not relayed (an engine's refusal, retried or failed): its response is
// released.
func (x *exchange) letGoAnswer() {
	x.s.bodyMem.Give(x.answerHeld)
	x.answerHeld = 0
}

func (x *exchange) stopWatch() {
	x.s.watcher.Unwatch(x.watch)
	x.watch = nil
}

// finish ends the exchange: stops watching the client, frees the slot
// (idempotent), records metrics and writes the access log line.
func (x *exchange) finish() {
	x.letGoAnswer()
	x.mig.letGo(x.s.bodyMem)
	x.stopWatch()
	x.release()
	x.slot.release()
	if x.resp != nil && x.resp.prevOrig != "" && x.accepted && x.usage.prompt > x.promptTokens {
		// The engine put the stored conversation before the input: the
		// budget pays for what it computed, not for what kvproxy saw.
		x.budget.charge(float64(x.usage.prompt - x.promptTokens))
	}
	x.logLine()
	x.s.live.done(x)
}

func (x *exchange) logLine() {
	s := x.s
	dur := time.Since(x.start)
	s.metrics.countRequest(x.b.cfg.ID, x.status)
	s.metrics.observeDuration(x.b.cfg.ID, dur.Seconds())
	prompt, completion, cached := x.tokens()
	if x.stream && x.status == fasthttp.StatusOK && x.ttft > 0 && completion > 1 && !x.wholeAnswer {
		// The mean gap between output tokens after the first (inter-token
		// latency), once a stream: per token would cost the relay.
		s.metrics.observeTPOT(x.b.cfg.ID, (dur-x.ttft).Seconds()/float64(completion-1))
	}
	metered := x.accepted && (!x.pass || x.usage.prompt >= 0) // pass-through: only an answer's own usage
	if metered {
		model := x.p.cfg.Name
		if x.lora != "" && slices.Contains(x.p.names.Load().adapters, x.lora) {
			model = x.lora // a configured name: engines' lists do not name series
		}
		s.metrics.countTokens(model, x.tenant, prompt, completion, cached)
	}
	ev := s.log.Info()
	if x.status >= 500 {
		ev = s.log.Warn()
	}
	ev = ev.Str("request_id", x.id)
	if x.engineID != x.id {
		// The client named the request: any client can send any id, so
		// the line also has the one kvproxy made unique, which the engine
		// logs too (the security review).
		ev = ev.Str("engine_request_id", x.engineID)
	}
	ev = ev.IPAddr("remote", x.remote).Str("path", x.path).
		Str("model", x.model).Str("tenant", x.tenant).Str("backend", x.b.cfg.ID)
	ev = ev.Int("overlap_blocks", x.d.Overlap).Int("total_blocks", x.d.Total).
		Bool("stream", x.stream).Int("status", x.status).
		Dur("duration", dur)
	if x.ttft > 0 {
		ev = ev.Dur("ttft", x.ttft)
	}
	if x.firstSent > 0 {
		ev = ev.Dur("sent", x.firstSent)
	}
	if x.queued > 0 {
		ev = ev.Dur("queued", x.queued)
	}
	if x.prefillBy != "" {
		ev = ev.Str("prefill_backend", x.prefillBy).Dur("prefill", x.prefillTime)
	}
	if x.prefillErr != "" {
		ev = ev.Str("prefill_error", x.prefillErr)
	}
	if x.mig != nil && len(x.mig.from) > 0 {
		ev = ev.Strs("migrated_from", x.mig.from)
	}
	if metered {
		ev = ev.Int("prompt_tokens", prompt).Int("output_tokens", completion)
		if x.usage.cached >= 0 {
			ev = ev.Int("cached_tokens", cached)
		}
	}
	if x.retriedAfter != "" {
		ev = ev.Str("retried_after", x.retriedAfter)
	}
	if x.errMsg != "" {
		ev = ev.Str("error", x.errMsg)
	}
	ev.Msg("request")
}

// tokens are the request's prompt, output and cached tokens: the engine's
// own usage where it reported one, else what kvproxy counted (the prompt
// it tokenized for routing, the stream chunks that carried output).
func (x *exchange) tokens() (prompt, completion, cached int) {
	prompt, completion, cached = x.usage.prompt, x.usage.completion, max(x.usage.cached, 0)
	if prompt < 0 {
		prompt = x.promptTokens
	}
	// A stream cut before its last usage (continuous_usage_stats) has at
	// least a token per chunk that carried output.
	completion = max(completion, x.outputTokens)
	return prompt, completion, cached
}

// logClip is a client's string for a log line: its first 200 bytes (cut
// at a character's start) and an ellipsis. The line count is bounded
// per tenant; its size was not: a 10 MB model name made a 10 MB line.
func logClip(b []byte) string {
	const most = 200
	if len(b) <= most {
		return string(b)
	}
	i := most
	for i > 0 && !utf8.RuneStart(b[i]) {
		i--
	}
	return string(b[:i]) + "…"
}

// rejectEvent is the log event of a request kvproxy answered itself: a
// failure's (5xx: saturation, an outage) a warning, as an engine's is, so
// that a log at warn keeps it.
func (s *Server) rejectEvent(status int) *zerolog.Event {
	if status >= 500 {
		return s.log.Warn()
	}
	return s.log.Info()
}

// logRejected counts and logs a request kvproxy answered itself. The log
// lines are bounded per tenant and reason (logLimiter); the metrics count
// every one.
func (s *Server) logRejected(ctx *fasthttp.RequestCtx, rid, tenant, model string, status int, start time.Time, reason string) {
	s.metrics.countRequest("", status)
	if !s.rejectLog.allow(tenant, reason, status >= 500) {
		return
	}
	s.rejectEvent(status).Str("request_id", rid).IPAddr("remote", s.st.Load().clientIP(ctx)).Str("path", logClip(ctx.Path())).
		Str("model", logClip(stringBytes(model))).Str("tenant", tenant).Int("status", status).
		Dur("duration", time.Since(start)).Str("error", reason).Msg("request")
}
