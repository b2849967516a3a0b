package bench

import (
	"context"
	"sync"
	"testing"

	"github.com/kvproxy/kvproxy/mockengine"
	"github.com/kvproxy/kvproxy/tokenize"
)

// startEngine runs one simulated vLLM on loopback, 50× faster than real time.
func startEngine(t *testing.T) string {
	t.Helper()
	cfg := mockengine.DefaultConfig()
	cfg.Model = "m"
	cfg.CacheBlocks = 4000
	cfg.Speedup = 50
	e, err := mockengine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	addr, err := e.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return "http://" + addr
}

// The replay client against a real (simulated) engine over HTTP: token-id
// prompts sharing prefixes come back with cached_tokens in usage, and
// every request gets exactly its output length.
func TestReplayAgainstMockEngine(t *testing.T) {
	url := startEngine(t)
	w := smallChat().Limit(60)
	res, err := Replay(context.Background(), w, ReplayConfig{URL: url, Model: "m", Concurrency: 4, Synth: Synth{Seed: 3}}, "engine")
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 0 || len(res.TTFTs) != len(w.Requests) {
		t.Fatalf("%d errors, %d of %d requests measured", res.Errors, len(res.TTFTs), len(w.Requests))
	}
	if res.HitRate < 0.3 {
		t.Fatalf("hit rate %.3f from usage.cached_tokens: shared system prompts should hit", res.HitRate)
	}
	if res.ITLP50 <= 0 || res.E2EP50 < res.TTFTP50 {
		t.Fatalf("implausible timings %+v", res)
	}
}

func TestReplayChatAgainstMockEngine(t *testing.T) {
	url := startEngine(t)
	w := smallChat().Limit(20)
	res, err := Replay(context.Background(), w, ReplayConfig{URL: url, Model: "m", Mode: ModeChat, Concurrency: 2, Synth: Synth{Seed: 3}}, "chat")
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 0 || len(res.TTFTs) != len(w.Requests) || res.HitRate <= 0 {
		t.Fatalf("chat replay: %+v", res)
	}
}

// Chat replay with the engine tokenizer's single-token words sends prompts
// of the trace's lengths (the engine's usage.prompt_tokens is the length
// plus the chat template's few tokens a message); made-up words run longer.
func TestReplayChatWordsKeepTheTracesLengths(t *testing.T) {
	url := startEngine(t) // cl100k_base with chatml
	tok, err := tokenize.Get("cl100k_base")
	if err != nil {
		t.Fatal(err)
	}
	words := SingleTokenWords(tok)
	if len(words) < 5000 {
		t.Fatalf("%d single-token words, want thousands", len(words))
	}
	for _, w := range words[:50] {
		if n := len(tok.Encode(nil, " "+w)); n != 1 {
			t.Fatalf("%q encodes to %d tokens", w, n)
		}
	}
	w := smallChat().Limit(20)
	for _, c := range []struct {
		words  []string
		lo, hi float64 // prompt tokens over the trace's, all requests
	}{{words, 1, 1.1}, {nil, 1.5, 4}} {
		var mu sync.Mutex
		sent, got := 0, 0
		onReq := func(r RequestRecord) {
			mu.Lock()
			defer mu.Unlock()
			sent += w.Requests[r.Index].InputLen
			got += r.Prompt
		}
		res, err := Replay(context.Background(), w, ReplayConfig{URL: url, Model: "m", Mode: ModeChat, Words: c.words, Concurrency: 2,
			Synth: Synth{Seed: 3}, OnRequest: onReq}, "chat")
		if err != nil || res.Errors != 0 {
			t.Fatalf("chat replay: %v, %+v", err, res)
		}
		r := float64(got) / float64(sent)
		t.Logf("words %v: %d prompt tokens for %d in the trace (%.3f×)", c.words != nil, got, sent, r)
		if r < c.lo || r > c.hi {
			t.Errorf("words %v: the engine counted %d prompt tokens for %d in the trace (%.2f×), want %.1f–%.1f×", c.words != nil, got, sent, r, c.lo, c.hi)
		}
	}
}
