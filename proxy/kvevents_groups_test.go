package proxy

import (
	"strings"
	"testing"
)

// POST /v1/kv_events answers how many of the batch's events were applied:
// not those of a KV cache group other than the one its rank follows, nor
// a rank's past the largest (it said every event was applied).
func TestPushedEventsAppliedAreCounted(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m, block_size: 2}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m, kv_events: {mode: http}}]\n", e)
	push := func(batch, want string) {
		t.Helper()
		resp, b := post(t, p.url+"/v1/kv_events", batch)
		if resp.StatusCode != 200 || !strings.Contains(string(b), want) {
			t.Fatalf("%d %s, want %s", resp.StatusCode, b, want)
		}
	}
	stored := func(h, group string) string {
		return `{"type":"block_stored","block_hashes":[` + h + `],"token_ids":[1,2],"block_size":2` + group + `}`
	}
	push(`{"engine_id":"e0","events":[`+stored("1", `,"group_idx":0,"kv_cache_spec_kind":"sliding_window"`)+`,`+
		stored("2", `,"group_idx":1,"kv_cache_spec_kind":"full_attention"`)+`,`+stored("3", `,"group_idx":0`)+`]}`, `"applied":2`) // the first, then the group it cleared
	push(`{"engine_id":"e0","events":[`+stored("4", "")+`]}`, `"applied":0`)
	push(`{"engine_id":"e0","data_parallel_rank":5000,"events":[`+stored("5", "")+`]}`, `"applied":0`)
	push(`{"engine_id":"e0","data_parallel_rank":1,"events":[`+stored("6", "")+`]}`, `"applied":1`)
}
