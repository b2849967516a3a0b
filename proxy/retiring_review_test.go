package proxy

import (
	"fmt"
	"testing"

	"github.com/kvproxy/kvproxy/config"
)

// A state loaded before a reload (an /admin/backends request that started
// just before it) lists a backend the reload removed once, not once live
// and once draining.
func TestRowsOfAnOlderStateListEachBackendOnce(t *testing.T) {
	e := startFake(t, "e0", nil)
	other := startFake(t, "e1", nil)
	head := "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
		"backends:\n  - {id: e1, url: 'http://" + other.addr + "', model: m}\n"
	p := startProxyYAML(t, head+"  - {id: e0, url: 'http://{{e0}}', model: m}\n", e)
	before := p.s.st.Load()
	old := before.backends["e0"]
	old.inflight.Add(1) // a request in flight: it drains until this ends
	cfg, err := config.Parse([]byte(head))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range p.s.backendRows(before) {
		if r.ID == "e0" {
			n++
		}
	}
	var draining bool
	for _, r := range p.s.backendRows(p.s.st.Load()) {
		draining = draining || (r.ID == "e0" && r.Draining)
	}
	old.inflight.Add(-1)
	if n != 1 || !draining {
		t.Fatalf("e0 listed %d times by the older state (want 1), draining in the current one: %v", n, draining)
	}
	p.waitIdle(t)
}

// restart_needed after a series of reloads names exactly the start-only
// settings that differ from those the proxy started with: A, B, A, C, C.
func TestRestartNeededAfterSeveralReloads(t *testing.T) {
	e := startFake(t, "e0", nil)
	base := "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
		"backends: [{id: e0, url: 'http://" + e.addr + "', model: m}]\n"
	p := startProxyYAML(t, base+"health: {interval: 2s}\n")
	for i, step := range []struct {
		extra string
		want  string
	}{
		{"health: {interval: 3s}\nlimits: {retry_budget: 0.5}\n", "[limits.retry_budget health.interval]"},
		{"health: {interval: 2s}\n", "[]"},
		{"health: {interval: 2s, fall: 7}\n", "[health.fall]"},
		{"health: {interval: 2s, fall: 7}\n", "[health.fall]"},
		{"health: {interval: 2s}\nrouter: {policy: least_load}\n", "[router (model m)]"},
		{"health: {interval: 2s}\n", "[]"},
	} {
		cfg, err := config.Parse([]byte(base + step.extra))
		if err != nil {
			t.Fatal(err)
		}
		if err := p.s.Reload(cfg); err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprint(p.s.st.Load().restartNeeded); got != step.want {
			t.Fatalf("reload %d: restart_needed %s, want %s", i+1, got, step.want)
		}
	}
}
