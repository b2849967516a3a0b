package config

import (
	"strings"
	"testing"
	"time"
)

// An explicit 0 where 0 means something (no retry share, no wait queue, no
// drain wait, never forget) is kept; only an absent field gets its default.
func TestExplicitZeroIsKept(t *testing.T) {
	c, err := Parse([]byte(minimal + `
limits: {retry_budget: 0, max_queue: 0, drain_timeout: 0s}
health: {forget_after: 0s}
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Limits.RetryBudget != 0 || c.Limits.MaxQueue != 0 || c.Limits.DrainTimeout != 0 || c.Health.ForgetAfter != 0 {
		t.Fatalf("explicit zeros replaced by defaults: retry_budget %g, max_queue %d, drain_timeout %v, forget_after %v",
			c.Limits.RetryBudget, c.Limits.MaxQueue, c.Limits.DrainTimeout, c.Health.ForgetAfter)
	}
	// Absent, or in a section left empty: the defaults.
	for _, doc := range []string{minimal, minimal + "limits:\nhealth:\n", minimal + "limits: {}\nhealth: {}\n"} {
		c, err := Parse([]byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		if c.Limits.RetryBudget != 0.2 || c.Limits.MaxQueue != 1024 || c.Limits.DrainTimeout != 30*time.Second || c.Health.ForgetAfter != time.Minute ||
			c.Limits.IdleTimeout != 120*time.Second || c.Limits.MaxConnections != 0 {
			t.Fatalf("defaults missing for %q: %+v %+v", doc, c.Limits, c.Health)
		}
	}
}

// Every numeric field rejects a negative value, and event endpoints are
// checked before a subscriber fails on them at run time.
func TestValidationRejects(t *testing.T) {
	backend := func(extra string) string {
		return "models:\n  - name: m\nbackends:\n  - {id: a, url: \"http://127.0.0.1:9000\"" + extra + "}\n"
	}
	cases := map[string]struct{ yaml, want string }{
		"negative connect timeout": {minimal + "limits: {upstream_connect_timeout: -1s}\n", "limits.upstream_connect_timeout"},
		"negative conns":           {minimal + "limits: {max_conns_per_backend: -1}\n", "limits.max_conns_per_backend"},
		"tenant model unknown":     {minimal + "tenants: [{name: a, models: [m, nope]}]\n", "tenants[0].models[1]: \"nope\" is not the name or alias"},
		"tenant models empty":      {minimal + "tenants: [{name: a, models: []}]\n", "tenants[0].models: lists no model"},
		"negative tenant rate":     {minimal + "tenants: [{name: a, tokens_per_minute: -1}]\n", "tenants[0].tokens_per_minute: must be a number, not negative"},
		"backend naming an alias": {"models: [{name: m, aliases: [mm]}]\nbackends: [{id: a, url: 'http://127.0.0.1:9000', model: mm}]\n",
			`backends[0].model: "mm" is an alias of model "m"`},
		"backend of two models naming none": {"models: [{name: m}, {name: n}]\nbackends: [{id: a, url: 'http://127.0.0.1:9000'}]\n",
			"backends[0].model: required with more than one model"},
		"negative client conns":    {minimal + "limits: {max_connections: -1}\n", "limits.max_connections"},
		"negative idle timeout":    {minimal + "limits: {idle_timeout: -1s}\n", "limits.idle_timeout"},
		"negative overlap weight":  {minimal + "router: {overlap_weight: -1}\n", "router.overlap_weight"},
		"NaN temperature":          {minimal + "router: {temperature: .nan}\n", "router.temperature"},
		"infinite overlap weight":  {minimal + "router: {overlap_weight: .inf}\n", "router.overlap_weight"},
		"NaN cost":                 {minimal + "router: {cost: {prefill_ms_per_token: .nan}}\n", "router.cost"},
		"NaN retry budget":         {minimal + "limits: {retry_budget: .nan}\n", "limits.retry_budget"},
		"infinite fetch cost":      {minimal + "router: {fetch_us_per_mb: {host: .inf}}\n", "router.fetch_us_per_mb"},
		"NaN mock speedup":         {backend(", kind: mock, mock: {speedup: .nan}"), "backends[0].mock"},
		"negative host cache":      {backend(", kind: mock, mock: {host_cache_blocks: -5}"), "backends[0].mock"},
		"unknown role":             {backend(", role: decode"), "backends[0].role"},
		"prefill on an openai api": {backend(", kind: openai, role: prefill"), "backends[0].role"},
		"prefill and no decoder":   {backend(", role: prefill"), "backends[0].role"},
		"replay without scheme": {backend(`, kv_events: {mode: zmq, endpoint: "tcp://127.0.0.1:5557", replay: "127.0.0.1:5558"}`),
			"backends[0].kv_events.replay"},
		"dp ranks on ipc": {backend(`, kv_events: {mode: zmq, endpoint: "ipc:///tmp/kv.sock", dp_size: 2}`),
			"backends[0].kv_events.dp_size"},
		"dp ranks past the last port": {backend(`, kv_events: {mode: zmq, endpoint: "tcp://127.0.0.1:65535", dp_size: 2}`),
			"backends[0].kv_events.dp_size"},
		"zmq endpoint without port": {backend(`, kv_events: {mode: zmq, endpoint: "tcp://127.0.0.1"}`),
			"backends[0].kv_events.endpoint"},
		"empty alias": {"models:\n  - {name: m, aliases: [x, \"\"]}\nbackends:\n  - {id: a, url: \"http://127.0.0.1:9000\"}\n",
			"models[0].aliases[1]"},
		"two mocks on one address": {"models:\n  - name: m\nbackends:\n" +
			"  - {id: a, url: \"http://127.0.0.1:9000\", kind: mock}\n  - {id: b, url: \"http://127.0.0.1:9000\", kind: mock}\n",
			"backends[1].url"},
		"two mocks publishing on one address": {"models:\n  - name: m\nbackends:\n" +
			"  - {id: a, url: \"http://127.0.0.1:9000\", kind: mock, kv_events: {mode: zmq, endpoint: \"tcp://127.0.0.1:5000\"}}\n" +
			"  - {id: b, url: \"http://127.0.0.1:9001\", kind: mock, kv_events: {mode: zmq, endpoint: \"tcp://127.0.0.1:5001\", replay: \"tcp://127.0.0.1:5000\"}}\n",
			"backends[1].kv_events.replay: mock backends[0] already listens on 127.0.0.1:5000"},
		// The ninth session's trial and review: mistakes that loaded and
		// misbehaved later.
		"one engine twice for a model": {"models:\n  - name: m\nbackends:\n" +
			"  - {id: a, url: \"http://10.0.0.1:8000\"}\n  - {id: b, url: \"http://10.0.0.1:8000/\"}\n", "backends[1].url"},
		"an admin key that is a client key": {minimal + "auth: {keys: [{key: secret-key-1, tenant: t}], admin_keys: [secret-key-1]}\n",
			"auth.admin_keys[0]"},
		"a metrics key that is a client key": {minimal + "auth: {keys: [{key: secret-key-1, tenant: t}], metrics_keys: [secret-key-1]}\n",
			"auth.metrics_keys[0]"},
		"a short metrics key":       {minimal + "auth: {metrics_keys: [short]}\n", "auth.metrics_keys[0]"},
		"negative body memory":      {minimal + "limits: {body_memory_mb: -1}\n", "limits.body_memory_mb"},
		"the engine's bind address": {backend(`, kv_events: {mode: zmq, endpoint: "tcp://*:5557"}`), "backends[0].kv_events.endpoint"},
		"ranks' publisher and replay ports overlap": {backend(`, kv_events: {mode: zmq, endpoint: "tcp://10.0.0.1:5557", replay: "tcp://10.0.0.1:5558", dp_size: 2}`),
			"backends[0].kv_events.replay"},
		"negative tokenizer cache": {"models: [{name: m, tokenizer_cache_mb: -1}]\nbackends: [{id: a, url: \"http://127.0.0.1:9000\"}]\n",
			"models[0].tokenizer_cache_mb"},
		"tokenizer cache past 64 GiB": {"models: [{name: m, tokenizer_cache_mb: 65537}]\nbackends: [{id: a, url: \"http://127.0.0.1:9000\"}]\n",
			"models[0].tokenizer_cache_mb"},
		"probes in a tight loop": {minimal + "health: {interval: 1ns}\n", "health.interval"},
		// A path that names no file is told so, not "unknown tokenizer"
		// (the twenty-ninth session's trial).
		"a tokenizer file that is not there": {"models: [{name: m, tokenizer: /nonexistent/tokenizer.json}]\nbackends: [{id: a, url: \"http://127.0.0.1:9000\"}]\n",
			"models[0].tokenizer: stat /nonexistent/tokenizer.json: no such file or directory"},
		"a template file that is not there": {"models: [{name: m, template: tokenizer_config.json}]\nbackends: [{id: a, url: \"http://127.0.0.1:9000\"}]\n",
			"models[0].template: stat tokenizer_config.json: no such file or directory"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("accepted:\n%s", tc.yaml)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not name %s", err, tc.want)
			}
		})
	}
}

// What those checks must still let through: one server serving two models
// at one address, replay ports above every rank's publisher, and one rank.
func TestValidationAccepts(t *testing.T) {
	for name, yaml := range map[string]string{
		"one server, two models": "models: [{name: m}, {name: n}]\nbackends:\n" +
			"  - {id: a, url: \"http://10.0.0.1:8000\", model: m, kind: openai}\n  - {id: b, url: \"http://10.0.0.1:8000\", model: n, kind: openai}\n",
		"replay above the ranks": "models: [{name: m}]\nbackends:\n" +
			"  - {id: a, url: \"http://10.0.0.1:8000\", kv_events: {mode: zmq, endpoint: \"tcp://10.0.0.1:5557\", replay: \"tcp://10.0.0.1:5567\", dp_size: 4}}\n",
		"one provider, one backend per API key": "models: [{name: gpt-4o}]\nbackends:\n" +
			"  - {id: org-a, url: \"https://api.openai.com\", model: gpt-4o, kind: openai, api_key: sk-aaaaaaaa}\n" +
			"  - {id: org-b, url: \"https://api.openai.com\", model: gpt-4o, kind: openai, api_key: sk-bbbbbbbb}\n",
		"vLLM's default ports, one rank": "models: [{name: m}]\nbackends:\n" +
			"  - {id: a, url: \"http://10.0.0.1:8000\", kv_events: {mode: zmq, endpoint: \"tcp://10.0.0.1:5557\", replay: \"tcp://10.0.0.1:5558\"}}\n",
	} {
		if _, err := Parse([]byte(yaml)); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// A key naming a tenant that tenants does not list is valid (it gets no
// limits, as the README says) but warned of: it is usually a typo.
func TestUnlistedTenantIsWarnedOf(t *testing.T) {
	c, err := Parse([]byte(minimal + "auth: {cache_salt_secret: 0123456789abcdef0123456789abcdef, keys: [{key: key-a-12345, tenant: team-a}, {key: key-b-12345, tenant: team-bb}, {key: key-c-12345, tenant: team-bb}]}\n" +
		"tenants: [{name: team-a, requests_per_second: 5}, {name: team-b, requests_per_second: 5}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if w := c.Warnings(); len(w) != 1 || !strings.Contains(w[0], `auth.keys[1].tenant: "team-bb" is not in tenants`) {
		t.Fatalf("warnings %q, want one about team-bb", w)
	}
}

// Client keys without a long cache_salt_secret are warned of: it keys the
// response ids that keep tenants apart, and a short one can be guessed.
func TestMissingOrShortSecretIsWarnedOf(t *testing.T) {
	for secret, want := range map[string]string{
		"":                                  "auth.cache_salt_secret is not set",
		"cache_salt_secret: short-secret, ": "auth.cache_salt_secret has 12 characters",
		"cache_salt_secret: 0123456789abcdef0123456789abcdef, ": "",
	} {
		c, err := Parse([]byte(minimal + "auth: {" + secret + "keys: [{key: key-a-12345, tenant: team-a}]}\n"))
		if err != nil {
			t.Fatal(err)
		}
		w := c.Warnings()
		if want == "" && len(w) != 0 || want != "" && (len(w) != 1 || !strings.Contains(w[0], want)) {
			t.Errorf("secret %q: warnings %q, want %q", secret, w, want)
		}
	}
	c, _ := Parse([]byte(minimal))
	if w := c.Warnings(); len(w) != 0 {
		t.Fatalf("no keys, no secret: warnings %q", w)
	}
}

// Tenants listed without any key are warned of: no request has a tenant,
// so none of their limits or models apply (the review).
func TestTenantsWithoutKeysAreWarnedOf(t *testing.T) {
	c, err := Parse([]byte(minimal + "tenants: [{name: team-a, models: [m]}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if w := c.Warnings(); len(w) != 1 || !strings.Contains(w[0], "tenants are listed but auth.keys is empty") {
		t.Fatalf("warnings %q", w)
	}
}

// force_include_usage where it cannot hold (a simulated engine, kind
// openai), or on some of a model's engines only, is warned of.
func TestForcedUsageIsWarnedOf(t *testing.T) {
	for yaml, want := range map[string]string{
		"  - {id: a, url: 'http://10.0.0.1:8000', force_include_usage: true}\n  - {id: b, url: 'http://10.0.0.2:8000', force_include_usage: true}\n": "",
		"  - {id: a, url: 'http://10.0.0.1:8000', force_include_usage: true}\n  - {id: b, url: 'http://10.0.0.2:8000'}\n":                            "model m: some of its backends set force_include_usage",
		"  - {id: a, url: 'http://10.0.0.1:8000', force_include_usage: true}\n  - {id: p, url: 'http://10.0.0.2:8000', role: prefill}\n":             "",
		"  - {id: a, url: 'http://127.0.0.1:8000', kind: mock, force_include_usage: true}\n":                                                         "backend a: force_include_usage is for engines of kind vllm or sglang",
		// Not force_include_usage, but the same kind of mistake: settings
		// a real engine ignores (the twenty-sixth session's docs review).
		"  - {id: a, url: 'http://10.0.0.1:8000', kind: vllm, mock: {speedup: 10}}\n": "backend a: mock settings are for kind mock; a vllm engine ignores them",
	} {
		c, err := Parse([]byte("models: [{name: m}]\nbackends:\n" + yaml))
		if err != nil {
			t.Fatal(err)
		}
		w := c.Warnings()
		if want == "" && len(w) != 0 || want != "" && (len(w) != 1 || !strings.Contains(w[0], want)) {
			t.Errorf("%s: warnings %q, want %q", yaml, w, want)
		}
	}
}

// A body memory budget under what one request may hold (its body and an
// answer read whole) is warned of; the default is not.
func TestBodyMemoryUnderOneRequestIsWarned(t *testing.T) {
	for mb, warned := range map[string]bool{"": false, "limits: {body_memory_mb: 96}\n": false, "limits: {body_memory_mb: 95}\n": true,
		"limits: {body_memory_mb: 70, max_request_body_bytes: 6291456}\n": false} {
		c, err := Parse([]byte(minimal + mb))
		if err != nil {
			t.Fatal(err)
		}
		w := strings.Join(c.Warnings(), "; ")
		if strings.Contains(w, "limits.body_memory_mb") != warned {
			t.Errorf("%q: warnings %q, want one on body_memory_mb: %v", mb, w, warned)
		}
	}
}

// Under a memory limit, the budget's default is a quarter of it, from 16
// MiB up to 1024; a budget set over a third of it is warned of, the
// default never.
func TestBodyMemoryUnderAMemoryLimit(t *testing.T) {
	defer func(l int64) { MemoryLimit = l }(MemoryLimit)
	for _, c := range []struct {
		limit  int64
		set    string
		want   int
		warned bool
	}{
		{0, "", 1024, false},
		{400 << 20, "", 100, false},
		{40 << 20, "", 16, true}, // under one request's body and answer: that warning, not the third's
		{64 << 30, "", 1024, false},
		{400 << 20, "limits: {body_memory_mb: 133}\n", 133, false},
		{400 << 20, "limits: {body_memory_mb: 134}\n", 134, true},
	} {
		MemoryLimit = c.limit
		cfg, err := Parse([]byte(minimal + c.set))
		if err != nil {
			t.Fatal(err)
		}
		w := strings.Join(cfg.Warnings(), "; ")
		if cfg.Limits.BodyMemoryMB != c.want || strings.Contains(w, "limits.body_memory_mb") != c.warned || strings.Count(w, "limits.body_memory_mb") > 1 ||
			c.set == "" && strings.Contains(w, "over a third") {
			t.Errorf("limit %d MiB, %q: body_memory_mb %d, want %d; warnings %q, want one on it: %v", c.limit>>20, c.set, cfg.Limits.BodyMemoryMB, c.want, w, c.warned)
		}
	}
}

// A mistake is named once, by its own field: a model without a name also
// made its backend's model "required with more than one model", and a
// negative block_size a negative bytes_per_block the file did not set (the
// twenty-ninth session's trial).
func TestValidationNamesOnlyTheCause(t *testing.T) {
	_, err := Parse([]byte("models:\n  - tokenizer: cl100k_base\n    block_size: -16\nbackends: [{id: a, url: \"http://127.0.0.1:9000\"}]\n"))
	want := "models[0].name: required (line 2); models[0].block_size: must be between 1 and 4096, got -16 (line 3)"
	if err == nil || err.Error() != want {
		t.Fatalf("%v\nwant %s", err, want)
	}
}

// A model no backend serves is warned of: its requests get 503 (it was
// accepted without a word: the twenty-ninth session's trial).
func TestModelWithoutBackendsIsWarnedOf(t *testing.T) {
	c, err := Parse([]byte("models: [{name: a, aliases: [aa]}, {name: b}, {name: c}]\nbackends:\n  - {id: x, url: \"http://127.0.0.1:1\", model: a}\n  - {id: y, url: \"http://127.0.0.1:2\", model: c}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if w := c.Warnings(); len(w) != 1 || w[0] != "models[1] (b): no backend serves it (backends[].model): its requests get 503" {
		t.Fatalf("warnings %q", w)
	}
}
