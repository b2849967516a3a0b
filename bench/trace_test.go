package bench

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

const mooncakeFixture = `{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 250, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]}

{"timestamp": 100, "input_length": 700, "output_length": 3, "hash_ids": [0, 3]}
{"timestamp": 300.5, "input_length": 600, "output_length": 1, "hash_ids": [4]}
`

func loadFixture(t *testing.T) *Workload {
	t.Helper()
	w, err := LoadMooncake(strings.NewReader(mooncakeFixture))
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestMooncakeLengthsAndOrder(t *testing.T) {
	w := loadFixture(t)
	if len(w.Requests) != 4 {
		t.Fatalf("got %d requests, want 4", len(w.Requests))
	}
	wantIn := []int{1100, 700, 1024, 600}
	wantOut := []int{5, 3, 7, 1}
	wantAt := []time.Duration{0, 100 * time.Millisecond, 250 * time.Millisecond, 300500 * time.Microsecond}
	syn := Synth{Seed: 7}
	for i, r := range w.Requests {
		if r.Arrival != wantAt[i] || r.InputLen != wantIn[i] || r.OutputLen != wantOut[i] {
			t.Errorf("request %d: arrival %v in %d out %d", i, r.Arrival, r.InputLen, r.OutputLen)
		}
		if n := len(syn.Tokens(nil, &r)); n != r.InputLen {
			t.Errorf("request %d: %d tokens, want %d", i, n, r.InputLen)
		}
	}
	// 600 tokens behind one hash id: the rest is unique filler.
	last := w.Requests[3]
	if len(last.Segments) != 2 || last.Segments[0].Len != 512 || last.Segments[1].Len != 88 {
		t.Errorf("overlong request segments: %+v", last.Segments)
	}
}

func TestMooncakeSharedPrefixSharesTokens(t *testing.T) {
	w := loadFixture(t)
	syn := Synth{Seed: 7}
	a := syn.Tokens(nil, &w.Requests[0]) // ids 0,1,2 cut to 1100
	c := syn.Tokens(nil, &w.Requests[2]) // ids 0,1 exactly 1024
	b := syn.Tokens(nil, &w.Requests[1]) // ids 0,3 cut to 700
	if !slices.Equal(a[:1024], c) {
		t.Fatal("requests sharing hash ids 0,1 must share 1024 tokens")
	}
	if !slices.Equal(a[:512], b[:512]) {
		t.Fatal("requests sharing hash id 0 must share 512 tokens")
	}
	if slices.Equal(a[512:700], b[512:700]) {
		t.Fatal("different hash ids must give different tokens")
	}
	// Shared tokens mean shared block hashes, the thing the router sees.
	ha := kv.HashBlocks(nil, a, 16, 0)
	hb := kv.HashBlocks(nil, b, 16, 0)
	if !slices.Equal(ha[:32], hb[:32]) || ha[32] == hb[32] {
		t.Fatal("block hashes must agree exactly on the shared 512 tokens")
	}
	for _, tok := range a {
		if tok < TokenMin || tok >= TokenMax {
			t.Fatalf("token %d outside [%d, %d)", tok, TokenMin, TokenMax)
		}
	}
}

// Hash ids that differ only in their top bits are different blocks (they
// were masked into one: the planner's trial).
func TestMooncakeLargeHashIDsStayApart(t *testing.T) {
	w, err := LoadMooncake(strings.NewReader(`{"timestamp":0,"input_length":1024,"output_length":5,"hash_ids":[1,2]}
{"timestamp":10,"input_length":1024,"output_length":5,"hash_ids":[1152921504606846977,1152921504606846978]}
`))
	if err != nil {
		t.Fatal(err)
	}
	syn := Synth{Seed: 1}
	a, b := syn.Tokens(nil, &w.Requests[0]), syn.Tokens(nil, &w.Requests[1])
	if slices.Equal(a[:512], b[:512]) {
		t.Fatal("hash ids 1 and 2^60+1 gave the same block")
	}
}

// A line without hash_ids (or with the key misspelled) is taken as a
// prompt that shares nothing, and said so (the planner's trial); an Azure
// timestamp in another form names the two it takes.
func TestTraceLoadersSayWhatTheyDoubt(t *testing.T) {
	w, err := LoadMooncake(strings.NewReader(`{"timestamp":0,"input_length":600,"output_length":5,"hash_ids":[1,2]}
{"timestamp":10,"input_length":600,"output_length":5,"hash_id":[1,2]}
{"timestamp":20,"input_length":600,"output_length":5}
`))
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Warnings) != 1 || !strings.Contains(w.Warnings[0], "2 of 3 requests have no hash_ids (line 2 first)") {
		t.Fatalf("warnings %q", w.Warnings)
	}
	_, err = LoadAzure(strings.NewReader("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16T18:15:46Z,10,2\n"))
	if err == nil || !strings.Contains(err.Error(), "azure line 2: timestamp") || !strings.Contains(err.Error(), "2023-11-16 18:15:46.6805") {
		t.Fatalf("error %v", err)
	}
}

func TestSynthDeterministic(t *testing.T) {
	w := loadFixture(t)
	a := Synth{Seed: 1}.Tokens(nil, &w.Requests[0])
	b := Synth{Seed: 1}.Tokens(nil, &w.Requests[0])
	c := Synth{Seed: 2}.Tokens(nil, &w.Requests[0])
	if !slices.Equal(a, b) {
		t.Fatal("same seed must give the same tokens")
	}
	if slices.Equal(a, c) {
		t.Fatal("another seed must give other tokens")
	}
	// A cut segment is a prefix of the full one.
	full := Synth{Seed: 1}.Segment(nil, Segment{Key: 42, Len: 512})
	cut := Synth{Seed: 1}.Segment(nil, Segment{Key: 42, Len: 100})
	if !slices.Equal(full[:100], cut) {
		t.Fatal("cut segment must be a prefix of the full segment")
	}
}

func TestMooncakeRejectsBadLines(t *testing.T) {
	for _, in := range []string{
		`{"timestamp": 0, "input_length": 10}`,
		`{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}`,
		`not json`,
		`{"timestamp": 0, "input_length": 10.5, "output_length": 1}`,
		`{"timestamp": 1e300, "input_length": 10, "output_length": 1}`,
		`{"timestamp": 0, "input_length": 1e12, "output_length": 1}`,
		`{"timestamp":0,"input_length":2147483647,"output_length":5,"hash_ids":[1]}`,
		`{"timestamp":0,"input_length":5,"output_length":16777217,"hash_ids":[1]}`,
	} {
		if _, err := LoadMooncake(strings.NewReader(in)); err == nil {
			t.Errorf("accepted %q", in)
		}
	}
}

// Traces written by other tools load too: epoch-millisecond timestamps
// start at the earliest, a UTF-8 BOM is skipped, and lengths may be
// written as floats (2048.0, as pandas writes them).
func TestMooncakeFromOtherTools(t *testing.T) {
	in := "\ufeff" + `{"timestamp": 1732270003000, "input_length": 2048.0, "output_length": 10.0, "hash_ids": [1, 2, 3, 4]}` + "\r\n" +
		`{"timestamp": 1732270000000, "input_length": 100, "output_length": 1, "hash_ids": [1]}` + "\n"
	w, err := LoadMooncake(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	r := w.Requests
	if len(r) != 2 || r[0].Arrival != 0 || r[1].Arrival != 3*time.Second || r[1].InputLen != 2048 || r[1].OutputLen != 10 {
		t.Fatalf("%+v", r)
	}
	if w.Duration() != 3*time.Second {
		t.Fatalf("duration %v", w.Duration())
	}
}

const azureFixture = `TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:47.0000000,20,1
`

func TestAzureUniqueTokens(t *testing.T) {
	w, err := LoadAzure(strings.NewReader(azureFixture))
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 3 {
		t.Fatalf("got %d requests", len(w.Requests))
	}
	r := w.Requests
	if r[0].Arrival != 0 || r[1].InputLen != 20 || r[2].Arrival != 4314579*time.Microsecond {
		t.Fatalf("arrivals/order wrong: %v %v %v", r[0].Arrival, r[1].Arrival, r[2].Arrival)
	}
	syn := Synth{Seed: 3}
	a := syn.Tokens(nil, &r[0])
	b := syn.Tokens(nil, &r[2])
	if len(a) != 374 || len(b) != 396 || r[2].OutputLen != 109 {
		t.Fatalf("lengths %d %d", len(a), len(b))
	}
	if a[0] == b[0] && a[1] == b[1] && a[2] == b[2] {
		t.Fatal("azure prompts must not share a prefix")
	}
	// Rows out of order: arrivals start at the earliest, not the first row.
	unsorted := "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50.0,10,1\n2023-11-16 18:15:46.0,20,1\n"
	if w, err := LoadAzure(strings.NewReader(unsorted)); err != nil || w.Requests[0].InputLen != 20 || w.Requests[0].Arrival != 0 || w.Requests[1].Arrival != 4*time.Second {
		t.Fatalf("unsorted rows: %v %+v", err, w)
	}
	if _, err := LoadAzure(strings.NewReader("TIMESTAMP,ContextTokens,GeneratedTokens\n\n\n2023-11-16 18:15:50.0,x,1\n")); err == nil || !strings.Contains(err.Error(), "line 4") {
		t.Fatalf("a bad row on line 4: %v", err)
	}
	big := "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50.0,20,1\n2023-11-16 18:15:51.0,2147483647,1\n"
	if _, err := LoadAzure(strings.NewReader(big)); err == nil || !strings.Contains(err.Error(), "line 3: ContextTokens") {
		t.Fatalf("a prompt of 2^31 tokens on line 3: %v", err)
	}
	if _, err := LoadAzure(strings.NewReader("a,b,c\n1,2,3\n")); err == nil {
		t.Fatal("accepted a CSV without the Azure header")
	}
}

// The 2024 Azure traces write timestamps with a UTC offset; counts written
// as floats (4.0) load, as they do in Mooncake traces.
func TestAzure2024Timestamps(t *testing.T) {
	in := "TIMESTAMP,ContextTokens,GeneratedTokens\n" +
		"2024-05-10 00:00:00.009930+00:00,2162,5\n" +
		"2024-05-10 02:00:01.509930+02:00,4.0,1.0\n"
	w, err := LoadAzure(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	r := w.Requests
	if len(r) != 2 || r[0].InputLen != 2162 || r[1].InputLen != 4 || r[1].OutputLen != 1 || r[1].Arrival != 1500*time.Millisecond {
		t.Fatalf("%+v", r)
	}
	if _, err := LoadAzure(strings.NewReader("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,4.5,1\n")); err == nil {
		t.Fatal("accepted 4.5 tokens")
	}
}

// Loader errors speak the trace's terms: the field and the type it wants,
// the line of an oversized line, an empty Azure file; Azure headers load
// in any case.
func TestTraceLoaderErrors(t *testing.T) {
	_, err := LoadMooncake(strings.NewReader(`{"timestamp":0,"input_length":"10","output_length":1}`))
	if err == nil || err.Error() != "mooncake line 1: input_length: got string, want a number" {
		t.Errorf("a string length: %v", err)
	}
	// A line that is no object, and a file of pretty-printed JSON, say what
	// the format is (the benchmark trial: "got array, want a number" named
	// no field).
	for _, in := range []string{"[1,2,3]\n", "[\n  {\"timestamp\": 0}\n]\n", "{\n  \"timestamp\": 0,\n", "{\"timestamp\": 0} trailing\n"} {
		if _, err := LoadMooncake(strings.NewReader(in)); err == nil || !strings.Contains(err.Error(), "mooncake line 1: ") ||
			!strings.Contains(err.Error(), "want one JSON object per line (JSON Lines)") {
			t.Errorf("%q: %v", in, err)
		}
	}
	if _, err := LoadMooncake(strings.NewReader(`{"timestamp":1e15,"input_length":10,"output_length":1}`)); err == nil || !strings.Contains(err.Error(), "timestamps are in milliseconds") {
		t.Errorf("a timestamp in µs: %v", err)
	}
	_, err = LoadMooncake(strings.NewReader(`{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[-1]}`))
	if err == nil || !strings.Contains(err.Error(), "hash_ids") || strings.Contains(err.Error(), "Go ") {
		t.Errorf("a negative hash id: %v", err)
	}
	long := `{"timestamp":0,"input_length":10,"output_length":1}` + "\n" + strings.Repeat(" ", 65<<20) + "\n"
	if _, err := LoadMooncake(strings.NewReader(long)); err == nil || err.Error() != "mooncake line 2: longer than 64 MiB" {
		t.Errorf("a 65 MiB line: %v", err)
	}
	if _, err := LoadAzure(strings.NewReader("")); err == nil || !strings.Contains(err.Error(), "empty file") {
		t.Errorf("an empty Azure file: %v", err)
	}
	w, err := LoadAzure(strings.NewReader("timestamp,contexttokens,generatedtokens\n2023-11-16 18:15:46.68,374,44\n"))
	if err != nil || len(w.Requests) != 1 {
		t.Errorf("a lowercase header: %v", err)
	}
	if _, err := LoadFile("x.jsonl", "json"); err == nil || !strings.Contains(err.Error(), "multiturn") {
		t.Errorf("an unknown format: %v", err)
	}
}

func TestMultiTurnConversationsGrow(t *testing.T) {
	c := DefaultMultiTurn()
	c.Conversations = 20
	w := GenerateMultiTurn(c)
	w2 := GenerateMultiTurn(c)
	if len(w.Requests) == 0 || len(w.Requests) != len(w2.Requests) {
		t.Fatalf("got %d and %d requests", len(w.Requests), len(w2.Requests))
	}
	syn := Synth{Seed: 1}
	last := map[int][]uint32{}
	systems := map[uint64]bool{}
	for i := range w.Requests {
		r := &w.Requests[i]
		if r.Arrival != w2.Requests[i].Arrival || r.InputLen != w2.Requests[i].InputLen {
			t.Fatal("generation must be deterministic")
		}
		if i > 0 && r.Arrival < w.Requests[i-1].Arrival {
			t.Fatal("requests must be sorted by arrival")
		}
		tok := syn.Tokens(nil, r)
		if len(tok) != r.InputLen {
			t.Fatalf("request %d: %d tokens, want %d", i, len(tok), r.InputLen)
		}
		if prev, ok := last[r.Session]; ok {
			if len(tok) <= len(prev) || !slices.Equal(tok[:len(prev)], prev) {
				t.Fatalf("turn of conversation %d does not extend the previous turn", r.Session)
			}
		}
		last[r.Session] = tok
		systems[r.Segments[0].Key] = true
	}
	if len(systems) > c.SystemPrompts || len(systems) < 2 {
		t.Fatalf("%d distinct system prompts, configured %d", len(systems), c.SystemPrompts)
	}
}

func TestWorkloadScaleAndSlice(t *testing.T) {
	w := loadFixture(t)
	s := w.Scale(2)
	if s.Requests[2].Arrival != 125*time.Millisecond || w.Requests[2].Arrival != 250*time.Millisecond {
		t.Fatal("Scale must halve arrivals without changing the original")
	}
	sl := w.Slice(100*time.Millisecond, 200*time.Millisecond)
	if len(sl.Requests) != 2 || sl.Requests[0].Arrival != 0 || sl.Requests[1].Arrival != 150*time.Millisecond {
		t.Fatalf("slice: %+v", sl.Requests)
	}
}

// ShuffleTies permutes only requests of equal arrival, keeps every request,
// and the same seed gives the same order.
func TestShuffleTies(t *testing.T) {
	w := &Workload{Name: "ties"}
	for i := 0; i < 40; i++ {
		w.Requests = append(w.Requests, Request{Arrival: time.Duration(i/10) * time.Second, InputLen: i, Session: -1})
	}
	if w.ShuffleTies(0) != w {
		t.Fatal("seed 0 must leave the workload as it is")
	}
	a, b := w.ShuffleTies(7), w.ShuffleTies(7)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same seed, different orders")
	}
	moved := 0
	seen := make([]bool, 40)
	for i, r := range a.Requests {
		if r.Arrival != w.Requests[i].Arrival || r.InputLen/10 != i/10 || seen[r.InputLen] {
			t.Fatalf("position %d holds %+v", i, r)
		}
		seen[r.InputLen] = true
		if r.InputLen != i {
			moved++
		}
	}
	if moved < 20 {
		t.Fatalf("only %d of 40 requests moved", moved)
	}
	if w.Requests[5].InputLen != 5 {
		t.Fatal("the original workload changed")
	}
}

// SpreadTies moves each run of equal arrivals into the gap before the next
// distinct time, keeps order and count, and is deterministic.
func TestSpreadTies(t *testing.T) {
	w := &Workload{Name: "ties"}
	for i := 0; i < 40; i++ {
		w.Requests = append(w.Requests, Request{Arrival: time.Duration(i/10) * 3 * time.Second, InputLen: i, Session: -1})
	}
	if w.SpreadTies(0) != w {
		t.Fatal("seed 0 must leave the workload as it is")
	}
	a, b := w.SpreadTies(3), w.SpreadTies(3)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same seed, different arrivals")
	}
	distinct := map[time.Duration]bool{}
	for i, r := range a.Requests {
		lo := time.Duration(i/10) * 3 * time.Second
		if r.InputLen != i || r.Arrival < lo || r.Arrival >= lo+3*time.Second {
			t.Fatalf("request %d at %v (bucket from %v)", i, r.Arrival, lo)
		}
		if i > 0 && r.Arrival < a.Requests[i-1].Arrival {
			t.Fatalf("request %d arrives before request %d", i, i-1)
		}
		distinct[r.Arrival] = true
	}
	if len(distinct) != 40 {
		t.Fatalf("%d distinct arrivals of 40", len(distinct))
	}
	if w.Requests[15].Arrival != 3*time.Second {
		t.Fatal("the original workload changed")
	}
}

// Timestamps too far apart for a time.Duration are refused: Sub saturated
// and the rebase overflowed into an arrival of -2562047 h (the fuzzing
// trial).
func TestAzureTimestampsTooFarApart(t *testing.T) {
	csv := "TIMESTAMP,ContextTokens,GeneratedTokens\n2027-01-01 0:00:00,1,1\n0000-01-01 0:00:00,1,1\n"
	if _, err := LoadAzure(strings.NewReader(csv)); err == nil || !strings.Contains(err.Error(), "azure line 3: TIMESTAMP") {
		t.Fatalf("err %v, want line 3 refused", err)
	}
}
