package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// A stream whose client asks for no usage is metered by the engine's own:
// kvproxy asks a vLLM, SGLang or simulated engine for the usage chunk and
// keeps it from the client. A client's own stream_options go as they came,
// and an engine of kind openai is not asked.
func TestUnaskedUsageIsMeteredNotRelayed(t *testing.T) {
	e0, e1 := startFake(t, "e0", func(f *fakeEngine) { f.tokens = 4 }), startFake(t, "e1", func(f *fakeEngine) { f.tokens = 4 })
	p := startProxyYAML(t, `
models: [{name: m}]
backends: [{id: e0, url: 'http://{{e0}}'}, {id: e1, url: 'http://{{e1}}', kind: openai}]
`, e0, e1)
	stream := func(pin, extra string) string {
		t.Helper()
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"nvext":{"backend_instance_id":"`+pin+`"}`+extra+`}`)
		if resp.StatusCode != 200 || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return string(b)
	}
	options := func(e *fakeEngine) any { return e.lastBody()["stream_options"] }

	if b := stream("e0", ""); strings.Contains(b, `"usage"`) || strings.Count(b, "data: ") != 6 {
		t.Fatalf("the client asked for no usage and got:\n%s", b)
	}
	if o, _ := options(e0).(map[string]any); o["include_usage"] != true || len(o) != 1 {
		t.Fatalf("the engine was sent stream_options %v", options(e0))
	}
	p.waitIdle(t)
	if logs := p.logs.String(); !strings.Contains(logs, `"prompt_tokens":10,"output_tokens":8,"cached_tokens":3`) {
		t.Fatalf("not metered by the engine's usage:\n%s", logs)
	}

	if b := stream("e0", `,"stream_options":{"include_usage":true}`); !strings.Contains(b, `"usage":{"prompt_tokens":10`) {
		t.Fatalf("the client asked for the usage and got:\n%s", b)
	}
	stream("e0", `,"stream_options":{"include_usage":false}`)
	if o, _ := options(e0).(map[string]any); o["include_usage"] != false {
		t.Fatalf("the client's stream_options became %v", options(e0))
	}
	stream("e1", "")
	if o := options(e1); o != nil {
		t.Fatalf("an engine of kind openai was sent stream_options %v", o)
	}
}

// An engine asked for the usage chunk that answers the stream with its
// whole answer as JSON has it streamed with the usage chunk only when the
// client asked for one.
func TestUnaskedUsageOfAWholeAnswer(t *testing.T) {
	e := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}`)
	}))
	defer e.Close()
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: '"+e.URL+"'}]\n")
	for _, tc := range []struct {
		extra string
		usage bool
	}{{"", false}, {`,"stream_options":{"include_usage":true}`, true}} {
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]`+tc.extra+`}`)
		if resp.StatusCode != 200 || strings.Contains(string(b), `"usage":{`) != tc.usage {
			t.Fatalf("%s: %d, want a usage chunk %v:\n%s", tc.extra, resp.StatusCode, tc.usage, b)
		}
	}
	p.waitIdle(t)
	if logs := p.logs.String(); strings.Count(logs, `"prompt_tokens":9,"output_tokens":1`) != 2 {
		t.Fatalf("not metered by the engine's usage:\n%s", logs)
	}
}

// An engine that sends the usage unasked (force_include_usage) is asked
// nothing, and its clients get the chunk as it sends it: kept from them,
// it was lost to those who relied on the engine's flag (the SDK trial).
func TestForcedUsageReachesTheClient(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.forceUsage = 4, true })
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', force_include_usage: true}]\n", e)
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"usage":{"prompt_tokens":10`) {
		t.Fatalf("%d, want the engine's usage chunk:\n%s", resp.StatusCode, b)
	}
	if o := e.lastBody()["stream_options"]; o != nil {
		t.Fatalf("the engine was sent stream_options %v", o)
	}
	p.waitIdle(t)
	if logs := p.logs.String(); !strings.Contains(logs, `"prompt_tokens":10,"output_tokens":8,"cached_tokens":3`) {
		t.Fatalf("not metered by the engine's usage:\n%s", logs)
	}
}
