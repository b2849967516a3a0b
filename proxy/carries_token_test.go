package proxy

import "testing"

// Output tokens are counted in chunks written compactly or with spaces
// (json.dumps' default, found by the seventh session's trial: a spaced
// engine's 40-chunk stream counted 0 tokens and its router load never
// grew); chunks without output count none.
func TestCarriesToken(t *testing.T) {
	for _, c := range []struct {
		chunk string
		want  bool
	}{
		{`{"choices":[{"delta":{"content":"hi"}}]}`, true},
		{`{"choices": [{"delta": {"content": "hi"}}]}`, true},
		{`{"choices":[{"text":"hi","index":0}]}`, true},
		{`{"choices": [{"text": "hi", "index": 0}]}`, true},
		{`{"choices":[{"delta":{"reasoning_content": "hmm"}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"reasoning":"Let"},"logprobs":null,"finish_reason":null}]}`, true},
		{`{"choices":[{"index":0,"delta":{"reasoning":null,"content":""}}]}`, false},
		{`{"choices":[{"delta":{"tool_calls": [{"index":0}]}}]}`, true},
		{`{"choices":[{"delta":{"role":"assistant","content":""}}]}`, false},
		{`{"choices": [{"delta": {"role": "assistant", "content": ""}}]}`, false},
		{`{"choices":[{"delta":{"content":null,"tool_calls":[]}}]}`, false},
		{`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}`, false},
	} {
		if got := carriesToken([]byte(c.chunk)); got != c.want {
			t.Errorf("carriesToken(%s) = %v, want %v", c.chunk, got, c.want)
		}
	}
}
