package router

import (
	"math"
	"testing"

	"github.com/kvproxy/kvproxy/kv"
)

// mockPrefillMs is the simulated engine's prefill time for u tokens cut
// into 8192-token chunks, with no decodes.
func mockPrefillMs(u int) float64 {
	ms := 0.0
	for u > 0 {
		t := float64(min(u, 8192))
		ms += 4.209989e-7*t*t + 0.01518344*t + 16.50142
		u -= 8192
	}
	return ms
}

func TestCostModelFollowsMockTiming(t *testing.T) {
	cc := DefaultCostConfig()
	co := 1.0
	for _, u := range []int{16, 500, 2000, 8000, 20000, 64000} {
		got := cc.predict(co, &Candidate{}, u, 16, 0)
		want := mockPrefillMs(u)
		if math.Abs(got-want) > 0.05*want {
			t.Errorf("%d tokens: predicted %.1f ms, engine takes %.1f ms", u, got, want)
		}
	}
}

func TestCostModelTerms(t *testing.T) {
	cc := DefaultCostConfig()
	co := 1.0
	base := cc.predict(co, &Candidate{}, 1600, 16, 0)
	hit := cc.predict(co, &Candidate{Overlap: 50, Tiers: [kv.NumTiers]int32{50}}, 1600, 16, 0)
	host := cc.predict(co, &Candidate{Overlap: 50, Tiers: [kv.NumTiers]int32{0, 50}}, 1600, 16, 0)
	queued := cc.predict(co, &Candidate{PrefillTokens: 4000}, 1600, 16, 0)
	busy := cc.predict(co, &Candidate{ActiveBlocks: 10000}, 1600, 16, 0)
	engine := cc.predict(co, &Candidate{PrefillTokens: 100}, 1600, 16, 4000)
	if !(hit < host && host < base) {
		t.Errorf("device hit %.2f, host hit %.2f, miss %.2f: want increasing", hit, host, base)
	}
	if d := queued - base; math.Abs(d-4000*cc.QueueMsPerToken) > 1e-9 {
		t.Errorf("queue term %.3f", d)
	}
	if d := busy - base; math.Abs(d-10000*cc.DecodeMsPerBlock) > 1e-9 {
		t.Errorf("decode term %.3f", d)
	}
	if engine != queued {
		t.Errorf("engine queue view %.3f, want max(own, engine) = %.3f", engine, queued)
	}
	if got := cc.predict(co, &Candidate{Overlap: 200}, 1600, 16, 0); got != cc.PrefillBaseMs {
		t.Errorf("fully cached prompt costs %.3f, want the base %.1f", got, cc.PrefillBaseMs)
	}
}
