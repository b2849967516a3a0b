package proxy

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

// Tests from an operator trial: what the metrics and logs show of
// ejections, reroutes, limits, queues, reloads and rejected requests.

func wantMetrics(t *testing.T, m string, series ...string) {
	t.Helper()
	for _, s := range series {
		if !strings.Contains(m, s+"\n") {
			t.Errorf("/metrics lacks %s; it has:\n%s", s, grepLines(m, "kvproxy_"))
		}
	}
}

// A backend refusing connections is ejected and its request rerouted: both
// counted by backend, and the model's healthy backends drop to the one left.
func TestEjectionAndRerouteMetrics(t *testing.T) {
	good := startFake(t, "good", nil)
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := &fakeEngine{id: "dead", addr: ln.Addr().String()}
	ln.Close()
	p := startProxy(t, "round_robin", dead, good)
	for i := 0; i < 3; i++ {
		if resp, body := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	wantMetrics(t, p.metrics(t),
		`kvproxy_backend_ejections_total{backend="dead",reason="connect"} 1`,
		`kvproxy_reroutes_total{backend="dead"} 1`,
		`kvproxy_model_healthy_backends{model="m"} 1`,
		`kvproxy_queue_waiting{model="m"} 0`,
	)
}

// Each way a backend fails is counted under its reason: a failed
// connection, an error status, 500s in a row, non-streamed requests left
// unanswered in a row (the reason came from the failure's wording before).
func TestEjectReasons(t *testing.T) {
	var es []*fakeEngine
	yaml := "models: [{name: m}]\nbackends:\n"
	for i := range 4 {
		es = append(es, startFake(t, fmt.Sprintf("e%d", i), nil))
		yaml += fmt.Sprintf("  - {id: e%d, url: 'http://{{e%d}}', model: m}\n", i, i)
	}
	p := startProxyYAML(t, yaml, es...)
	bs := p.s.st.Load().backends
	for range errorAnswerLimit { // first: half the backends may go for their answers
		bs["e2"].answeredError("status 500")
	}
	bs["e0"].failConn("connect: dial tcp: connection refused")
	bs["e1"].fail(ejectStatus, "status 502")
	for range silentWholeLimit {
		bs["e3"].wholeTimedOut("backend e3 sent nothing for 30s")
	}
	wantMetrics(t, p.metrics(t),
		`kvproxy_backend_ejections_total{backend="e0",reason="connect"} 1`,
		`kvproxy_backend_ejections_total{backend="e1",reason="status"} 1`,
		`kvproxy_backend_ejections_total{backend="e2",reason="error_answers"} 1`,
		`kvproxy_backend_ejections_total{backend="e3",reason="timeout"} 1`,
	)
}

// A probe that starts failing counts as an ejection for reason probe.
func TestProbeFailureCountsAsEjection(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	b := p.s.st.Load().backends["e0"]
	b.setProbe(false, "connection refused")
	b.setProbe(false, "connection refused") // the same outage
	wantMetrics(t, p.metrics(t),
		`kvproxy_backend_ejections_total{backend="e0",reason="probe"} 1`,
		`kvproxy_model_healthy_backends{model="m"} 0`,
		`kvproxy_backend_healthy{backend="e0"} 0`,
	)
}

// Requests refused by a tenant's limits are counted by tenant and limit.
func TestRateLimitedMetrics(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.prefillDelay = 500 * time.Millisecond })
	y := strings.Replace(tenantsYAML, "{name: delta, shared_cache: true, requests_per_second: 2}",
		"{name: delta, shared_cache: true, requests_per_second: 2}\n  - {name: beta, max_concurrency: 1}\n  - {name: alpha, tokens_per_minute: 10}", 1)
	p := startProxyYAML(t, y, e)
	body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("many words ", 20) + `"}]}`
	send := func(key string) { // off the test's goroutine
		req, _ := http.NewRequest("POST", p.url+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}
	var wg sync.WaitGroup
	for i := 0; i < 6; i++ { // at once: more than delta's burst
		wg.Go(func() { send("key-delta-890") })
	}
	wg.Wait()
	for i := 0; i < 2; i++ { // the first goes into debt
		postAuth(t, p.url+"/v1/chat/completions", "key-alpha-123", body)
	}
	go send("key-beta-4567")
	for e.current.Load() == 0 { // beta's first, the only one in flight
		time.Sleep(time.Millisecond)
	}
	if resp, b := postAuth(t, p.url+"/v1/chat/completions", "key-beta-4567", body); resp.StatusCode != 429 {
		t.Fatalf("beta's second request at once: %d %s", resp.StatusCode, b)
	}
	m := p.metrics(t)
	if !regexp.MustCompile(`kvproxy_rate_limited_total{limit="requests",tenant="delta"} [1-9]`).MatchString(m) {
		t.Errorf("delta's refused requests not counted:\n%s", grepLines(m, "rate_limited"))
	}
	wantMetrics(t, m,
		`kvproxy_rate_limited_total{limit="tokens",tenant="alpha"} 1`,
		`kvproxy_rate_limited_total{limit="concurrency",tenant="beta"} 1`,
	)
}

// A request waiting for a slot shows in the model's queue gauge.
func TestQueueWaitingMetric(t *testing.T) {
	busy := startFake(t, "busy", func(f *fakeEngine) { f.prefillDelay = time.Second })
	p := startProxyYAML(t, "models: [{name: m, aliases: [alias-m]}]\nlimits: {max_queue: 8, queue_timeout: 5s}\nbackends:\n  - {id: busy, url: 'http://{{e0}}', max_concurrency: 1}\n", busy)
	go postAsync(p.url+"/v1/chat/completions", chatBody)
	for busy.requests.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	go postAsync(p.url+"/v1/chat/completions", chatBody)
	deadline := time.Now().Add(3 * time.Second)
	for !strings.Contains(p.metrics(t), `kvproxy_queue_waiting{model="m"} 1`+"\n") {
		if time.Now().After(deadline) {
			t.Fatalf("no queued request shown:\n%s", grepLines(p.metrics(t), "queue"))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Reloads are counted by result; the summary line names what changed (a
// model's aliases too: it named no changed model), and
// a backend the reload removes drains at info, not as an outage.
func TestReloadMetricsAndSummary(t *testing.T) {
	a, b := startFake(t, "a", nil), startFake(t, "b", nil)
	base := "models: [{name: m}]\nbackends:\n  - {id: a, url: 'http://" + a.addr + "'}\n  - {id: b, url: 'http://" + b.addr + "'}\n" +
		"auth:\n  keys: [{key: key-one-0001, tenant: one}, {key: key-two-0002, tenant: two}]\n"
	p := startProxyYAML(t, base)
	next := "models: [{name: m, aliases: [mm]}, {name: m2}]\nbackends:\n  - {id: a, url: 'http://" + a.addr + "', model: m, max_concurrency: 4}\n  - {id: c, url: 'http://" + b.addr + "', model: m2}\n" +
		"auth:\n  keys: [{key: key-one-0001, tenant: one}, {key: key-two-0003, tenant: two}]\nlimits: {retry_budget: 0.5}\n"
	cfg, err := config.Parse([]byte(next))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	bad, _ := config.Parse([]byte(next))
	bad.Backends[0].Model = "nosuch"
	if p.s.Reload(bad) == nil {
		t.Fatal("a reload naming an unknown model was applied")
	}
	p.s.ReloadFailed()
	wantMetrics(t, p.metrics(t),
		`kvproxy_config_reloads_total{result="ok"} 1`,
		`kvproxy_config_reloads_total{result="rejected"} 2`,
		`kvproxy_config_last_reload_successful 0`,
	)
	logs := p.logs.String()
	want := `"backends_added":["c"],"backends_removed":["b"],"backends_replaced":["a"],"models_added":["m2"],"models_changed":["m"],"tenants_changed":["two"],"restart_needed":["limits.retry_budget"]`
	if !strings.Contains(logs, want) || !strings.Contains(logs, `"message":"configuration reloaded"`) {
		t.Errorf("the reload's line lacks %s:\n%s", want, logs)
	}
	if strings.Contains(logs, "key-two") {
		t.Errorf("a key reached the log:\n%s", logs)
	}
	if !strings.Contains(logs, `{"level":"info","backend":"b","message":"backend draining (removed by reload)"}`) || strings.Contains(logs, "backend unavailable") {
		t.Errorf("the removed backend's draining reads as an outage:\n%s", logs)
	}
}

// Rejections write their first lines, then one line summing up the rest
// each second, per tenant and reason; the metrics count them all.
func TestRejectionLogLinesAreBounded(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, tenantsYAML, e)
	const n = 60
	for i := 0; i < n; i++ {
		postAuth(t, p.url+"/v1/chat/completions", "wrong-key-000", chatBody)
	}
	lines := strings.Count(p.logs.String(), `"error":"invalid api key"`)
	if lines > 2*rejectLinesPerSec || lines == 0 {
		t.Errorf("%d lines for %d rejected requests", lines, n)
	}
	summary := regexp.MustCompile(`"suppressed":(\d+),"window":1000,"message":"suppressed (\d+) similar lines"`)
	deadline := time.Now().Add(3 * time.Second)
	total := 0
	for time.Now().Before(deadline) {
		total = 0
		for _, m := range summary.FindAllStringSubmatch(p.logs.String(), -1) {
			var k int
			for _, c := range m[1] {
				k = 10*k + int(c-'0')
			}
			total += k
		}
		if lines+total == n {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if lines+total != n {
		t.Errorf("%d lines and %d suppressed for %d rejections:\n%s", lines, total, n, p.logs.String())
	}
	wantMetrics(t, p.metrics(t), `kvproxy_requests_total{backend="",code="401"} 60`)
}

// Access lines name the client's address and the path; an engine's error
// answer is described by its type and code, never its message (vLLM's may
// quote the prompt).
func TestAccessLineFields(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) {
		f.status = 400
		f.errBody = `{"object":"error","message":"invalid prompt (parameter=prompt, value=MY SECRET PROMPT)","type":"BadRequestError","param":"prompt","code":400}`
	})
	p := startProxy(t, "kv", e)
	if resp, _ := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 400 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	post(t, p.url+"/v1/chat/completions", `{"model":"nosuch","messages":[{"role":"user","content":"hi"}]}`)
	logs := p.logs.String()
	for _, want := range []string{
		`"remote":"127.0.0.1","path":"/v1/chat/completions","model":"alias-m","tenant":"","backend":"e0"`,
		`"error":"engine answered 400 (type BadRequestError, code 400, param prompt)"`,
		`"remote":"127.0.0.1","path":"/v1/chat/completions","model":"nosuch","tenant":"","status":404`,
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("no %s in:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, "SECRET") {
		t.Errorf("the engine's message, quoting the prompt, reached the log:\n%s", logs)
	}
}

// A ZMQ event feed that cannot connect shows as 0; backends without one
// have no series.
func TestKVEventsConnectedMetric(t *testing.T) {
	e, f := startFake(t, "e0", nil), startFake(t, "e1", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, kv_events: {mode: zmq, endpoint: 'tcp://127.0.0.1:1'}}\n"+
		"  - {id: e1, url: 'http://{{e1}}', model: m}\n", e, f)
	m := p.metrics(t)
	wantMetrics(t, m, `kvproxy_kv_events_connected{backend="e0"} 0`, `kvproxy_model_healthy_backends{model="m"} 2`)
	if strings.Contains(m, `kvproxy_kv_events_connected{backend="e1"}`) {
		t.Errorf("a backend without a ZMQ feed has a connected series:\n%s", grepLines(m, "kv_events"))
	}
}

// Reroutes are logged within the same bound as rejections: an engine down
// under load is thousands of them a second, each a warning line.
// kvproxy_reroutes_total counts them all.
func TestRerouteLogLinesAreBounded(t *testing.T) {
	good := startFake(t, "good", nil)
	p := startProxyYAML(t, "models: [{name: m, aliases: [alias-m]}]\nrouter: {policy: round_robin}\n"+
		"backends: [{id: dead, url: 'http://"+deadAddr(t)+"'}, {id: good, url: 'http://{{e0}}'}]\n"+
		"limits: {retry_budget: 1}\nhealth: {eject_base: 1ms, eject_max: 1ms}\n", good)
	// How many requests meet the dead engine depends on the machine's
	// speed (its 1ms ejections): send until 40 have, within a bound.
	reroutes, sent, start := 0, 0, time.Now()
	for reroutes < 40 && sent < 5000 {
		for range 50 {
			if resp, body := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 200 {
				t.Fatalf("request %d: %d %s", sent, resp.StatusCode, body)
			}
			sent++
		}
		for _, line := range strings.Split(p.metrics(t), "\n") {
			if strings.HasPrefix(line, `kvproxy_reroutes_total{backend="dead"}`) {
				reroutes, _ = strconv.Atoi(line[strings.LastIndexByte(line, ' ')+1:])
			}
		}
	}
	lines := strings.Count(p.logs.String(), `"message":"rerouting"`)
	bound := rejectLinesPerSec * (int(time.Since(start).Seconds()) + 2)
	if reroutes < 40 || lines > bound {
		t.Fatalf("%d reroutes counted in %d requests, %d logged: want at least 40 counted and at most %d lines", reroutes, sent, lines, bound)
	}
	p.waitIdle(t)
}

// A retry is spent, and a reroute counted, only when another engine takes
// the request: a model whose only engine refuses every request took a retry
// each time and drained the budget the other models' retries need (found
// by the ninth session's user trial).
func TestNoRetrySpentWithoutAnotherEngine(t *testing.T) {
	only := startFake(t, "only", func(f *fakeEngine) {
		f.status, f.errBody = 503, `{"error":{"message":"busy","type":"service_unavailable","param":null,"code":503}}`
	})
	p := startProxyYAML(t, "models: [{name: m, aliases: [alias-m]}]\nbackends: [{id: only, url: 'http://{{e0}}'}]\n"+
		"health: {eject_base: 1ms, eject_max: 1ms}\n", only)
	before := p.s.retries.tokens()
	for i := range 20 {
		waitFor(t, "the ejection to end", func() bool { return available(p, "m", "only") })
		if resp, body := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 503 || !strings.Contains(string(body), "busy") {
			t.Fatalf("request %d: %d %s, want the engine's 503", i, resp.StatusCode, body)
		}
	}
	if after := p.s.retries.tokens(); after < before {
		t.Fatalf("retry budget %v → %v with no engine to retry on", before, after)
	}
	if m := p.metrics(t); strings.Contains(m, `kvproxy_reroutes_total{backend="only"}`) {
		t.Fatalf("reroutes counted with no engine to reroute to:\n%s", m)
	}
	p.waitIdle(t)
}

// tokens is the budget's balance now.
func (b *retryBudget) tokens() float64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.balance
}

// FlushLogs writes the summary of the lines the current second held back
// at once (kvproxy's exit calls it: the last second's summary was lost).
func TestFlushLogsWritesTheHeldBackSummary(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, tenantsYAML, e)
	for range 3 * rejectLinesPerSec {
		postAuth(t, p.url+"/v1/chat/completions", "wrong-key-000", chatBody)
	}
	p.s.FlushLogs()
	if !strings.Contains(p.logs.String(), fmt.Sprintf(`"message":"suppressed %d similar lines"`, 2*rejectLinesPerSec)) {
		t.Fatalf("no summary right after FlushLogs:\n%s", p.logs.String())
	}
}

// A reload that rebuilds a large fleet names at most maxLoggedNames
// backends in its summary line, and says how many more (1,000 backends
// made one 15 KB line; found by the ninth session's third review).
func TestReloadSummaryIsBounded(t *testing.T) {
	e := startFake(t, "e0", nil)
	yaml := func(forget string) string {
		var b strings.Builder
		b.WriteString("models: [{name: m}]\nhealth: {forget_after: " + forget + "}\nbackends:\n")
		for i := range 50 {
			fmt.Fprintf(&b, "  - {id: b%02d, url: 'http://%s', model: m, api_key: key-%02d}\n", i, e.addr, i)
		}
		return b.String()
	}
	p := startProxyYAML(t, yaml("1m"))
	reloadYAML(t, p, strings.ReplaceAll(yaml("1m"), "key-", "key2-")) // every backend's settings changed
	logs := p.logs.String()
	line := logs[strings.LastIndex(logs, `"backends_replaced"`):]
	line = line[:strings.IndexByte(line, '\n')]
	if n := len(regexp.MustCompile(`"b\d\d"`).FindAllString(line, -1)); n != maxLoggedNames || !strings.Contains(line, `"(and 30 more)"`) {
		t.Fatalf("summary line: %s", line)
	}
}

// A reload that changes only global settings replaces no backend: health
// settings apply in place, and the limits a backend's connections are
// built with (stream_idle_timeout) rebuild them, which the reload's line
// counts apart from backends_replaced (settings changed), with no
// retirement line at info for each (found by the twelfth session's
// operator trial: a stream_idle_timeout change listed every backend as
// replaced and retired).
func TestGlobalSettingsReplaceNoBackend(t *testing.T) {
	a, b := startFake(t, "a", nil), startFake(t, "b", nil)
	yaml := func(global string) string {
		return "models: [{name: m}]\n" + global + "backends:\n  - {id: a, url: 'http://" + a.addr + "', model: m}\n  - {id: b, url: 'http://" + b.addr + "', model: m}\n"
	}
	p := startProxyYAML(t, yaml("limits: {stream_idle_timeout: 5s}\n"))
	was := p.s.st.Load().backends["a"]

	reloadYAML(t, p, yaml("limits: {stream_idle_timeout: 5s}\nhealth: {eject_base: 2s, forget_after: 2m}\n"))
	if now := p.s.st.Load().backends["a"]; now != was {
		t.Fatal("a health change rebuilt backend a")
	}
	was.mu.Lock()
	h := was.health
	was.mu.Unlock()
	if h.EjectBase != 2*time.Second || h.ForgetAfter != 2*time.Minute {
		t.Fatalf("the kept backend has health %+v", h)
	}
	logs := p.logs.String()
	if strings.Contains(logs, "backends_replaced") || strings.Contains(logs, "backend retired") {
		t.Fatalf("a health change replaced backends:\n%s", logs)
	}

	reloadYAML(t, p, yaml("limits: {stream_idle_timeout: 6s}\nhealth: {eject_base: 2s, forget_after: 2m}\n"))
	if up := p.s.st.Load().backends["a"].up; up.ReadTimeout != 6*time.Second {
		t.Fatalf("backend a reads with %v", up.ReadTimeout)
	}
	waitRetired(t, p, "a", true)
	waitRetired(t, p, "b", true)
	logs = p.logs.String()
	if !strings.Contains(logs, `"backends_rebuilt":2,"rebuilt_for":["limits.stream_idle_timeout"],"backends":2,"models":1,"message":"configuration reloaded"`) ||
		strings.Contains(logs, "backends_replaced") || strings.Contains(logs, `"level":"info","backend":"a","replaced":true`) {
		t.Fatalf("a stream_idle_timeout change, as logged:\n%s", logs)
	}
	resp, body := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"x","nvext":{"backend_instance_id":"a"}}`)
	if resp.StatusCode != 200 {
		t.Fatalf("after the reloads: %d %s", resp.StatusCode, body)
	}
	p.waitIdle(t)
}

// With the retry budget spent, a refusal is the answer at once: routing
// before withdrawing queued the request for another engine's slot just to
// find that out, and answered with the queue's timeout instead of the
// engine's refusal (found by the ninth session's last review).
func TestSpentRetryBudgetAnswersTheRefusalAtOnce(t *testing.T) {
	refuse := startFake(t, "a", func(f *fakeEngine) {
		f.status, f.errBody = 503, `{"error":{"message":"busy","type":"service_unavailable","param":null,"code":503}}`
	})
	slow := startFake(t, "b", func(f *fakeEngine) { f.prefillDelay = 2 * time.Second })
	p := startProxyYAML(t, "models: [{name: m, aliases: [alias-m]}]\nrouter: {policy: round_robin}\n"+
		"backends: [{id: a, url: 'http://{{e0}}'}, {id: b, url: 'http://{{e1}}', max_concurrency: 1}]\n"+
		"limits: {queue_timeout: 3s, retry_budget: 0}\nhealth: {eject_base: 1ms, eject_max: 1ms}\n", refuse, slow)
	go func() { // holds b's only slot
		resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x","nvext":{"backend_instance_id":"b"}}`))
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	waitFor(t, "b busy", func() bool { return slow.current.Load() == 1 })
	p.s.retries.mu.Lock()
	p.s.retries.balance = 0
	p.s.retries.mu.Unlock()
	start := time.Now()
	resp, body := post(t, p.url+"/v1/chat/completions", chatBody)
	if took := time.Since(start); resp.StatusCode != 503 || !strings.Contains(string(body), "busy") || took > time.Second { // queued, it waited 2 s for b's slot
		t.Fatalf("%d in %v: %s; want a's refusal at once", resp.StatusCode, took, body)
	}
	p.waitIdle(t)
}

// models[].tokenizer_cache_mb bounds the tokens kept of earlier messages,
// and kvproxy_tokenizer_cache_bytes shows what the cache holds: about 2 MB
// of distinct 1 KB messages fill the default cache past 1 MiB and a cache
// of 1 MiB to at most that (its 128 entries of 8 KiB bound it first). A reload that changes the size keeps the
// model's index and says a restart is needed.
func TestTokenizerCacheSize(t *testing.T) {
	e := startFake(t, "e0", nil)
	yaml := "models: [{name: m, tokenizer: cl100k_base, template: chatml%s}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n"
	def := startProxyYAML(t, fmt.Sprintf(yaml, ""), e)
	small := startProxyYAML(t, fmt.Sprintf(yaml, ", tokenizer_cache_mb: 1"), e)
	words := strings.Fields("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa")
	for i := range 1000 {
		var msg strings.Builder
		fmt.Fprintf(&msg, "message %d:", i)
		for j := 0; msg.Len() < 1000; j++ {
			msg.WriteString(" " + words[(i*7+j*j)%len(words)])
		}
		body := `{"model":"m","messages":[{"role":"user","content":"` + msg.String() + `"}],"nvext":{"annotations":["query_instance_id"]}}`
		for _, p := range []*testProxy{def, small} {
			if resp, b := post(t, p.url+"/v1/chat/completions", body); resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
		}
	}
	held := func(p *testProxy) float64 {
		v, err := strconv.ParseFloat(gauge(p.metrics(t), `kvproxy_tokenizer_cache_bytes{model="m"}`), 64)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	if got := held(def); got <= 1<<20 {
		t.Errorf("the default cache holds %.0f bytes of 1,000 distinct 1 KB messages, want more than 1 MiB", got)
	}
	if got := held(small); got > 1<<20 || got < 1<<17 {
		t.Errorf("a 1 MiB cache holds %.0f bytes, want between 128 KiB and 1 MiB", got)
	}
	cfg, err := config.Parse([]byte(strings.ReplaceAll(fmt.Sprintf(yaml, ", tokenizer_cache_mb: 2"), "{{e0}}", e.addr)))
	if err != nil {
		t.Fatal(err)
	}
	before := small.s.st.Load().models["m"]
	if err := small.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if st := small.s.st.Load(); st.models["m"] != before || !slices.Contains(st.restartNeeded, "tokenizer_cache_mb (model m)") {
		t.Errorf("a reload changing only tokenizer_cache_mb rebuilt the model or said nothing: restart_needed %q", st.restartNeeded)
	}
}
