package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"text/tabwriter"
	"time"
)

// Result is one row of a report: the outcome of one policy (sim) or one run
// (replay) on one workload. The JSON names are the published format.
type Result struct {
	Policy         string  `json:"policy"`
	TTFTP50        float64 `json:"ttft_p50_ms"`
	TTFTP90        float64 `json:"ttft_p90_ms"`
	TTFTP99        float64 `json:"ttft_p99_ms"`
	ITLP50         float64 `json:"itl_p50_ms"`
	E2EP50         float64 `json:"e2e_p50_ms"`
	ThroughputTokS float64 `json:"throughput_tok_s"`
	// HitRate is cached over prompt tokens, of the requests whose
	// responses reported cached tokens: unknown (NaN, JSON null, n/a in
	// the table) when none did.
	HitRate Rate `json:"hit_rate"`
	Errors  int  `json:"errors"`
	// ErrorReasons counts the failed requests by reason.
	ErrorReasons map[string]int `json:"error_reasons,omitempty"`
	// Interrupted (replay only) counts requests in flight when the run was
	// interrupted: not failures, and their TTFTs count when they had one.
	Interrupted int `json:"interrupted,omitempty"`
	// ForgoneHitRate (sim only) is the prompt share the router saw cached
	// on some worker but routed elsewhere: Σ (best overlap − chosen
	// overlap) × block size / prompt tokens. It shows what a policy trades
	// away for balance.
	ForgoneHitRate float64 `json:"forgone_hit_rate,omitempty"`

	// Samples for charts; not part of the JSON report.
	TTFTs []time.Duration `json:"-"`
}

// Rate is a share in [0, 1], NaN when unknown: JSON null, n/a in a table.
type Rate float64

// Known reports whether the rate was measured.
func (r Rate) Known() bool { return !math.IsNaN(float64(r)) }

// MarshalJSON writes an unknown rate as null.
func (r Rate) MarshalJSON() ([]byte, error) {
	if !r.Known() {
		return []byte("null"), nil
	}
	return json.Marshal(float64(r))
}

// String formats the rate for a table.
func (r Rate) String() string {
	if !r.Known() {
		return "n/a"
	}
	return fmt.Sprintf("%.3f", float64(r))
}

// Report is the JSON object kvbench prints with -json.
type Report struct {
	Results []Result `json:"results"`
	// CeilingHitRate is the hit rate of one LRU cache holding the whole
	// fleet's capacity (sim only).
	CeilingHitRate *float64 `json:"ceiling_hit_rate,omitempty"`
}

// WriteJSON writes the report as one JSON object.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteTable writes the report as an aligned text table.
func (r *Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	forgone := false // a simulator column; replay cannot know it
	interrupted := false
	for _, x := range r.Results {
		forgone = forgone || x.ForgoneHitRate > 0
		interrupted = interrupted || x.Interrupted > 0
	}
	fmt.Fprint(tw, "policy\tttft p50 ms\tp90 ms\tp99 ms\titl p50 ms\te2e p50 ms\ttok/s\thit rate\t")
	if forgone {
		fmt.Fprint(tw, "forgone\t")
	}
	fmt.Fprint(tw, "errors\t")
	if interrupted {
		fmt.Fprint(tw, "interrupted\t")
	}
	fmt.Fprintln(tw)
	for _, x := range r.Results {
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t%.2f\t%.0f\t%.0f\t%s\t",
			x.Policy, x.TTFTP50, x.TTFTP90, x.TTFTP99, x.ITLP50, x.E2EP50, x.ThroughputTokS, x.HitRate)
		if forgone {
			fmt.Fprintf(tw, "%.3f\t", x.ForgoneHitRate)
		}
		fmt.Fprintf(tw, "%d\t", x.Errors)
		if interrupted {
			fmt.Fprintf(tw, "%d\t", x.Interrupted)
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if r.CeilingHitRate != nil {
		_, err := fmt.Fprintf(w, "hit-rate ceiling (one LRU cache of the whole fleet's capacity): %.3f\n", *r.CeilingHitRate)
		return err
	}
	return nil
}

// Recorder accumulates per-request measurements into a Result. It is not
// safe for concurrent use.
type Recorder struct {
	ttft, e2e   []time.Duration
	itl         Histogram
	prompt      int64
	cached      int64
	cachedOf    int64 // prompt tokens of the requests that reported cached ones
	output      int64
	errors      int
	reasons     map[string]int
	interrupted int
	forgone     int64
	first, last time.Duration
	haveSpan    bool
}

// Request records one finished request: its start and end on the
// recorder's clock, time to first token, prompt, cached (negative: not
// reported) and output tokens.
func (r *Recorder) Request(start, end, ttft time.Duration, prompt, cached, output int) {
	r.ttft = append(r.ttft, ttft)
	r.e2e = append(r.e2e, end-start)
	r.prompt += int64(prompt)
	if cached >= 0 {
		r.cached += int64(cached)
		r.cachedOf += int64(prompt)
	}
	r.output += int64(output)
	r.span(start, end)
}

// ITL records one gap between consecutive output tokens (or chunks), n times.
func (r *Recorder) ITL(d time.Duration, n int) { r.itl.AddN(d, n) }

// Forgone records prompt tokens cached on some worker but not on the one
// chosen.
func (r *Recorder) Forgone(tokens int) { r.forgone += int64(tokens) }

// Error records a failed request and why it failed.
func (r *Recorder) Error(start, end time.Duration, reason string) {
	r.errors++
	if r.reasons == nil {
		r.reasons = map[string]int{}
	}
	r.reasons[reason]++
	r.span(start, end)
}

// TTFT records the time to first token of a request that got one but did
// not finish (it failed, or was cut off), so that the slow requests a
// timeout or an interrupt ends are not missing from the percentiles.
func (r *Recorder) TTFT(ttft time.Duration) { r.ttft = append(r.ttft, ttft) }

// Interrupted records a request cut off by the end of the run, with the
// output tokens it had received.
func (r *Recorder) Interrupted(start, end time.Duration, output int) {
	r.interrupted++
	r.output += int64(output)
	r.span(start, end)
}

func (r *Recorder) span(start, end time.Duration) {
	if !r.haveSpan || start < r.first {
		r.first = start
	}
	if !r.haveSpan || end > r.last {
		r.last = end
	}
	r.haveSpan = true
}

// Result summarizes what was recorded.
func (r *Recorder) Result(policy string) Result {
	res := Result{Policy: policy, Errors: r.errors, ErrorReasons: r.reasons, Interrupted: r.interrupted}
	slices.Sort(r.ttft)
	slices.Sort(r.e2e)
	res.TTFTP50 = ms(Percentile(r.ttft, 0.50))
	res.TTFTP90 = ms(Percentile(r.ttft, 0.90))
	res.TTFTP99 = ms(Percentile(r.ttft, 0.99))
	res.E2EP50 = ms(Percentile(r.e2e, 0.50))
	res.ITLP50 = ms(r.itl.Quantile(0.50))
	if span := r.last - r.first; span > 0 {
		res.ThroughputTokS = float64(r.output) / span.Seconds()
	}
	res.HitRate = Rate(math.NaN())
	if r.cachedOf > 0 {
		res.HitRate = Rate(float64(r.cached) / float64(r.cachedOf))
	}
	if r.prompt > 0 {
		res.ForgoneHitRate = float64(r.forgone) / float64(r.prompt)
	}
	res.TTFTs = r.ttft
	return res
}

// ScaleTime converts a result measured on a clock running k times faster
// than the engines' own (a live fleet of simulated engines with speedup k)
// back to engine time: durations × k, throughput ÷ k.
func (r *Result) ScaleTime(k float64) {
	if k <= 0 || k == 1 {
		return
	}
	for _, p := range []*float64{&r.TTFTP50, &r.TTFTP90, &r.TTFTP99, &r.ITLP50, &r.E2EP50} {
		*p = math.Round(*p*k*1e3) / 1e3
	}
	r.ThroughputTokS /= k
	for i := range r.TTFTs {
		r.TTFTs[i] = time.Duration(float64(r.TTFTs[i]) * k)
	}
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/1e3) / 1e3 }

// Percentile of sorted samples by the nearest-rank method (0 when empty).
func Percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// Histogram counts durations in log-spaced buckets 1% apart, from 1µs up,
// so quantiles of millions of samples cost a fixed amount of memory.
type Histogram struct {
	counts []int64
	n      int64
}

const histBase = 1.01

// AddN records d n times.
func (h *Histogram) AddN(d time.Duration, n int) {
	if n <= 0 {
		return
	}
	us := float64(d) / 1e3
	b := 0
	if us > 1 {
		b = int(math.Log(us)/math.Log(histBase)) + 1
	}
	if b >= len(h.counts) {
		h.counts = append(h.counts, make([]int64, b+1-len(h.counts))...)
	}
	h.counts[b] += int64(n)
	h.n += int64(n)
}

// Quantile returns the upper edge of the bucket holding quantile q
// (within 1% of the true value).
func (h *Histogram) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := int64(math.Ceil(q * float64(h.n)))
	rank = max(rank, 1)
	var seen int64
	for b, c := range h.counts {
		seen += c
		if seen >= rank {
			if b == 0 {
				return time.Microsecond
			}
			return time.Duration(math.Pow(histBase, float64(b)) * 1e3)
		}
	}
	return 0
}
