package proxy

import (
	"bytes"
	"errors"
	"net"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

// Stream migration (limits.migration_limit), as Dynamo's frontend does it:
// when the engine of a chat or completion stream fails mid-answer (its
// connection drops, it goes silent, or its health probe fails), the
// request is sent again to another engine with the output relayed so far
// appended to the prompt (chat: as a final assistant message the engine
// continues, vLLM's and SGLang's continue_final_message), and asked for
// the output still due. The client's stream goes on where it stopped.
//
// Only what can be continued is: one choice, a text prompt, output of text
// alone (no tool calls or reasoning relayed yet), no constrained output,
// echo or prompt logprobs, not pinned to an engine, and only onto engines
// that continue a final message (kind vllm, sglang or mock).

// migration is what a stream needs to be continued on another engine.
type migration struct {
	chat bool   // chat completions (else completions)
	body []byte // the client's request, decoded
	// held: what body holds of the server's body budget (over 1 MiB),
	// given back when the exchange ends (letGo: finish, abandon, or
	// dispatch when no relay holds the exchange).
	held  int64
	salt  string // the tenant's cache_salt, for engines that take one
	trace traceValues
	conn  net.Conn // the client's, watched for a hang-up while moving
	// routing: the prompt's blocks and size, the context it needs (prompt
	// and output asked for), the backends that failed it or refused to
	// continue it
	hashes       []kv.BlockHash
	promptTokens int
	need         int
	tried        []string
	// maxTokens is the output asked for: what the request names, or the
	// engines' default for completions, 16 (defaultMax); 0 for none
	maxTokens    int
	defaultMax   bool
	dropPriority bool
	priorityTo   int

	partial  []byte // the output relayed so far: JSON string contents, escaped
	off      bool   // output other than text was relayed: it cannot be continued
	finished bool   // a finish_reason was relayed: the answer is whole
	carried  int    // output tokens the current engine got as prompt
	from     []string
}

// migratable reports whether a streamed request may be continued on
// another engine if its own fails (see migration).
func migratable(req *apiRequest, kind api, rr *router.Request) bool {
	if !req.stream || kind != apiChat && kind != apiCompletions || rr.Pinned || !req.oneChoice ||
		req.hasTokens || len(req.batchTexts)+len(req.batchTokens) > 0 || !req.addGenPrompt {
		return false
	}
	for m := (members{b: req.body}); m.next(); {
		v := m.value
		switch {
		case keyIs(m.key, "echo"), keyIs(m.key, "continue_final_message"):
			if string(v) == "true" {
				return false
			}
		case keyIs(m.key, "response_format"):
			// {"type": "text"} constrains nothing; a schema would restart.
			if !isNull(v) && !bytes.Equal(bytes.Join(bytes.Fields(v), nil), []byte(`{"type":"text"}`)) {
				return false
			}
		case keyIs(m.key, "guided_json"), keyIs(m.key, "guided_regex"), keyIs(m.key, "guided_choice"),
			keyIs(m.key, "guided_grammar"), keyIs(m.key, "structured_outputs"), keyIs(m.key, "prompt_logprobs"):
			if !isNull(v) {
				return false
			}
		case keyIs(m.key, "best_of"):
			if !isNull(v) && string(v) != "1" {
				return false
			}
		}
	}
	return true
}

// completionsDefaultMax is vLLM's and SGLang's max_tokens for a
// completion request that names none.
const completionsDefaultMax = 16

// newMigration keeps what continuing a stream needs; need is the context
// the request needs (its prompt and the output it asks for).
func newMigration(ctx *fasthttp.RequestCtx, req *apiRequest, kind api, rr *router.Request, salt string, need int) *migration {
	m := &migration{
		chat: kind == apiChat, body: bytes.Clone(req.body), salt: strings.Clone(salt), conn: ctx.Conn(), partial: make([]byte, 0, 1024),
		hashes: append([]kv.BlockHash(nil), rr.Hashes...), promptTokens: rr.PromptTokens, need: need,
		maxTokens: req.maxTokens, dropPriority: req.dropPriority, priorityTo: req.priorityTo,
	}
	if !m.chat && m.maxTokens == 0 {
		m.maxTokens, m.defaultMax = completionsDefaultMax, true
	}
	for i, v := range traceOf(&ctx.Request.Header) {
		m.trace[i] = bytes.Clone(v)
	}
	return m
}

// letGo gives back what the body kept for a move holds of mem, once; m
// may be nil.
func (m *migration) letGo(mem *backends.Budget) {
	if m != nil {
		mem.Give(m.held)
		m.held = 0
	}
}

// stop turns the move off for good: what was kept for it goes, and its
// share of the budget (mem) with it, not when the stream ends.
func (m *migration) stop(mem *backends.Budget) {
	m.off = true
	m.body, m.partial = nil, nil
	m.letGo(mem)
}

var finishKey = []byte(`"finish_reason":`)

// note reads a chunk the relay passes on, whose output outputOf found
// (key, v): the text it adds to the answer, or that the answer can no
// longer be continued.
func (m *migration) note(data []byte, key int, v []byte) {
	if m.off || m.finished {
		return
	}
	rest := data // the chunk after its output
	switch {
	case key == 0 && m.chat || key == 1 && !m.chat: // content, text
		end, err := skipValue(v, 0)
		if err != nil {
			m.off = true
			return
		}
		if len(m.partial)+end-2 > maxMovedOutput {
			// An answer this long is not moved: what it has relayed
			// stayed in memory, uncounted, for the stream's whole life
			// (the chaos trial: 8 streams of 100 MB held 1.7 GB), and
			// a move would tokenize and resend it all.
			m.off = true
			m.partial = nil
			return
		}
		m.partial = append(m.partial, v[1:end-1]...)
		rest = v[end:]
	case key >= 0: // reasoning, tool calls: not text to continue
		m.off = true
		return
	}
	if v := valueAfter(rest, finishKey); len(v) > 0 && v[0] == '"' {
		m.finished = true
	}
}

// maxMovedOutput bounds the output (as JSON string content) a stream may
// have relayed and still move: some 250,000 tokens of text, more than any
// model's output limit.
const maxMovedOutput = 1 << 20

// continuation is the client's request continued after the output so far,
// which counts emitted tokens: the text appended to the prompt, the output
// asked for reduced by what was relayed.
func (m *migration) continuation(emitted int) []byte {
	out := []byte{'{'}
	sep := func() {
		if len(out) > 1 {
			out = append(out, ',')
		}
	}
	wroteMax := false
	for mb := (members{b: m.body}); mb.next(); {
		k, v := mb.key, mb.value
		switch {
		case m.chat && keyIs(k, "messages") && len(m.partial) > 0:
			sep()
			out = append(out, `"messages":`...)
			out = append(out, bytes.TrimRight(v[:len(v)-1], " \t\r\n")...) // the array without its ]
			out = append(out, `,{"role":"assistant","content":"`...)
			out = append(append(out, m.partial...), `"}],"add_generation_prompt":false,"continue_final_message":true`...)
			continue
		case m.chat && len(m.partial) > 0 && (keyIs(k, "add_generation_prompt") || keyIs(k, "continue_final_message")):
			continue
		case !m.chat && keyIs(k, "prompt"):
			sep()
			out = append(out, `"prompt":`...)
			text := v
			if v[0] == '[' { // a batch of one
				text = bytes.TrimSpace(v[1 : len(v)-1])
			}
			if len(text) < 2 || text[0] != '"' {
				// Not the prompt the request was read with, an earlier
				// member of its name ("prompt":[] then "prompt":"x"): the
				// engine reads the last one too (the fuzzing trial: it
				// panicked here).
				out = append(out, v...)
				continue
			}
			out = append(append(append(out, text[:len(text)-1]...), m.partial...), '"')
			continue
		case keyIs(k, "max_tokens") || keyIs(k, "max_completion_tokens") || keyIs(k, "min_tokens"):
			n := tokenCount(v)
			if n == 0 && m.defaultMax && keyIs(k, "max_tokens") {
				continue // null: the default, written below
			}
			if n > 0 {
				least := 1 // an engine refuses max_tokens 0
				if keyIs(k, "min_tokens") {
					least = 0
				} else {
					wroteMax = true
				}
				sep()
				out = append(append(out, '"'), k...)
				out = strconv.AppendInt(append(out, `":`...), int64(max(n-emitted, least)), 10)
				continue
			}
		}
		sep()
		out = append(out, mb.member...)
	}
	if m.defaultMax && !wroteMax {
		sep()
		out = strconv.AppendInt(append(out, `"max_tokens":`...), int64(max(completionsDefaultMax-emitted, 1)), 10)
	}
	return append(out, '}')
}

// emitted is the output relayed so far, in tokens: the chunks that carried
// it, or the carried text's tokens as the model's tokenizer counts them
// when that is more (an engine may send several tokens a chunk:
// speculative decoding, --stream-interval).
func (m *migration) emitted(x *exchange) int {
	n := x.outputTokens
	if enc := x.p.enc; enc != nil && len(m.partial) > 0 {
		text := appendUnquoted(nil, m.partial)
		n = max(n, len(enc.EncodeText(nil, unsafe.String(unsafe.SliceData(text), len(text)))))
	}
	return n
}

// avoid is what routing a continuation on p leaves out: the engines that
// cannot serve the request (its adapter, its length, prefill engines),
// cannot continue a message, or have failed it.
func (m *migration) avoid(p *modelPool, lora string) []router.WorkerID {
	var avoid []router.WorkerID
	if lora != "" {
		avoid = p.avoidForAdapter(avoid, lora)
	}
	for _, id := range m.tried {
		if w, ok := p.rt.WorkerByName(id); ok {
			avoid = append(avoid, w)
			if b := p.backend(w); b != nil {
				avoid = append(avoid, b.workerIDs()...)
			}
		}
	}
	avoid = p.avoidForKind(avoid)
	avoid = p.avoidForLength(avoid, m.need) // the room left among those
	avoid, _ = p.avoidForRole(avoid, false)
	if lora != "" {
		avoid = p.avoidFullBatches(avoid, lora)
	}
	return avoid
}

// continues reports whether b's engine can continue a final assistant
// message (vLLM's and SGLang's continue_final_message).
func (b *backend) continues() bool { return b.cfg.Kind != config.KindOpenAI }

// moveResult is how an attempt to move a stream ended.
type moveResult int

const (
	notMoved   moveResult = iota // not tried, or no engine could continue it
	moved                        // the relay reads the new engine's stream
	clientLeft                   // the client hung up while it moved
	cutShort                     // the drain deadline cut it while it moved
)

// migrate continues the stream on another engine after its engine failed
// (why). The failed engine's failure is counted by the caller before.
// When it tried and could not, detail says why, for the log.
func (r *relay) migrate(why string) (res moveResult, detail string) {
	x, m := r.x, r.x.mig
	if m == nil || m.off || m.finished || r.sawDone || x.ab.Aborted() && x.unresponsive.Load() == nil {
		return notMoved, ""
	}
	// A stream that could move and does not is a failed migration for
	// the metric: counted apart, one moved before and failing again went
	// unseen (the review).
	if x.migrations == 0 {
		x.s.metrics.migrations.WithLabelValues(x.b.cfg.ID, "failed").Inc()
		return notMoved, "; not moved: its moves (limits.migration_limit) are spent"
	}
	emitted := m.emitted(x)
	if m.maxTokens > 0 && emitted >= m.maxTokens {
		x.s.metrics.migrations.WithLabelValues(x.b.cfg.ID, "failed").Inc()
		return notMoved, "; not moved: the output relayed has the tokens asked for"
	}
	s, failed, failedD := x.s, x.b, x.d
	m.tried = append(m.tried, failed.cfg.ID)
	x.stopWatch()
	x.release()
	r.body.Close()
	fasthttp.ReleaseResponse(r.resp)
	r.body, r.resp = nil, nil
	x.letGoAnswer() // a whole answer read for the failed engine's stream
	defer func() {
		if res == moved {
			return
		}
		// The request's line and metrics name the engine that failed it,
		// not the last that refused to continue it.
		x.b, x.d, x.released = failed, failedD, true
		if res == notMoved {
			s.metrics.migrations.WithLabelValues(failed.cfg.ID, "failed").Inc()
		}
	}()
	retried := false // the last continuation refused a connection, and a retry was spent on the next
	for x.migrations > 0 {
		x.migrations--
		// A fresh abort: the failed engine's may be aborted (a probe's
		// cut). Cuts see the exchange all along: the drain's aborts it.
		s.live.move(x, nil, new(backends.Abort))
		if s.live.isCut() {
			return cutShort, ""
		}
		st := s.st.Load()
		if p := st.models[x.p.cfg.Name]; p != nil && p != x.p {
			// A reload rebuilt the model's pool: its router, and maybe its
			// blocks.
			if p.cfg.BlockSize != x.p.cfg.BlockSize || p.cfg.Tokenizer != x.p.cfg.Tokenizer || p.cfg.Template != x.p.cfg.Template {
				m.hashes = nil
			}
			x.p = p
		}
		rr := router.Request{Hashes: m.hashes, PromptTokens: m.promptTokens + emitted, Avoid: m.avoid(x.p, x.lora), Repeat: true}
		x.released = false
		if err := x.route(m.conn, st, &rr); err != nil {
			x.released = true // nothing held
			if retried {
				s.retries.refund() // no engine took it: the retry was not made
			}
			switch {
			case errors.Is(err, errClientGone):
				return clientLeft, ""
			case s.live.isCut():
				return cutShort, ""
			}
			return notMoved, detail + "; no backend could continue it: " + err.Error()
		}
		x.heard.Store(0)
		s.live.move(x, x.b, x.ab) // a failing probe of the new engine cuts it
		stream, resp, err := r.sendContinuation(emitted)
		if err == nil {
			s.metrics.migrations.WithLabelValues(failed.cfg.ID, "ok").Inc()
			m.from = append(m.from, failed.cfg.ID)
			m.carried = emitted
			r.body, r.resp = stream, resp
			r.f.reset()
			r.quietSince = 0 // the new engine's silence counts anew
			// Resumed only if the client has had the answer's first chunk
			// (its role): otherwise the new engine's is the stream's first.
			r.moved, r.resumed, r.restarted, r.blockBase, r.blocks = true, r.sawFirst, true, x.outputTokens, 0
			s.log.Warn().Str("request_id", x.id).Str("backend", failed.cfg.ID).Str("to", x.b.cfg.ID).
				Int("output_tokens", emitted).Str("reason", why).Msg("stream migrated")
			return moved, ""
		}
		x.release()
		switch {
		case s.live.isCut():
			return cutShort, ""
		case x.ab.Aborted() && x.unresponsive.Load() == nil:
			return clientLeft, ""
		}
		m.tried = append(m.tried, x.b.cfg.ID)
		detail += "; backend " + x.b.cfg.ID + " could not continue it: " + err.Error()
		if overBudget(err) {
			// kvproxy's want of room, which the next engine's answer
			// would meet too, after doing the work again.
			return notMoved, detail
		}
		retried = false
		if ce := (*backends.ConnectError)(nil); errors.As(err, &ce) && s.retries.withdraw() {
			// It never got the continuation: a retry, as for a request
			// refused a connection, and no migration spent (the trial:
			// an engine down took the only one, with four others well).
			x.migrations++
			retried = true
		}
	}
	return notMoved, detail
}

// mayMove reports whether the stream would try to move to another engine
// should its engine fail: it can, the client has had no error or [DONE],
// and its answer has not finished. With its moves spent the try counts as
// a failed migration (migrate).
func (r *relay) mayMove() bool {
	m := r.x.mig
	return m != nil && !m.off && !m.finished && !r.sawDone
}

// moveOrEnd tries to move the stream after its engine failed (why); it
// reports whether the stream goes on or has been ended (a client gone, a
// drain cut: out then holds the ending), and otherwise detail, for the
// caller to end the stream with the engine's failure.
func (r *relay) moveOrEnd(why string, out []byte) (next []byte, handled bool, detail string) {
	x := r.x
	res, detail := r.migrate(why)
	switch res {
	case moved:
		r.ended = false
	case clientLeft:
		x.status = 499
		x.errMsg = ""
	case cutShort:
		x.errMsg = errCutMsg
		x.status = fasthttp.StatusServiceUnavailable
		out = r.failEvent(out, errCutMsg, "service_unavailable", "shutting_down")
	default:
		return out, false, detail
	}
	return out, true, ""
}

var errNotStreamed = errors.New("answered without a stream")

// sendContinuation sends the continued request to the engine x was just
// routed to, and returns its stream once it answered 200.
func (r *relay) sendContinuation(emitted int) (streamBody, *fasthttp.Response, error) {
	x, m, b := r.x, r.x.mig, r.x.b
	var req apiRequest
	if pe := req.parse(m.continuation(emitted), m.chat); pe != nil {
		return nil, nil, pe
	}
	req.dropPriority, req.priorityTo = m.dropPriority, m.priorityTo
	req.sendPriority = req.dropPriority && b.cfg.PriorityScheduling
	req.engineSampling = b.cfg.Kind != config.KindOpenAI
	req.addUsage = x.addedUsage && x.usageFor(&req, b)
	salt, served := "", b.cfg.ServedModel
	if b.salted {
		salt = m.salt
	}
	if x.lora != "" {
		served = x.lora
	}
	body, err := req.forwardBody(nil, served, salt)
	if err != nil {
		return nil, nil, err
	}
	fr := x.engineRequest(&m.trace, b, x.rank, body)
	defer fasthttp.ReleaseRequest(fr)
	fr.Header.Set("Accept", "text/event-stream")
	at := &attempt{ab: x.ab, active: x.active}
	x.watch = x.s.watcher.Watch(m.conn, at)
	x.sent = time.Now()
	x.heard.Store(0)
	resp := fasthttp.AcquireResponse()
	stream, err := b.up.Do(fr, resp, true, x.ab)
	if err != nil || resp.StatusCode() != fasthttp.StatusOK || stream == nil {
		x.stopWatch() // kept for the stream otherwise, as forward keeps it
	}
	var ce *backends.ConnectError
	switch {
	case err == nil && resp.StatusCode() == fasthttp.StatusOK && stream != nil:
		x.heard.Store(coarseNow())
		src, refused := sniffStream(stream, resp.Header.ContentType())
		if refused {
			// No stream (forward refuses it the same way): the engine
			// answered wrongly.
			x.stopWatch()
			stream.Close()
			err = errors.New("it answered with Content-Type " + quotedType(resp.Header.ContentType()) + " and no event stream")
			b.answeredError("backend " + b.cfg.ID + " " + err.Error())
			break
		}
		if !isJSONType(resp.Header.ContentType()) {
			b.succeed()
			return src, resp, nil
		}
		// A whole answer, streamed as the first attempt's would be.
		src, werr := x.wholeStream(stream, resp, body, m.held)
		if werr == nil {
			b.succeed()
			return src, resp, nil
		}
		x.stopWatch()
		err = werr
		switch ns := notStreamable(""); {
		case errors.As(werr, &ns) || overBudget(werr) || errors.Is(werr, backends.ErrAborted) || x.ab.Aborted():
		case backends.IsTimeout(werr):
			b.fail(ejectTimeout, "went silent in a continued stream's answer")
		default:
			b.cutOff(werr.Error())
		}
	case err == nil:
		code := resp.StatusCode()
		if stream != nil {
			stream.Close()
		}
		switch {
		case code == fasthttp.StatusTooManyRequests:
			b.coolDown(coolingFor(resp.Header.Peek("Retry-After")))
		case code == fasthttp.StatusInternalServerError:
			b.answeredError("status 500")
		case code >= 500:
			b.ejectForAnswer(ejectStatus, "status "+strconv.Itoa(code))
		}
		err = errors.New("it answered " + strconv.Itoa(code))
		if code == fasthttp.StatusOK {
			err = errNotStreamed
		}
	case errors.Is(err, backends.ErrAborted):
	case errors.As(err, &ce):
		b.failDial(ce)
	case backends.IsTimeout(err):
		b.fail(ejectTimeout, "sent nothing for a continued stream")
	default:
		b.cutOff(err.Error())
	}
	fasthttp.ReleaseResponse(resp)
	return nil, nil, err
}

// avoidForKind appends to avoid the workers of the model's engines that
// cannot continue a final message.
func (p *modelPool) avoidForKind(avoid []router.WorkerID) []router.WorkerID {
	for b := range p.engines() {
		if !b.continues() {
			avoid = append(avoid, b.workerIDs()...)
		}
	}
	return avoid
}

// dropped replaces an event the client must not get (onEvent).
var dropped = []byte{}

// continued inspects a chunk of a stream continued on another engine. It
// reports whether to drop it: before the engine's first token, a chunk
// that neither carries output, finishes, reports usage nor is an error
// restates the role. It returns the chunk with its usage restated as the
// client's request has it (the output carried over in the prompt counted
// as output), or nil to relay it as it is.
func (r *relay) continued(data []byte) (fixed []byte, drop bool) {
	x := r.x
	if r.restarted {
		// The new engine has computed its prompt (firstEvent says it for
		// a stream that had relayed nothing).
		r.restarted = false
		if r.sawFirst {
			x.active.PrefillDone()
			if !x.wholeAnswer {
				x.active.ObserveTTFT(time.Since(x.sent))
			}
		}
	}
	if r.resumed {
		v := valueAfter(data, finishKey)
		if !carriesToken(data) && !isErrorFrame(data) && !hasUsage(data) && (len(v) == 0 || v[0] != '"') {
			return nil, true
		}
		r.resumed = false
		fixed = withoutRole(data)
	}
	if c := x.mig.carried; c > 0 && hasUsage(data) {
		if fixed != nil {
			data = fixed
		}
		i := bytes.LastIndex(data, usageKey)
		u := shiftInt(data[i:], promptKey, -c)
		fixed = append(append([]byte(nil), data[:i]...), shiftInt(u, completionKey, c)...)
	}
	return fixed, false
}

var roleKey = []byte(`"role":`)

// withoutRole is a chat chunk without its delta's role, which the client
// had from the first engine; nil when it has none.
func withoutRole(data []byte) []byte {
	d := bytes.Index(data, deltaKey)
	if d < 0 {
		return nil
	}
	i := bytes.Index(data[d:], roleKey)
	if i < 0 {
		return nil
	}
	i += d
	end, err := skipValue(data, skipSpace(data, i+len(roleKey)))
	if err != nil {
		return nil
	}
	// The member and the comma after it, or else the one before it.
	if j := skipSpace(data, end); j < len(data) && data[j] == ',' {
		end = skipSpace(data, j+1)
	} else if k := bytes.LastIndexByte(data[:i], ','); k > d {
		i = k
	}
	return append(append([]byte(nil), data[:i]...), data[end:]...)
}

func hasUsage(data []byte) bool {
	v := valueAfter(data, usageKey)
	return len(v) > 0 && v[0] == '{'
}

// shiftInt returns b with the whole number after key's first occurrence
// moved by d (not below 0); b itself when there is none.
func shiftInt(b, key []byte, d int) []byte {
	i := bytes.Index(b, key)
	if i < 0 {
		return b
	}
	j := skipSpace(b, i+len(key))
	k := j
	n := 0
	for k < len(b) && k-j < 12 && b[k] >= '0' && b[k] <= '9' {
		n = n*10 + int(b[k]-'0')
		k++
	}
	if k == j {
		return b
	}
	out := append([]byte(nil), b[:j]...)
	out = strconv.AppendInt(out, int64(max(n+d, 0)), 10)
	return append(out, b[k:]...)
}
