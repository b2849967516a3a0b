package bench

import (
	"context"
	"testing"

	"github.com/kvproxy/kvproxy/mockengine"
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
