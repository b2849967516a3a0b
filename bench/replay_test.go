package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeEngine is a tiny OpenAI-compatible streaming server on loopback. It
// answers max_tokens chunks, reports half the prompt as cached, and fails
// requests whose prompt starts with a token listed in fail.
type fakeEngine struct {
	mu       sync.Mutex
	bodies   []map[string]any
	inflight int
	peak     int
	// usage: "" reports cached tokens, "no-details" usage without
	// prompt_tokens_details, "none" no usage chunk.
	usage string
}

func (f *fakeEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body map[string]any
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	f.bodies = append(f.bodies, body)
	f.inflight++
	f.peak = max(f.peak, f.inflight)
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.inflight--
		f.mu.Unlock()
	}()
	n := int(body["max_tokens"].(float64))
	prompt := 0
	chat := r.URL.Path == "/v1/chat/completions"
	if chat {
		for _, m := range body["messages"].([]any) {
			prompt += len(strings.Fields(m.(map[string]any)["content"].(string)))
		}
	} else {
		prompt = len(body["prompt"].([]any))
	}
	if n == 13 {
		http.Error(w, `{"error":{"message":"unlucky"}}`, http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	for i := 0; i < n; i++ {
		if chat {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n")
		} else {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\"x\"}]}\n\n")
		}
		fl.Flush()
		time.Sleep(time.Millisecond) // a real engine's decode step
	}
	switch f.usage {
	case "":
		fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"prompt_tokens_details\":{\"cached_tokens\":%d}}}\n\n", prompt, n, prompt/2)
	case "no-details":
		fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d}}\n\n", prompt, n)
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func TestReplayOpenLoopMeasuresResponses(t *testing.T) {
	fe := &fakeEngine{}
	srv := httptest.NewServer(fe)
	defer srv.Close()
	w := loadFixture(t)
	w.Requests[3].OutputLen = 13 // the fake engine fails this one
	res, err := Replay(context.Background(), w.Scale(10), ReplayConfig{URL: srv.URL, Model: "m", Synth: Synth{Seed: 1}}, "live")
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 1 {
		t.Fatalf("errors = %d, want 1", res.Errors)
	}
	if res.HitRate != 0.5 {
		t.Fatalf("hit rate = %v, want 0.5 (cached_tokens from usage)", res.HitRate)
	}
	if res.TTFTP50 <= 0 || res.E2EP50 < res.TTFTP50 || res.ITLP50 < 1 || res.ThroughputTokS <= 0 {
		t.Fatalf("implausible timings: %+v", res)
	}
	if len(res.TTFTs) != 3 {
		t.Fatalf("%d TTFT samples, want 3", len(res.TTFTs))
	}
	// The body carries the prompt as token ids and asks for usage.
	fe.mu.Lock()
	defer fe.mu.Unlock()
	var b map[string]any
	for _, x := range fe.bodies {
		if x["max_tokens"].(float64) == 5 {
			b = x
		}
	}
	if b == nil || len(b["prompt"].([]any)) != 1100 || b["stream"] != true ||
		b["stream_options"].(map[string]any)["include_usage"] != true {
		t.Fatalf("bad request body: %v", b)
	}
	want := Synth{Seed: 1}.Tokens(nil, &w.Requests[0])
	for i, v := range b["prompt"].([]any) {
		if uint32(v.(float64)) != want[i] {
			t.Fatalf("prompt token %d = %v, want %d", i, v, want[i])
		}
	}
}

func TestReplayClosedLoopChat(t *testing.T) {
	fe := &fakeEngine{}
	srv := httptest.NewServer(fe)
	defer srv.Close()
	c := DefaultMultiTurn()
	c.Conversations = 6
	c.OutputLen = 4
	c.SystemLen = 50
	c.UserLen = 20
	w := GenerateMultiTurn(c)
	res, err := Replay(context.Background(), w, ReplayConfig{URL: srv.URL, Model: "m", Mode: ModeChat, Concurrency: 2}, "chat")
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 0 || len(res.TTFTs) != len(w.Requests) {
		t.Fatalf("errors %d, %d of %d requests measured", res.Errors, len(res.TTFTs), len(w.Requests))
	}
	fe.mu.Lock()
	defer fe.mu.Unlock()
	if fe.peak > 2 {
		t.Fatalf("closed loop at concurrency 2 had %d requests in flight", fe.peak)
	}
	// Later turns carry the conversation as messages: system first, and
	// one word per synthesized token.
	for _, b := range fe.bodies {
		msgs := b["messages"].([]any)
		if msgs[0].(map[string]any)["role"] != "system" {
			t.Fatalf("first message is not the system prompt: %v", msgs[0])
		}
		words := 0
		for _, m := range msgs {
			words += len(strings.Fields(m.(map[string]any)["content"].(string)))
		}
		if len(msgs) > 2 && msgs[2].(map[string]any)["role"] != "assistant" {
			t.Fatalf("third message of a later turn must be the answer: %v", msgs)
		}
		found := false
		for _, r := range w.Requests {
			if r.InputLen == words {
				found = true
			}
		}
		if !found {
			t.Fatalf("a chat body of %d words matches no request length", words)
		}
	}
}

func TestReplayCountsTransportErrors(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n")
		// no [DONE]: the stream is cut
	}))
	defer srv.Close()
	w := loadFixture(t)
	res, err := Replay(context.Background(), w, ReplayConfig{URL: srv.URL, Concurrency: 4}, "cut")
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != len(w.Requests) {
		t.Fatalf("errors = %d, want %d", res.Errors, len(w.Requests))
	}
}

func TestHasText(t *testing.T) {
	for in, want := range map[string]bool{
		`{"choices":[{"index":0,"text":" x","finish_reason":null}]}`:                true,
		`{"choices":[{"index":0,"text":"","finish_reason":"stop"}]}`:                false,
		`{"choices":[{"delta":{"role":"assistant","content":""}}]}`:                 false,
		`{"choices":[{"delta":{"role":"assistant"},"content": null}]}`:              false,
		`{"choices":[{"delta":{"content": "hi"}}]}`:                                 true,
		`{"choices":[{"delta":{"content":"\"q\""}}]}`:                               true,
		`{"choices":[{"text":"","logprobs":{"text":"","tokens":[]}},{"text":"b"}]}`: true,
	} {
		if got := hasText([]byte(in)); got != want {
			t.Errorf("hasText(%s) = %v, want %v", in, got, want)
		}
	}
}

// BenchmarkReadStream measures the replay client's cost per SSE chunk.
func BenchmarkReadStream(b *testing.B) {
	var sb strings.Builder
	for i := 0; i < 256; i++ {
		sb.WriteString("data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" word\",\"finish_reason\":null}]}\n\n")
	}
	sb.WriteString("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":256,\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\ndata: [DONE]\n\n")
	stream := sb.String()
	t0 := time.Now()
	b.ReportAllocs()
	b.SetBytes(int64(len(stream)))
	for b.Loop() {
		var o outcome
		if err := readStream(strings.NewReader(stream), t0, &o); err != nil || o.output != 256 {
			b.Fatal(err, o.output)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*257), "ns/chunk")
}

// stallingEngine streams one chunk per request, then holds the stream open
// until the client goes away; started receives one value per first chunk.
func stallingEngine(t *testing.T, started chan<- struct{}) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"text\":\"x\"}]}\n\n")
		w.(http.Flusher).Flush()
		started <- struct{}{}
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)
	return srv
}

func stalledWorkload(n int) *Workload {
	w := &Workload{Name: "stall"}
	for i := range n {
		w.Requests = append(w.Requests, Request{InputLen: 4, OutputLen: 8, Segments: []Segment{{Key: keyUnique | uint64(i), Len: 4}}, Session: -1})
	}
	return w
}

// Requests in flight when the run is interrupted are cut off, not failed,
// and the first tokens they had count in the TTFT percentiles.
func TestReplayInterruptKeepsInFlightTTFTs(t *testing.T) {
	started := make(chan struct{}, 4)
	srv := stallingEngine(t, started)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		for range 4 {
			<-started
		}
		time.Sleep(200 * time.Millisecond) // for the client to read the chunks
		cancel()
	}()
	var recs []RequestRecord
	res, err := Replay(ctx, stalledWorkload(4), ReplayConfig{URL: srv.URL, Model: "m", Concurrency: 4,
		OnRequest: func(r RequestRecord) { recs = append(recs, r) }}, "x")
	if err == nil {
		t.Fatal("no error from an interrupted run")
	}
	if res.Errors != 0 || res.Interrupted != 4 || len(res.TTFTs) != 4 || res.TTFTP50 <= 0 {
		t.Fatalf("want 4 interrupted with their TTFTs, no errors: %+v", res)
	}
	if len(recs) != 4 || recs[0].Err != "interrupted" || recs[0].TTFT <= 0 {
		t.Fatalf("records: %+v", recs)
	}
}

// A request that times out is an error saying so, and keeps its TTFT.
func TestReplayTimeoutKeepsTTFT(t *testing.T) {
	started := make(chan struct{}, 2)
	srv := stallingEngine(t, started)
	res, err := Replay(context.Background(), stalledWorkload(2), ReplayConfig{URL: srv.URL, Model: "m", Concurrency: 2,
		Timeout: 200 * time.Millisecond}, "x")
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 2 || res.ErrorReasons["timeout after 200ms"] != 2 || len(res.TTFTs) != 2 || res.Interrupted != 0 {
		t.Fatalf("want 2 timeouts with their TTFTs: %+v", res)
	}
}

// A server whose usage lacks cached tokens gives an unknown hit rate (n/a,
// JSON null), not 0; one that sends no usage has its output counted from
// the chunks.
func TestReplayWithoutCachedTokensOrUsage(t *testing.T) {
	for _, usage := range []string{"no-details", "none"} {
		fe := &fakeEngine{usage: usage}
		srv := httptest.NewServer(fe)
		res, err := Replay(context.Background(), loadFixture(t).Scale(10), ReplayConfig{URL: srv.URL, Model: "m"}, "live")
		srv.Close()
		if err != nil {
			t.Fatal(err)
		}
		if res.Errors != 0 || res.HitRate.Known() || res.ThroughputTokS <= 0 {
			t.Fatalf("%s: want no errors, an unknown hit rate and output counted: %+v", usage, res)
		}
		var table, js bytes.Buffer
		rep := Report{Results: []Result{res}}
		if err := rep.WriteTable(&table); err != nil || !strings.Contains(table.String(), "n/a") {
			t.Fatalf("%s: table %v %q", usage, err, table.String())
		}
		if err := rep.WriteJSON(&js); err != nil || !strings.Contains(js.String(), `"hit_rate": null`) {
			t.Fatalf("%s: JSON %v %s", usage, err, js.String())
		}
	}
}

// An open-loop replay interrupted before requests fall due sends none of
// them: they were never sent, not cut off in flight (they were launched
// with the cancelled context and counted interrupted; found by the review
// of the day's diff).
func TestReplayInterruptedBeforeItsRequestsSendsNone(t *testing.T) {
	started := make(chan struct{}, 100)
	srv := stallingEngine(t, started)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	records := 0
	res, _ := Replay(ctx, stalledWorkload(50), ReplayConfig{URL: srv.URL, Model: "m",
		OnRequest: func(RequestRecord) { records++ }}, "x")
	if res.Interrupted != 0 || res.Errors != 0 || records != 0 || len(started) != 0 {
		t.Fatalf("interrupted %d, errors %d, records %d, engine saw %d: want none sent", res.Interrupted, res.Errors, records, len(started))
	}
}
