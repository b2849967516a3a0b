package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"runtime"
	"testing"
)

// The twenty-sixth session's fuzzing trial: inputs that panicked, read past
// a slice, allocated far more than their size, or passed an engine's error
// on in a shape no OpenAI client reads.

// A zstd body declaring a 64 MiB window: the decoder allocated it whole,
// 64 MiB for 10 bytes, whatever the body limit. Over RFC 9659's 8 MiB it is
// refused.
func TestZstdWindowIsBounded(t *testing.T) {
	body := []byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x80, 0x43, 0x1f, 0x00, 0x61} // a 64 MiB window, 1000 × 'a'
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, _, err := decoded([]byte("zstd"), body, 1<<20, budgetShare{})
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("a body needing a 64 MiB window was decoded")
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 16<<20 {
		t.Fatalf("decoding 10 bytes allocated %d MiB", grew>>20)
	}
}

// A migratable stream whose body names prompt twice, the first an empty
// batch: its continuation panicked (the last member is the one read).
func TestContinuationOfARepeatedPrompt(t *testing.T) {
	var req apiRequest
	body := []byte(`{"model":"m","stream":true,"prompt":[],"prompt":"Once"}`)
	if pe := req.parse(body, false); pe != nil {
		t.Fatal(pe.msg)
	}
	m := &migration{body: req.body, partial: []byte(" upon"), maxTokens: completionsDefaultMax, defaultMax: true}
	cont := m.continuation(1)
	var again apiRequest
	if pe := again.parse(cont, false); pe != nil || again.promptText != "Once upon" {
		t.Fatalf("continuation %s: %v, prompt %q", cont, pe, again.promptText)
	}
}

// An engine's text with a \u escape cut short is decoded without reading
// past it (the relayed text a migration counts is not validated).
func TestUnquoteOfACutEscape(t *testing.T) {
	for _, s := range []string{`ab\u1`, `\u`, `x\ud83d\u12`} {
		b := make([]byte, len(s)) // no capacity past it
		copy(b, s)
		appendUnquoted(nil, b)
	}
}

// An engine error whose members have other types (a message that is a
// list) reaches the client as an OpenAI error, its message a string.
func TestMistypedEngineErrorIsNormalized(t *testing.T) {
	out := normalizeEngineError(400, []byte(`{"error":{"message":["a","b"],"type":"BadRequestError","code":400}}`))
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
	}
	if err := json.Unmarshal(out, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("%s (%v)", out, errors.Unwrap(err))
	}
}

// A zstd body needing a window over 8 MiB is told so, not that it is too
// large or corrupt (the review).
func TestZstdWindowIsNamed(t *testing.T) {
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}'}]\n", startFake(t, "e0", nil))
	req, _ := http.NewRequest("POST", p.url+"/v1/completions", bytes.NewReader([]byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x80, 0x43, 0x1f, 0x00, 0x61}))
	req.Header.Set("Content-Encoding", "zstd")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !bytes.Contains(b, []byte("window over 8 MiB")) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}
