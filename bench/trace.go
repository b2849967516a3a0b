package bench

import (
	"bufio"
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"
)

// MooncakeBlockTokens is the number of tokens behind one Mooncake hash id.
const MooncakeBlockTokens = 512

// Synthesized token ids lie in [TokenMin, TokenMax), clear of the special
// token ranges of common vocabularies (ids below 1000 and the high ids
// reserved for chat markers).
const (
	TokenMin = 1000
	TokenMax = 100000
)

// Key spaces of segment keys, so that segments of different origins never
// share tokens by accident.
const (
	keyMooncake  uint64 = 1 << 60
	keyUnique    uint64 = 2 << 60
	keySystem    uint64 = 3 << 60
	keyUser      uint64 = 4 << 60
	keyAssistant uint64 = 5 << 60
	keyIDMask    uint64 = 1<<60 - 1
)

// Segment is a run of synthesized tokens. Two segments with the same Key
// yield the same tokens; a segment shorter than another with the same key
// yields a prefix of the other's tokens.
type Segment struct {
	Key uint64
	Len int
}

// Request is one request of a workload. Its prompt is the concatenation of
// its segments, so requests with equal leading segments share leading tokens.
type Request struct {
	// Arrival is the time since the start of the trace.
	Arrival   time.Duration
	Segments  []Segment
	InputLen  int // sum of the segments' lengths
	OutputLen int
	// Session groups the turns of one conversation (multi-turn workload);
	// it is -1 for traces without sessions.
	Session int
}

// Workload is a named list of requests sorted by arrival.
type Workload struct {
	Name     string
	Requests []Request
	// Warnings are what a loader found questionable but took (lines
	// without hash_ids), for the user to see.
	Warnings []string
}

// Duration is the arrival time of the last request.
func (w *Workload) Duration() time.Duration {
	if len(w.Requests) == 0 {
		return 0
	}
	return w.Requests[len(w.Requests)-1].Arrival
}

// Slice keeps the requests arriving in [from, from+d), re-based to start at 0.
func (w *Workload) Slice(from, d time.Duration) *Workload {
	out := &Workload{Name: w.Name}
	for _, r := range w.Requests {
		if r.Arrival >= from && r.Arrival < from+d {
			r.Arrival -= from
			out.Requests = append(out.Requests, r)
		}
	}
	return out
}

// Limit keeps the first n requests (all when n <= 0).
func (w *Workload) Limit(n int) *Workload {
	if n <= 0 || n >= len(w.Requests) {
		return w
	}
	return &Workload{Name: w.Name, Requests: w.Requests[:n]}
}

// Scale divides every arrival time by speedup (speedup 2 halves the gaps).
func (w *Workload) Scale(speedup float64) *Workload {
	if speedup <= 0 || speedup == 1 {
		return w
	}
	out := &Workload{Name: w.Name, Requests: make([]Request, len(w.Requests))}
	copy(out.Requests, w.Requests)
	for i := range out.Requests {
		out.Requests[i].Arrival = time.Duration(float64(out.Requests[i].Arrival) / speedup)
	}
	return out
}

// ShuffleTies returns the workload with each run of requests of equal
// arrival time in a random order drawn from seed (0: unchanged). Traces
// with coarse timestamps (the Mooncake traces arrive in whole seconds, ~9
// requests each) list simultaneous requests in file order, but a live
// proxy routes them in whatever order they reach it; for order-sensitive
// policies such as round_robin each seed is one such order.
func (w *Workload) ShuffleTies(seed uint64) *Workload {
	if seed == 0 {
		return w
	}
	out := &Workload{Name: w.Name, Requests: make([]Request, len(w.Requests))}
	copy(out.Requests, w.Requests)
	rng := newRand(seed)
	rs := out.Requests
	for i := 0; i < len(rs); {
		j := i + 1
		for j < len(rs) && rs[j].Arrival == rs[i].Arrival {
			j++
		}
		for k := j - 1; k > i; k-- { // Fisher–Yates over rs[i:j]
			m := i + int(rng.next()%uint64(k-i+1))
			rs[k], rs[m] = rs[m], rs[k]
		}
		i = j
	}
	return out
}

// SpreadTies returns the workload with each run of requests of equal
// arrival time spread over the gap to the next distinct time, as a Poisson
// process with that many arrivals in it would place them (sorted uniform
// draws from seed; 0: unchanged), keeping their order. The Mooncake
// conversation trace's 12,031 requests carry 1,180 distinct timestamps about
// 3 s apart: replayed as they are, each bucket lands as one burst. The last
// run spreads over the mean gap between distinct times.
func (w *Workload) SpreadTies(seed uint64) *Workload {
	if seed == 0 || len(w.Requests) == 0 {
		return w
	}
	out := &Workload{Name: w.Name, Requests: make([]Request, len(w.Requests))}
	copy(out.Requests, w.Requests)
	rs := out.Requests
	distinct := 1
	for i := 1; i < len(rs); i++ {
		if rs[i].Arrival != rs[i-1].Arrival {
			distinct++
		}
	}
	meanGap := time.Duration(0)
	if distinct > 1 {
		meanGap = (rs[len(rs)-1].Arrival - rs[0].Arrival) / time.Duration(distinct-1)
	}
	rng := newRand(seed)
	var u []float64
	for i := 0; i < len(rs); {
		j := i + 1
		for j < len(rs) && rs[j].Arrival == rs[i].Arrival {
			j++
		}
		gap := meanGap
		if j < len(rs) {
			gap = rs[j].Arrival - rs[i].Arrival
		}
		u = u[:0]
		for k := i; k < j; k++ {
			u = append(u, rng.float())
		}
		sort.Float64s(u)
		t0 := rs[i].Arrival
		for k := i; k < j; k++ {
			rs[k].Arrival = t0 + time.Duration(u[k-i]*float64(gap))
		}
		i = j
	}
	return out
}

// Stats are aggregate sizes of a workload.
type Stats struct {
	Requests     int
	InputTokens  int64
	OutputTokens int64
	Duration     time.Duration
}

// Stats sums the workload's token counts.
func (w *Workload) Stats() Stats {
	s := Stats{Requests: len(w.Requests), Duration: w.Duration()}
	for _, r := range w.Requests {
		s.InputTokens += int64(r.InputLen)
		s.OutputTokens += int64(r.OutputLen)
	}
	return s
}

// Synth turns segments into token ids. Equal seeds give equal tokens.
type Synth struct {
	Seed uint64
}

// Tokens appends the prompt tokens of r to dst.
func (s Synth) Tokens(dst []uint32, r *Request) []uint32 {
	for _, seg := range r.Segments {
		dst = s.Segment(dst, seg)
	}
	return dst
}

// Segment appends the tokens of one segment to dst.
func (s Synth) Segment(dst []uint32, seg Segment) []uint32 {
	state := mix64(s.Seed ^ mix64(seg.Key+0x9e3779b97f4a7c15))
	for i := 0; i < seg.Len; i++ {
		state += 0x9e3779b97f4a7c15
		z := mix64(state)
		dst = append(dst, TokenMin+uint32((z>>32)*(TokenMax-TokenMin)>>32))
	}
	return dst
}

// mix64 is splitmix64's finalizer.
func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

type mooncakeLine struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLength  *float64 `json:"input_length"` // 2048.0 too, as pandas writes it
	OutputLength *float64 `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
}

// maxTraceMs bounds a timestamp: the largest time.Duration, in ms.
const maxTraceMs = float64(math.MaxInt64 / int64(time.Millisecond))

// MaxTraceTokens bounds a trace's token counts: 16M tokens, far beyond any
// model's context, so a larger count is a broken trace (whose prompt the
// simulator could not even hold in memory).
const MaxTraceTokens = 1 << 24

// length is a trace's token count: a whole number in [0, MaxTraceTokens].
func length(v float64) (int, bool) {
	if !(v >= 0 && v <= MaxTraceTokens) || v != math.Trunc(v) { // NaN too
		return 0, false
	}
	return int(v), true
}

// badLength is the error for a token count length rejects.
func badLength(field string, v any) error {
	return fmt.Errorf("%s %v is not a whole number from 0 to %d", field, v, MaxTraceTokens)
}

// LoadMooncake reads a Mooncake trace: one JSON object per line with
// timestamp (ms), input_length, output_length and hash_ids, each hash id
// standing for 512 prefix-chained tokens. The last block is cut to
// input_length; hash ids beyond input_length are dropped, and tokens beyond
// the hash ids are filled with tokens unique to the request. Arrivals start
// at the earliest timestamp (a trace may carry epoch milliseconds).
func LoadMooncake(r io.Reader) (*Workload, error) {
	w := &Workload{Name: "mooncake"}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	line := 0
	noIDs, firstNoIDs := 0, 0 // lines without hash_ids: prompts that share nothing
	for sc.Scan() {
		line++
		b := sc.Bytes()
		if line == 1 {
			b = bytes.TrimPrefix(b, []byte("\ufeff"))
		}
		if len(bytes.TrimSpace(b)) == 0 {
			continue
		}
		var m mooncakeLine
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, fmt.Errorf("mooncake line %d: %w", line, jsonFieldError(err))
		}
		if m.Timestamp == nil || m.InputLength == nil || m.OutputLength == nil {
			return nil, fmt.Errorf("mooncake line %d: timestamp, input_length and output_length are required", line)
		}
		in, ok := length(*m.InputLength)
		if !ok {
			return nil, fmt.Errorf("mooncake line %d: %w", line, badLength("input_length", *m.InputLength))
		}
		out, ok := length(*m.OutputLength)
		if !ok {
			return nil, fmt.Errorf("mooncake line %d: %w", line, badLength("output_length", *m.OutputLength))
		}
		if !(*m.Timestamp >= 0 && *m.Timestamp <= maxTraceMs) { // NaN too
			return nil, fmt.Errorf("mooncake line %d: timestamp %v ms is negative or beyond 292 years (timestamps are in milliseconds)", line, *m.Timestamp)
		}
		if m.HashIDs == nil && in > 0 {
			if noIDs++; firstNoIDs == 0 {
				firstNoIDs = line
			}
		}
		req := Request{
			Arrival:   time.Duration(*m.Timestamp * float64(time.Millisecond)),
			InputLen:  in,
			OutputLen: out,
			Session:   -1,
		}
		left := req.InputLen
		for _, id := range m.HashIDs {
			if left == 0 {
				break
			}
			n := min(left, MooncakeBlockTokens)
			if id > keyIDMask {
				// Masked, ids that differ only in their top bits would be
				// one block (the planner's trial); mixed, two collide with
				// a chance of 2^-60. Smaller ids stay as they are.
				id = mix64(id) & keyIDMask
			}
			req.Segments = append(req.Segments, Segment{Key: keyMooncake | id, Len: n})
			left -= n
		}
		if left > 0 {
			req.Segments = append(req.Segments, Segment{Key: keyUnique | uint64(len(w.Requests)), Len: left})
		}
		w.Requests = append(w.Requests, req)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, fmt.Errorf("mooncake line %d: longer than 64 MiB", line+1)
		}
		return nil, err
	}
	if noIDs > 0 {
		// A misspelled key reads as none (the planner's trial): no reuse,
		// without a word.
		w.Warnings = append(w.Warnings, fmt.Sprintf("%d of %d requests have no hash_ids (line %d first): their prompts share nothing", noIDs, len(w.Requests), firstNoIDs))
	}
	sortByArrival(w.Requests)
	rebase(w.Requests)
	return w, nil
}

// jsonFieldError says which field of a Mooncake line has the wrong type,
// in the trace's terms rather than Go's.
func jsonFieldError(err error) error {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te) && te.Field == "":
		return fmt.Errorf("got %s, want one JSON object per line (JSON Lines), such as {\"timestamp\": 0, \"input_length\": 512, \"output_length\": 64, \"hash_ids\": [0]}", te.Value)
	case errors.Is(err, io.ErrUnexpectedEOF) || err.Error() == "unexpected end of JSON input":
		return fmt.Errorf("%v: want one JSON object per line (JSON Lines), not JSON spread over lines", err)
	case errors.As(err, &se):
		return fmt.Errorf("%v: want one JSON object per line (JSON Lines), and nothing else on it", err)
	case !errors.As(err, &te):
		return err
	}
	want := "a number"
	switch te.Type.Kind() {
	case reflect.Uint64:
		want = "a whole number from 0 to 2^64-1"
	case reflect.Slice:
		want = "a list of hash ids"
	}
	return fmt.Errorf("%s: got %s, want %s", te.Field, te.Value, want)
}

// rebase makes sorted arrivals start at 0.
func rebase(rs []Request) {
	if len(rs) == 0 {
		return
	}
	t0 := rs[0].Arrival
	for i := range rs {
		rs[i].Arrival -= t0
	}
}

// maxAzureSpan bounds how far apart a trace's timestamps may be: a year,
// far beyond any trace, and far from time.Duration's limits.
const maxAzureSpan = 366 * 24 * time.Hour

// azureTimeLayouts are the timestamp formats of the Azure LLM inference
// traces: 2023's, and 2024's with a UTC offset (+00:00).
var azureTimeLayouts = []string{"2006-01-02 15:04:05.999999999", "2006-01-02 15:04:05.999999999Z07:00"}

// parseAzureTime parses a timestamp in either layout.
func parseAzureTime(s string) (time.Time, error) {
	for _, layout := range azureTimeLayouts {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("timestamp %q: want 2023's form (2023-11-16 18:15:46.6805) or 2024's, with a UTC offset (2024-05-10 00:00:00.009930+00:00)", s)
}

// LoadAzure reads an Azure LLM inference trace (CSV with the header
// TIMESTAMP,ContextTokens,GeneratedTokens). There is no prefix information,
// so every prompt is made of tokens unique to its request: the no-reuse
// control.
func LoadAzure(r io.Reader) (*Workload, error) {
	cr := csv.NewReader(bufio.NewReader(r))
	cr.ReuseRecord = true
	head, err := cr.Read()
	if err == io.EOF {
		return nil, errors.New("azure: empty file (want the header TIMESTAMP,ContextTokens,GeneratedTokens)")
	}
	if err != nil {
		return nil, fmt.Errorf("azure header: %w", err)
	}
	col := map[string]int{} // by lowercase name: headers vary in case
	for i, h := range head {
		col[strings.ToLower(strings.TrimSpace(strings.TrimPrefix(h, "\ufeff")))] = i
	}
	ti, ok1 := col["timestamp"]
	ci, ok2 := col["contexttokens"]
	gi, ok3 := col["generatedtokens"]
	if !ok1 || !ok2 || !ok3 {
		return nil, errors.New("azure header must name TIMESTAMP, ContextTokens and GeneratedTokens")
	}
	w := &Workload{Name: "azure"}
	var t0 time.Time
	for {
		rec, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("azure: %w", err) // csv's errors name the line
		}
		line, _ := cr.FieldPos(0)
		ts, err := parseAzureTime(strings.TrimSpace(rec[ti]))
		if err != nil {
			return nil, fmt.Errorf("azure line %d: %w", line, err)
		}
		ctx, err := azureCount("ContextTokens", rec[ci])
		if err != nil {
			return nil, fmt.Errorf("azure line %d: %w", line, err)
		}
		gen, err := azureCount("GeneratedTokens", rec[gi])
		if err != nil {
			return nil, fmt.Errorf("azure line %d: %w", line, err)
		}
		if len(w.Requests) == 0 {
			t0 = ts // arrivals are kept from the first row, and rebased once sorted
		}
		if d := ts.Sub(t0); d < -maxAzureSpan || d > maxAzureSpan {
			// Sub saturates, and rebasing then overflowed into negative
			// arrivals (the fuzzing trial: years 0000 and 2027 together).
			return nil, fmt.Errorf("azure line %d: TIMESTAMP %s is more than %v from the first row's", line, rec[ti], maxAzureSpan)
		}
		w.Requests = append(w.Requests, Request{
			Arrival:   ts.Sub(t0),
			Segments:  []Segment{{Key: keyUnique | uint64(len(w.Requests)), Len: ctx}},
			InputLen:  ctx,
			OutputLen: gen,
			Session:   -1,
		})
	}
	sortByArrival(w.Requests)
	rebase(w.Requests)
	return w, nil
}

// azureCount parses a token count column: a whole number, which may be
// written as a float (4.0), as in Mooncake traces.
func azureCount(field, s string) (int, error) {
	s = strings.TrimSpace(s)
	f, err := strconv.ParseFloat(s, 64)
	v, ok := length(f)
	if err != nil || !ok {
		return 0, badLength(field, strconv.Quote(s))
	}
	return v, nil
}

func sortByArrival(rs []Request) {
	sort.SliceStable(rs, func(i, j int) bool { return rs[i].Arrival < rs[j].Arrival })
}

// MultiTurnConfig sizes the generated multi-turn chat workload. Lengths are
// means: each draw is uniform in [mean/2, 3*mean/2].
type MultiTurnConfig struct {
	Seed          uint64
	Conversations int
	SystemPrompts int // distinct system prompts shared by conversations
	SystemLen     int // tokens of each system prompt
	Turns         int // mean turns per conversation
	UserLen       int // tokens of each user message
	OutputLen     int // tokens of each answer
	// Rate is new conversations per second (Poisson arrivals).
	Rate float64
	// Think is the mean time between one turn's arrival and the next
	// (the answer plus the user's think time), exponentially distributed.
	Think time.Duration
}

// DefaultMultiTurn is a chat workload in the style of vLLM's multi-turn
// benchmark: a few shared system prompts, conversations of several turns.
func DefaultMultiTurn() MultiTurnConfig {
	return MultiTurnConfig{
		Seed:          1,
		Conversations: 1000,
		SystemPrompts: 8,
		SystemLen:     2000,
		Turns:         6,
		UserLen:       400,
		OutputLen:     250,
		Rate:          2,
		Think:         20 * time.Second,
	}
}

// maxGeneratedSeconds bounds a generated arrival time, far below where a
// time.Duration overflows (292 years): arrivals past it all land on it.
const maxGeneratedSeconds = 1e8

// GenerateMultiTurn builds a multi-turn chat workload: every turn's prompt is
// the conversation's system prompt, every earlier user message and answer,
// and the new user message, so each turn extends the previous turn's prompt.
func GenerateMultiTurn(c MultiTurnConfig) *Workload {
	if c.SystemPrompts < 1 {
		c.SystemPrompts = 1
	}
	if c.Turns < 1 {
		c.Turns = 1
	}
	if c.Rate <= 0 {
		c.Rate = 1
	}
	rng := newRand(c.Seed)
	draw := func(mean int) int {
		if mean <= 0 {
			return 0
		}
		return mean/2 + int(rng.next()%uint64(mean+1))
	}
	exp := func(mean float64) float64 { return -mean * math.Log(1-rng.float()) }
	w := &Workload{Name: "multiturn"}
	start := 0.0
	for conv := 0; conv < c.Conversations; conv++ {
		start += exp(1 / c.Rate)
		sys := Segment{Key: keySystem | rng.next()%uint64(c.SystemPrompts), Len: c.SystemLen}
		turns := 1 + int(rng.next()%uint64(2*c.Turns-1)) // mean c.Turns
		history := []Segment{sys}
		at := start
		for t := 0; t < turns; t++ {
			id := uint64(conv)<<16 | uint64(t)
			user := Segment{Key: keyUser | id, Len: draw(c.UserLen)}
			segs := append(append([]Segment(nil), history...), user)
			out := max(draw(c.OutputLen), 1)
			in := 0
			for _, s := range segs {
				in += s.Len
			}
			w.Requests = append(w.Requests, Request{
				Arrival:   time.Duration(min(at, maxGeneratedSeconds) * float64(time.Second)),
				Segments:  segs,
				InputLen:  in,
				OutputLen: out,
				Session:   conv,
			})
			history = append(segs, Segment{Key: keyAssistant | id, Len: out})
			at += exp(c.Think.Seconds())
		}
	}
	sortByArrival(w.Requests)
	return w
}

// rand is a small deterministic generator (splitmix64).
type rand struct{ s uint64 }

func newRand(seed uint64) *rand { return &rand{s: mix64(seed + 1)} }

func (r *rand) next() uint64 {
	r.s += 0x9e3779b97f4a7c15
	return mix64(r.s)
}

// float is uniform in [0, 1).
func (r *rand) float() float64 { return float64(r.next()>>11) / (1 << 53) }

// Formats accepted by LoadFile.
const (
	FormatMooncake  = "mooncake"
	FormatAzure     = "azure"
	FormatMultiTurn = "multiturn"
)

// LoadFile loads a trace file in the given format (mooncake or azure; an
// empty format is guessed from the file extension).
func LoadFile(path, format string) (*Workload, error) {
	if format == "" {
		format = FormatMooncake
		if strings.HasSuffix(strings.ToLower(path), ".csv") {
			format = FormatAzure
		}
	}
	load := LoadMooncake
	switch format {
	case FormatMooncake:
	case FormatAzure:
		load = LoadAzure
	default:
		return nil, fmt.Errorf("unknown trace format %q (want mooncake or azure; multiturn is generated, not loaded)", format)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	w, err := load(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return w, nil
}
