package bench

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestWriteRecords(t *testing.T) {
	var b strings.Builder
	err := WriteRecords(&b, []RequestRecord{
		{Index: 0, Arrival: 1500 * time.Microsecond, Sent: 2 * time.Millisecond, Worker: "mock-3", Prompt: 100, Cached: 32, Output: 7, TTFT: 250 * time.Millisecond},
		{Index: 1, Worker: "e,1", Err: "status 503"},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := DumpHeader + "\n" +
		"0,1.500,2.000,mock-3,100,32,7,250.000,\n" +
		"1,0.000,0.000,\"e,1\",0,0,0,0.000,status 503\n"
	if b.String() != want {
		t.Fatalf("got\n%s\nwant\n%s", b.String(), want)
	}
}

// The simulator reports every request once, on the engine the policy chose;
// pinning its own assignment back reproduces the run exactly, and pinning
// moves requests where told.
func TestSimOnRequestAndPin(t *testing.T) {
	w := smallChat()
	var mu sync.Mutex
	var recs []RequestRecord
	cfg := smallFleet()
	cfg.OnRequest = func(policy string, r RequestRecord) {
		mu.Lock()
		defer mu.Unlock()
		if policy != "round_robin" {
			t.Errorf("policy %q", policy)
		}
		recs = append(recs, r)
	}
	base, err := Simulate(w, cfg, "round_robin")
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != len(w.Requests) {
		t.Fatalf("%d records for %d requests", len(recs), len(w.Requests))
	}
	pins := make([]int, len(w.Requests))
	seen := make([]bool, len(w.Requests))
	for _, r := range recs {
		if seen[r.Index] || r.Prompt != w.Requests[r.Index].InputLen || r.Output != w.Requests[r.Index].OutputLen ||
			r.Arrival != w.Requests[r.Index].Arrival || r.TTFT <= 0 {
			t.Fatalf("bad record %+v", r)
		}
		seen[r.Index] = true
		if _, err := fmt.Sscanf(r.Worker, "engine-%d", &pins[r.Index]); err != nil {
			t.Fatal(err)
		}
	}
	cfg.OnRequest = nil
	cfg.Pin = pins
	again, err := Simulate(w, cfg, "round_robin")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(base, again) {
		t.Fatalf("pinned to its own assignment, the run differs:\n%+v\n%+v", base, again)
	}
	for i := range pins {
		pins[i] = 2
	}
	recs = nil
	cfg.OnRequest = func(_ string, r RequestRecord) { recs = append(recs, r) }
	one, err := Simulate(w, cfg, "round_robin")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.Worker != "engine-2" {
			t.Fatalf("request %d pinned to engine 2 ran on %s", r.Index, r.Worker)
		}
	}
	if one.TTFTP90 <= base.TTFTP90 {
		t.Fatalf("one engine for everything should queue: p90 %v vs %v", one.TTFTP90, base.TTFTP90)
	}
}

// The replay reports every request with the worker the proxy named.
func TestReplayOnRequest(t *testing.T) {
	fe := &fakeEngine{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(workerHeader, "mock-5")
		fe.ServeHTTP(w, r)
	}))
	defer srv.Close()
	w := loadFixture(t)
	w.Requests[3].OutputLen = 13 // the fake engine fails this one
	w = w.Scale(10)
	var recs []RequestRecord
	_, err := Replay(context.Background(), w, ReplayConfig{URL: srv.URL, Model: "m", Synth: Synth{Seed: 1},
		OnRequest: func(r RequestRecord) { recs = append(recs, r) }}, "live")
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != len(w.Requests) {
		t.Fatalf("%d records for %d requests", len(recs), len(w.Requests))
	}
	for _, r := range recs {
		q := &w.Requests[r.Index]
		if r.Worker != "mock-5" || r.Arrival != q.Arrival || r.Sent < r.Arrival {
			t.Fatalf("bad record %+v", r)
		}
		if r.Index == 3 {
			if r.Err == "" {
				t.Fatalf("failed request without error: %+v", r)
			}
			continue
		}
		if r.Err != "" || r.Output != q.OutputLen || r.Prompt != q.InputLen || r.Cached != q.InputLen/2 || r.TTFT <= 0 {
			t.Fatalf("bad record %+v for %+v", r, *q)
		}
	}
}
