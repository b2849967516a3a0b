package proxy

import (
	"bytes"
	"errors"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/backends"
	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/router"
)

// Disaggregated prefill, as vLLM's NixlConnector does it: a prefill engine
// (backends[].role: prefill) computes the prompt of a chat or completion
// request asked for one token with kv_transfer_params {"do_remote_decode":
// true}, and answers with the kv_transfer_params that tell a decode engine
// where the prompt's KV is; the request then goes, with those params, to an
// engine that serves whole requests, which pulls the KV instead of
// computing it and streams the answer. Both stages are routed on the
// prompt's blocks by the model's policy. A prefill that cannot run (no
// prefill engine free, a failure, an answer without params) leaves the
// decode engine to compute the prompt itself.

// prefillParams is what the prefill engine is asked for.
const prefillParams = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

var kvTransferParams = [1]string{"kv_transfer_params"}

// prefillOnly reports whether b only computes prompts (role: prefill).
func (b *backend) prefillOnly() bool { return b.cfg.Role == config.RolePrefill }

// avoidForRole appends to avoid the workers of the model's prefill engines
// (prefill false: the stage that serves the request) or of its other
// engines (prefill true: the prefill stage), and reports whether the model
// has a prefill engine at all.
func (p *modelPool) avoidForRole(avoid []router.WorkerID, prefill bool) ([]router.WorkerID, bool) {
	engines := p.engines()
	disaggregated := false
	for b := range engines {
		if b.prefillOnly() {
			disaggregated = true
			break
		}
	}
	if !disaggregated {
		return avoid, false
	}
	for b := range engines {
		if b.prefillOnly() != prefill {
			avoid = append(avoid, b.workerIDs()...)
		}
	}
	return avoid, true
}

// disaggregates reports whether a request of kind may have its prefill
// done by a prefill engine: a chat or completion, not pinned, one sequence
// (vLLM's answer holds the params of one: not a batch of prompts, nor n >
// 1).
func (s *Server) disaggregates(req *apiRequest, kind api, rr *router.Request) bool {
	return (kind == apiChat || kind == apiCompletions) && !rr.Pinned &&
		len(req.batchTexts)+len(req.batchTokens) == 0 && req.oneChoice
}

// remotePrefill runs x's prefill on one of its model's prefill engines and
// returns the kv_transfer_params its answer gives for the decode engine;
// nil when none ran. rr is the request as routed (its prompt's blocks).
func (s *Server) remotePrefill(ctx *fasthttp.RequestCtx, sc *scratch, x *exchange, rr *router.Request, salt string) []byte {
	p := x.p
	avoid, ok := p.avoidForRole(nil, true)
	if !ok {
		return nil // before pr, which escapes: a model without prefill engines allocates nothing here
	}
	pr := router.Request{Hashes: rr.Hashes, PromptTokens: rr.PromptTokens, Unstreamed: true, Avoid: avoid, Repeat: true}
	d, active, err := p.rt.Route(&pr)
	if err != nil {
		x.prefillErr = "no prefill engine is available" // the decode engine computes it
		return nil
	}
	b := p.backend(d.Worker)
	if b == nil || !b.acquire() {
		active.Free()
		x.prefillErr = "no prefill engine is available"
		return nil
	}
	if b.retiring.Load() { // a reload removed it since Route chose it
		b.release()
		active.Free()
		x.prefillErr = "no prefill engine is available"
		return nil
	}
	defer func() {
		active.PrefillDone()
		active.Free()
		b.release()
	}()
	req := &sc.req
	served := b.cfg.ServedModel
	if x.lora != "" {
		served = x.lora
	}
	engineSalt := ""
	if b.salted {
		engineSalt = salt
	}
	req.prefillStage = true
	req.sendPriority = req.dropPriority && b.cfg.PriorityScheduling
	req.engineSampling = b.cfg.Kind != config.KindOpenAI
	body, err := req.forwardBody(sc.body[:0], served, engineSalt)
	req.prefillStage = false
	if err != nil {
		return nil
	}
	sc.body = body

	trace := traceOf(&ctx.Request.Header)
	fr := x.engineRequest(&trace, b, 0, body)
	defer fasthttp.ReleaseRequest(fr)
	ab := &backends.Abort{}
	watch := s.watcher.Watch(ctx.Conn(), abortOnHangUp{ab})
	defer s.watcher.Unwatch(watch)
	// Live, for the drain deadline and a failing health probe to cut it
	// (cutUnresponsive): a frozen prefill engine held the request until
	// stream_idle_timeout.
	px := &exchange{s: s, b: b, ab: ab}
	s.live.add(px)
	defer s.live.done(px)
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseResponse(resp)
	start := time.Now()
	_, err = b.up.Do(fr, resp, false, ab)
	x.prefillBy, x.prefillTime = b.cfg.ID, time.Since(start)
	status := resp.StatusCode()
	switch {
	case errors.Is(err, backends.ErrAborted) && px.unresponsive.Load() != nil:
		status = fasthttp.StatusGatewayTimeout
	case errors.Is(err, backends.ErrAborted):
		status = 499
	case backends.OutOfFiles(err):
		status = fasthttp.StatusServiceUnavailable // as forward counts it: kvproxy's want, not the engine's failure
	case err != nil:
		status = fasthttp.StatusBadGateway
	}
	s.metrics.countRequest(b.cfg.ID, status) // the prefill engine's traffic
	var ce *backends.ConnectError
	switch {
	case err == nil && resp.StatusCode() == fasthttp.StatusOK:
	case errors.Is(err, backends.ErrAborted):
		if msg := px.unresponsive.Load(); msg != nil {
			x.prefillErr = *msg
		}
		return nil // the client left (the decode stage finds out), or the engine stopped answering
	case errors.As(err, &ce):
		b.failDial(ce)
		x.prefillErr = "connect: " + ce.Err.Error()
		return nil
	case err != nil:
		x.prefillErr = err.Error()
		return nil
	default:
		x.prefillErr = "answered " + strconv.Itoa(resp.StatusCode())
		if resp.StatusCode() >= 500 {
			b.answeredError("prefill " + x.prefillErr) // as a completion's 500s count
		}
		return nil
	}
	var v [1][]byte
	params := membersNamed(resp.Body(), kvTransferParams[:], v[:])[0]
	if len(params) == 0 || params[0] != '{' {
		x.prefillErr = "its answer has no kv_transfer_params"
		return nil
	}
	b.succeed()
	ctx.Response.Header.Set("X-Kvproxy-Prefill-Worker", b.cfg.ID)
	return bytes.Clone(params)
}
