package proxy

import (
	"strings"
	"testing"
)

// One 500 may be the request's doing: an engine answering 500s is ejected
// only after errorAnswerLimit of them in a row, and an answer that shows it
// up (here a 400, the request's fault) starts the count again. A gateway's
// 502 in front of an engine ejects it at once.
func TestErrorAnswersEjectOnlyInARow(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}'}]
health: {eject_base: 1m, eject_max: 1m}
`, e)
	answer := func(status int) int {
		t.Helper()
		e.mu.Lock()
		e.status, e.errBody = status, `{"error":{"message":"engine says `+itoa(status)+`","type":"x","param":null,"code":null}}`
		e.mu.Unlock()
		resp, _ := post(t, p.url+"/v1/chat/completions", chatBody)
		return resp.StatusCode
	}
	for i, st := range []int{500, 500, 400, 500, 500} {
		if got := answer(st); got != st {
			t.Fatalf("answer %d: %d, want the engine's %d (ejected too early)", i, got, st)
		}
	}
	if got := answer(500); got != 500 {
		t.Fatalf("third 500 in a row: %d", got)
	}
	if got := answer(200); got != 503 {
		t.Fatalf("after three 500s in a row: %d, want 503 (ejected)", got)
	}
}

// The engine gets kvproxy's key, never the client's: an engine refusing it
// is a gateway fault (502 naming the backend and its api_key), not the
// client's 401, and counts towards ejection as an error answer does.
func TestEngineRefusingKvproxysKeyIs502(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) {
		f.status, f.errBody = 401, `{"error":{"message":"Unauthorized","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}`
	})
	p := startProxyYAML(t, `
models: [{name: m, aliases: [alias-m]}]
backends: [{id: e0, url: 'http://{{e0}}', api_key: wrong-key}]
health: {eject_base: 1m, eject_max: 1m}
`, e)
	for i := 0; i < errorAnswerLimit; i++ {
		resp, b := post(t, p.url+"/v1/chat/completions", chatBody)
		if resp.StatusCode != 502 || !strings.Contains(string(b), `refused kvproxy's credentials (401 Unauthorized); check its api_key`) || !strings.Contains(string(b), `"type":"upstream_error"`) {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	if resp, b := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 503 {
		t.Fatalf("after %d refusals: %d %s, want 503 (ejected)", errorAnswerLimit, resp.StatusCode, b)
	}
	p.waitIdle(t)
}
