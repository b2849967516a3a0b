package bench

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

func TestRecorderResult(t *testing.T) {
	var r Recorder
	for i := 1; i <= 100; i++ {
		start := time.Duration(i) * time.Second
		r.Request(start, start+2*time.Second, time.Duration(i)*time.Millisecond, 100, 25, 10)
		r.ITL(20*time.Millisecond, 9)
	}
	r.Error(0, time.Second, "status 500")
	res := r.Result("x")
	if res.TTFTP50 != 50 || res.TTFTP90 != 90 || res.TTFTP99 != 99 {
		t.Fatalf("ttft percentiles %v %v %v", res.TTFTP50, res.TTFTP90, res.TTFTP99)
	}
	if res.E2EP50 != 2000 || res.HitRate != 0.25 || res.Errors != 1 {
		t.Fatalf("e2e %v hit %v errors %d", res.E2EP50, res.HitRate, res.Errors)
	}
	if res.ITLP50 < 20 || res.ITLP50 > 20.2 {
		t.Fatalf("itl p50 %v, want 20 within 1%%", res.ITLP50)
	}
	// 1000 output tokens between t=0 and t=102s.
	if want := 1000.0 / 102; res.ThroughputTokS < want-1e-9 || res.ThroughputTokS > want+1e-9 {
		t.Fatalf("throughput %v want %v", res.ThroughputTokS, want)
	}
}

func TestReportJSONShape(t *testing.T) {
	c := 0.5
	rep := Report{Results: []Result{{Policy: "kv", TTFTP50: 1}}, CeilingHitRate: &c}
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	var generic struct {
		Results []map[string]any `json:"results"`
	}
	if err := json.Unmarshal(buf.Bytes(), &generic); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"policy", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "e2e_p50_ms", "throughput_tok_s", "hit_rate", "errors"} {
		if _, ok := generic.Results[0][k]; !ok {
			t.Errorf("JSON result lacks %q: %s", k, buf.String())
		}
	}
	buf.Reset()
	if err := rep.WriteTable(&buf); err != nil || !strings.Contains(buf.String(), "ceiling") {
		t.Fatalf("table: %v %q", err, buf.String())
	}
}

func TestLRUEvictsLeastRecentlyUsed(t *testing.T) {
	l := NewLRU(3)
	l.Insert([]kv.BlockHash{1, 2, 3})
	if n := l.Lookup([]kv.BlockHash{1, 2}, 10); n != 2 {
		t.Fatalf("lookup 1,2 = %d", n)
	}
	l.Insert([]kv.BlockHash{4}) // evicts 3, the least recent
	if n := l.Lookup([]kv.BlockHash{3}, 10); n != 0 {
		t.Fatal("3 should have been evicted")
	}
	if n := l.Lookup([]kv.BlockHash{1, 2, 4}, 10); n != 3 || l.Len() != 3 {
		t.Fatalf("lookup 1,2,4 = %d, len %d", n, l.Len())
	}
	if n := l.Lookup([]kv.BlockHash{1, 2, 4}, 2); n != 2 {
		t.Fatal("limit not applied")
	}
}

func TestCeilingHitRate(t *testing.T) {
	w := loadFixture(t)
	// Request order: ids[0,1,2]/1100, ids[0,3]/700, ids[0,1]/1024, ids[4]/600.
	// Hits with a big cache: 0, 512 (id 0), 1008 (ids 0,1 minus the last block), 0.
	got := CeilingHitRate(w, Synth{}, 16, 1<<20, 0)
	want := float64(512+1008) / float64(1100+700+1024+600)
	if got != want {
		t.Fatalf("ceiling %v want %v", got, want)
	}
	if small := CeilingHitRate(w, Synth{}, 16, 10, 0); small >= got {
		t.Fatalf("a 10-block cache (%v) must hit less than a big one (%v)", small, got)
	}
	// Engines of 66 blocks (1,056 tokens) cannot take the 1,100-token
	// request and its output (the simulator fails it): the ceiling leaves
	// it out, and the 1,024-token one finds only id 0 (from the 700).
	out := CeilingHitRate(w, Synth{}, 16, 1<<20, 66)
	if want := float64(512) / float64(700+1024+600); out != want {
		t.Fatalf("ceiling without the request that fits no engine: %v want %v", out, want)
	}
}

func TestResultScaleTime(t *testing.T) {
	r := Result{TTFTP50: 10, TTFTP90: 20, TTFTP99: 30, ITLP50: 1.5, E2EP50: 100, ThroughputTokS: 400, TTFTs: []time.Duration{time.Millisecond}}
	r.ScaleTime(4)
	if r.TTFTP50 != 40 || r.TTFTP99 != 120 || r.ITLP50 != 6 || r.E2EP50 != 400 || r.ThroughputTokS != 100 || r.TTFTs[0] != 4*time.Millisecond {
		t.Fatalf("scaled: %+v", r)
	}
}
