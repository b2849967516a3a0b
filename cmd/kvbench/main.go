package main

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvproxy/kvproxy/bench"
	"github.com/kvproxy/kvproxy/router"
	"github.com/kvproxy/kvproxy/tokenize"
)

func main() {
	if len(os.Args) < 2 {
		usage(os.Stderr)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "sim":
		err = runSim(os.Args[2:], os.Stdout)
	case "replay":
		err = runReplay(os.Args[2:], os.Stdout)
	case "-h", "-help", "--help", "help":
		usage(os.Stdout)
		return
	default:
		fmt.Fprintf(os.Stderr, "kvbench: unknown command %q\n", os.Args[1])
		usage(os.Stderr)
		os.Exit(2)
	}
	if errors.Is(err, flag.ErrHelp) {
		return // the flag set has printed its usage
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvbench:", err)
		var ie *interruptedError
		if errors.As(err, &ie) {
			os.Exit(128 + int(ie.sig)) // as a shell reports a command a signal ended
		}
		os.Exit(1)
	}
}

// interruptedError ends a run a signal cut short, after its partial
// results are printed.
type interruptedError struct {
	sig syscall.Signal
	msg string
}

func (e *interruptedError) Error() string { return e.msg }

// stopSignals are the signals that end a replay early with its results:
// Ctrl-C, and the polite kill of a job runner or container.
var stopSignals = []os.Signal{os.Interrupt, syscall.SIGTERM}

// cancelOnSignal returns a context cancelled, with the signal as its cause,
// by the first stop signal; a second one kills as usual.
func cancelOnSignal() (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, stopSignals...)
	quit := make(chan struct{})
	go func() {
		select {
		case sig := <-sigs:
			signal.Stop(sigs)
			cancel(&interruptedError{sig: sig.(syscall.Signal)})
		case <-quit:
		}
	}()
	return ctx, func() {
		close(quit)
		signal.Stop(sigs)
		cancel(nil)
	}
}

func usage(w io.Writer) {
	fmt.Fprint(w, `usage:
  kvbench sim    -trace FILE [-format mooncake|azure|multiturn] [-engines 8] [-policies all] [-json] [-plot DIR]
  kvbench replay -url URL -trace FILE [-speedup S | -concurrency N] [-mode completions|chat] [-json]
Run "kvbench sim -h" or "kvbench replay -h" for every flag.
`)
}

// DefaultSpeedup compresses the Mooncake conversation trace's arrivals so
// that round_robin runs the reference fleet (8 engines) near saturation: at
// 3.5 the fleet still keeps up with the offered load on average (output
// throughput equals the offered rate) but round_robin queues in bursts
// (TTFT p90 of seconds); at 4 its queues grow without bound.
const DefaultSpeedup = 3.5

// maxMultiTurnSpan bounds a generated workload's length.
const maxMultiTurnSpan = 30 * 24 * time.Hour

// workloadFlags are the flags shared by sim and replay.
type workloadFlags struct {
	trace, format string
	name          string
	speedup       float64
	seed          uint64
	shuffleTies   uint64
	spreadTies    uint64
	limit         int
	from, dur     time.Duration
	mt            bench.MultiTurnConfig
}

func (wf *workloadFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&wf.trace, "trace", "", "trace file (Mooncake JSONL or Azure CSV); not needed for -format multiturn")
	fs.StringVar(&wf.format, "format", "", "trace format: mooncake, azure or multiturn (default: azure for a .csv file, else mooncake)")
	fs.StringVar(&wf.name, "name", "", "workload name used in chart titles and file names (default: the trace file's base name)")
	fs.Float64Var(&wf.speedup, "speedup", DefaultSpeedup, "divide arrival times by this factor; the default is tuned for the Mooncake conversation trace on the reference fleet (8 engines): use 1 for your own trace's real rate")
	fs.Uint64Var(&wf.seed, "seed", 1, "seed of token synthesis, the multi-turn generator and (sim) the router's tie-breaks; a replay with another seed sends other tokens, so a fleet warmed by an earlier replay does not inflate its hits")
	fs.Uint64Var(&wf.shuffleTies, "shuffle-ties", 0, "put requests of equal arrival time in a random order drawn from this seed (sim: as a live proxy would see them; 0: file order)")
	fs.Uint64Var(&wf.spreadTies, "spread-ties", 0, "spread requests of equal arrival time over the gap to the next one, as Poisson arrivals drawn from this seed (0: as in the file)")
	fs.IntVar(&wf.limit, "limit", 0, "use only the first N requests (0: all)")
	fs.DurationVar(&wf.from, "from", 0, "start of the slice of the trace to use (trace time, before -speedup)")
	fs.DurationVar(&wf.dur, "duration", 0, "length of the slice of the trace to use, in trace time before -speedup (0: to the end)")
	d := bench.DefaultMultiTurn()
	wf.mt = d
	fs.IntVar(&wf.mt.Conversations, "conversations", d.Conversations, "multiturn: conversations")
	fs.IntVar(&wf.mt.SystemPrompts, "system-prompts", d.SystemPrompts, "multiturn: distinct shared system prompts")
	fs.IntVar(&wf.mt.SystemLen, "system-len", d.SystemLen, "multiturn: tokens per system prompt")
	fs.IntVar(&wf.mt.Turns, "turns", d.Turns, "multiturn: mean turns per conversation")
	fs.IntVar(&wf.mt.UserLen, "user-len", d.UserLen, "multiturn: mean tokens per user message")
	fs.IntVar(&wf.mt.OutputLen, "output-len", d.OutputLen, "multiturn: mean tokens per answer")
	fs.Float64Var(&wf.mt.Rate, "rate", d.Rate, "multiturn: new conversations per second")
	fs.DurationVar(&wf.mt.Think, "think", d.Think, "multiturn: mean time between turns of a conversation")
}

func (wf *workloadFlags) load() (*bench.Workload, error) {
	if wf.limit < 0 || wf.from < 0 || wf.dur < 0 {
		return nil, fmt.Errorf("-limit, -from and -duration must not be negative")
	}
	if err := inRange("-speedup", wf.speedup, minSpeedup, maxSpeedup); err != nil {
		return nil, err
	}
	switch wf.format {
	case "", bench.FormatMooncake, bench.FormatAzure, bench.FormatMultiTurn:
	default:
		return nil, fmt.Errorf("unknown -format %q (want mooncake, azure or multiturn)", wf.format)
	}
	var w *bench.Workload
	if wf.format == bench.FormatMultiTurn {
		if wf.mt.Conversations <= 0 || wf.mt.Think < 0 || wf.mt.Turns <= 0 {
			return nil, fmt.Errorf("multiturn: -conversations and -turns must be positive, -think not negative")
		}
		if err := inRange("-rate", wf.mt.Rate, 1e-6, 1e6); err != nil {
			return nil, err
		}
		// The simulator steps through the whole span (a scrape each second).
		if span := float64(wf.mt.Conversations)/wf.mt.Rate + float64(2*wf.mt.Turns)*wf.mt.Think.Seconds(); span > maxMultiTurnSpan.Seconds() {
			return nil, fmt.Errorf("multiturn: -conversations %d at -rate %g with -turns %d and -think %v would span about %.0f days, more than %.0f: raise -rate, or lower -conversations, -turns or -think",
				wf.mt.Conversations, wf.mt.Rate, wf.mt.Turns, wf.mt.Think, span/86400, maxMultiTurnSpan.Hours()/24)
		}
		wf.mt.Seed = wf.seed
		w = bench.GenerateMultiTurn(wf.mt)
	} else {
		if wf.trace == "" {
			return nil, fmt.Errorf("-trace is required (or -format multiturn)")
		}
		var err error
		if w, err = bench.LoadFile(wf.trace, wf.format); err != nil {
			return nil, err
		}
		for _, warn := range w.Warnings {
			fmt.Fprintf(os.Stderr, "kvbench: %s: warning: %s\n", wf.trace, warn)
		}
		w.Name = strings.TrimSuffix(filepath.Base(wf.trace), filepath.Ext(wf.trace))
	}
	if wf.from > 0 || wf.dur > 0 {
		d := wf.dur
		if d <= 0 {
			d = w.Duration() + 1
		}
		w = w.Slice(wf.from, d)
	}
	w = w.ShuffleTies(wf.shuffleTies).SpreadTies(wf.spreadTies).Limit(wf.limit)
	if wf.name != "" {
		w.Name = wf.name
	}
	if len(w.Requests) == 0 {
		return nil, fmt.Errorf("%s: no requests (an empty trace, or a slice or -limit that keeps none)", w.Name)
	}
	if float64(w.Duration())/wf.speedup >= math.MaxInt64 {
		return nil, fmt.Errorf("-speedup %v stretches %s beyond 292 years", wf.speedup, w.Name)
	}
	return w.Scale(wf.speedup), nil
}

// Bounds of -speedup: beyond them arrival times lose their meaning (or
// overflow) long before any use.
const (
	minSpeedup = 1e-3
	maxSpeedup = 1e6
)

// inRange checks that a float flag is a number from lo to hi (NaN and
// infinities are not).
func inRange(flag string, v, lo, hi float64) error {
	if !(v >= lo && v <= hi) {
		return fmt.Errorf("%s %v: want a number from %g to %g", flag, v, lo, hi)
	}
	return nil
}

func runSim(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("kvbench sim", flag.ContinueOnError)
	var wf workloadFlags
	wf.register(fs)
	def := bench.DefaultSimConfig()
	engines := fs.Int("engines", def.Engines, "simulated engines")
	cacheBlocks := fs.Int("cache-blocks", def.CacheBlocks, "KV cache blocks per engine (30000 × 16 tokens ≈ Llama-3.1-8B on an H100)")
	blockSize := fs.Int("block-size", def.BlockSize, "tokens per KV block")
	policies := fs.String("policies", "all", "comma-separated router policies ("+strings.Join(bench.SimPolicies(), ", ")+", "+bench.PolicyKVFixed+"), or all; kv_fixed is kv with calibration off")
	hetero := fs.Float64("hetero", 1, "speed of the second half of the engines (0.5: half the engines at half speed)")
	calibrate := fs.Bool("calibrate", true, "let the kv policy refit its coefficients from observed TTFTs")
	approx := fs.Bool("approximate", false, "route without engine KV events (the router indexes its own decisions)")
	indexTTL := fs.Duration("index-ttl", 0, "with -approximate, how long the router trusts its own decisions (router.index_ttl; 0: its default, 120s)")
	stepOverhead := fs.Duration("step-overhead", 0, "time added to every engine step (scheduling and wake-up of a real engine)")
	hopPerToken := fs.Duration("hop-per-token", 0, "the hop from the router's decision to the engine's queue (the proxy writing the request, the engine parsing it): this much per prompt token (bench/live.sh passes 100ns, with -hop-jitter 4.2ms, as measured on a 2-core machine running the fleet, kvproxy and the client)")
	hopJitter := fs.Duration("hop-jitter", 0, "the hop's random extra, exponentially distributed with this mean (seeded): requests routed together reach an engine in another order, as they do live")
	hostBlocks := fs.Int("host-blocks", 0, "host (CPU) KV tier per engine in blocks (0: none)")
	dupBlocks := fs.Bool("duplicate-blocks", false, "engines keep and report every copy of a block, as vLLM does (a prompt cached whole computes its last block again)")
	scrape := fs.Duration("scrape", time.Second, "feed engine load (waiting, running, KV usage) to the router at this interval, as kvproxy's /metrics scrape does (0: off)")
	replicas := fs.Int("replicas", 1, "kvproxy replicas, each with its own router, taking the requests in turn")
	temperature := fs.Float64("temperature", 0, "the router's temperature: above 0, sample among near-best workers")
	prefillEngines := fs.Int("prefill-engines", 0, "disaggregated prefill: the first N engines only compute prompts, which the others decode (backends[].role: prefill)")
	shareLoad := fs.Duration("share-load", 0, "with -replicas > 1, how often replicas exchange their load, as replicas.nats does (0: never)")
	asJSON := fs.Bool("json", false, "print one JSON object instead of a table")
	ceiling := fs.Bool("ceiling", true, "compute the hit-rate ceiling (one LRU cache of the whole fleet's capacity)")
	plot := fs.String("plot", "", "write PNG charts (TTFT CDF, hit rate) into this directory")
	verbose := fs.Bool("v", false, "print each policy's final per-worker view (fitted kv coefficients) to stderr")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile of the simulation to this file")
	dump := fs.String("dump", "", "write one CSV line per request to this file (one policy only)")
	pin := fs.String("pin", "", "send each request to the engine a -dump file (of replay or sim) names for it: engine index = the worker name's trailing number, which must be below -engines")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	if *engines <= 0 || *cacheBlocks <= 0 || *blockSize <= 0 || *replicas <= 0 {
		return fmt.Errorf("-engines, -cache-blocks, -block-size and -replicas must be positive")
	}
	if *hostBlocks < 0 || *scrape < 0 || *shareLoad < 0 || *stepOverhead < 0 || *indexTTL < 0 || *hopPerToken < 0 || *hopJitter < 0 {
		return fmt.Errorf("-host-blocks, -scrape, -share-load, -step-overhead, -hop-per-token, -hop-jitter and -index-ttl must not be negative")
	}
	if *prefillEngines < 0 || *prefillEngines >= *engines {
		return fmt.Errorf("-prefill-engines must be at least 0 and below -engines")
	}
	if err := inRange("-temperature", *temperature, 0, math.MaxFloat64); err != nil {
		return err
	}
	if err := inRange("-hetero", *hetero, 0.01, 100); err != nil {
		return err
	}
	if *indexTTL > 0 && !*approx {
		return fmt.Errorf("-index-ttl applies to -approximate only (with engine events the index follows the engines)")
	}
	pols := bench.ParsePolicies(*policies)
	if err := bench.CheckPolicies(pols); err != nil {
		return err
	}
	if *dump != "" && len(pols) != 1 {
		return fmt.Errorf("-dump needs exactly one policy")
	}
	// Unwritable outputs fail now, not after the simulation.
	if err := checkOutputs(*dump, *plot); err != nil {
		return err
	}
	w, err := wf.load()
	if err != nil {
		return err
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	cfg := bench.SimConfig{
		Engines: *engines, CacheBlocks: *cacheBlocks, BlockSize: *blockSize,
		Approximate: *approx, IndexTTL: *indexTTL, NoCalibrate: !*calibrate, Seed: wf.seed, Scrape: *scrape,
		HostCacheBlocks: *hostBlocks, DuplicateBlocks: *dupBlocks, StepOverhead: *stepOverhead,
		HopPerToken: *hopPerToken, HopJitter: *hopJitter,
		Replicas: *replicas, ShareLoad: *shareLoad, Temperature: *temperature, PrefillEngines: *prefillEngines,
	}
	if *verbose {
		var mu sync.Mutex
		cfg.Done = func(policy string, ws []router.WorkerStatus) {
			mu.Lock()
			defer mu.Unlock()
			for _, w := range ws {
				fmt.Fprintf(os.Stderr, "%s %s: prefill %.4f ms/token, queue %.4f ms/token (%d TTFT samples), %d indexed blocks\n",
					policy, w.Name, w.PrefillMsPerToken, w.QueueMsPerToken, w.TTFTSamples, w.IndexedBlocks)
			}
		}
	}
	var recs []bench.RequestRecord
	if *dump != "" {
		cfg.OnRequest = func(_ string, r bench.RequestRecord) { recs = append(recs, r) }
	}
	if *pin != "" {
		if cfg.Pin, err = readPins(*pin, len(w.Requests), *engines); err != nil {
			return err
		}
	}
	if *hetero != 1 {
		cfg.Speed = bench.HeteroSpeeds(*engines, *hetero)
	}
	st := w.Stats()
	fmt.Fprintf(os.Stderr, "kvbench sim: %s: %d requests, %d prompt tokens, %d output tokens over %v; %d engines × %d blocks\n",
		w.Name, st.Requests, st.InputTokens, st.OutputTokens, st.Duration.Round(time.Second), *engines, *cacheBlocks)

	ceil := make(chan float64, 1)
	if *ceiling {
		go func() {
			ceil <- bench.CeilingHitRate(w, bench.Synth{Seed: wf.seed}, *blockSize, *engines**cacheBlocks, *cacheBlocks)
		}()
	}
	start := time.Now()
	results, err := bench.SimulateAll(w, cfg, pols)
	if err != nil {
		return err
	}
	rep := bench.Report{Results: results}
	if *ceiling {
		c := <-ceil
		rep.CeilingHitRate = &c
	}
	fmt.Fprintf(os.Stderr, "kvbench sim: %d policies in %v\n", len(pols), time.Since(start).Round(time.Millisecond))
	var allFailed []string
	for _, res := range results {
		reportErrors(os.Stderr, "kvbench sim: "+res.Policy, res, len(w.Requests))
		if res.Errors == len(w.Requests) {
			allFailed = append(allFailed, res.Policy)
		}
	}
	if err := writeResults(stdout, &rep, *asJSON, *dump, recs, *plot, w.Name); err != nil {
		return err
	}
	if len(allFailed) > 0 {
		return fmt.Errorf("every request failed (%s)", strings.Join(allFailed, ", "))
	}
	return nil
}

// writeResults prints the report, then writes the -dump file and the
// charts: a finished run's numbers are out before a file can fail.
func writeResults(stdout io.Writer, rep *bench.Report, asJSON bool, dump string, recs []bench.RequestRecord, plot, name string) error {
	var err error
	if asJSON {
		err = rep.WriteJSON(stdout)
	} else {
		err = rep.WriteTable(stdout)
	}
	if dump != "" {
		err = errors.Join(err, writeDump(dump, recs))
	}
	if plot != "" {
		err = errors.Join(err, bench.WriteCharts(plot, name, rep))
	}
	return err
}

func runReplay(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("kvbench replay", flag.ContinueOnError)
	var wf workloadFlags
	wf.register(fs)
	url := fs.String("url", "http://127.0.0.1:8080", "kvproxy base URL (an OpenAI base URL ending in /v1 is fine too)")
	model := fs.String("model", "", "model name sent in requests (default: the first the proxy's /v1/models lists)")
	key := fs.String("api-key", os.Getenv("KVBENCH_API_KEY"), "API key (default $KVBENCH_API_KEY)")
	mode := fs.String("mode", bench.ModeCompletions, "completions (token ids: the trace's lengths exactly) or chat (text messages, one word per token; see -words)")
	words := fs.String("words", "cl100k_base", "chat mode: write each token as a word the engine's tokenizer (a built-in name or a tokenizer.json path) reads as one token, so prompts keep the trace's lengths; \"\": made-up words, which cl100k splits into about 2.3× as many tokens")
	conc := fs.Int("concurrency", 0, "closed loop with N requests in flight (0: open loop at trace times / speedup)")
	label := fs.String("label", "live", "policy column of the report")
	timeScale := fs.Float64("time-scale", 1, "engines run this many times faster than real time (kvmock -speedup): report durations × this, throughput ÷ this")
	timeout := fs.Duration("timeout", 10*time.Minute, "per-request timeout")
	asJSON := fs.Bool("json", false, "print one JSON object instead of a table")
	plot := fs.String("plot", "", "write PNG charts (TTFT CDF, hit rate) into this directory")
	dump := fs.String("dump", "", "write one CSV line per request (worker from the x-kvproxy-worker header) to this file")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	*url = proxyBase(*url)
	if !strings.HasPrefix(*url, "http://") && !strings.HasPrefix(*url, "https://") {
		return fmt.Errorf("-url %q: want http://host:port (or https://)", *url)
	}
	if *conc < 0 {
		return fmt.Errorf("-concurrency %d: want 0 (open loop) or more", *conc)
	}
	if err := inRange("-time-scale", *timeScale, 1e-6, 1e6); err != nil {
		return err
	}
	if err := checkOutputs(*dump, *plot); err != nil {
		return err
	}
	w, err := wf.load()
	if err != nil {
		return err
	}
	var wordList []string
	if *mode == bench.ModeChat && *words != "" {
		tok, err := tokenize.Load(*words)
		if err != nil {
			return fmt.Errorf("-words: %w", err)
		}
		wordList = bench.SingleTokenWords(tok)
	}
	var recs []bench.RequestRecord
	onReq := func(r bench.RequestRecord) { recs = append(recs, r) }
	if *model == "" {
		if *model, err = firstModel(*url, *key); err != nil {
			return err
		}
	}
	ctx, stop := cancelOnSignal()
	defer stop()
	st := w.Stats()
	fmt.Fprintf(os.Stderr, "kvbench replay: %s: %d requests over %v to %s\n", w.Name, st.Requests, st.Duration.Round(time.Second), *url)
	started := time.Now()
	res, err := bench.Replay(ctx, w, bench.ReplayConfig{
		URL: *url, Model: *model, APIKey: *key, Mode: *mode, Words: wordList, Concurrency: *conc,
		Synth: bench.Synth{Seed: wf.seed}, Timeout: *timeout, OnRequest: onReq,
	}, *label)
	if err != nil && ctx.Err() == nil {
		return err
	}
	reportErrors(os.Stderr, "kvbench replay", res, len(recs))
	res.ScaleTime(*timeScale)
	rep := bench.Report{Results: []bench.Result{res}}
	err = writeResults(stdout, &rep, *asJSON, *dump, recs, *plot, w.Name+"-"+*label)
	var ie *interruptedError
	if errors.As(context.Cause(ctx), &ie) {
		ie.msg = fmt.Sprintf("replay interrupted (%v) after %v: %d requests cut off in flight (not counted as errors; their TTFTs count when they had one), %d of %d never sent",
			ie.sig, time.Since(started).Round(time.Millisecond), res.Interrupted, len(w.Requests)-len(recs), len(w.Requests))
		return errors.Join(err, ie)
	}
	if err == nil && res.Errors == len(w.Requests) {
		err = fmt.Errorf("every request failed")
	}
	return err
}

// parseFlags parses args; -h prints the flags to stdout (it is asked for,
// not an error), and a bad flag is an error saying where the flags are.
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) error {
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	if errors.Is(err, flag.ErrHelp) {
		fs.SetOutput(stdout)
		fmt.Fprintf(stdout, "Usage of %s:\n", fs.Name())
		fs.PrintDefaults()
		return err
	}
	if err != nil {
		return fmt.Errorf("%w (%s -h lists the flags)", err, fs.Name())
	}
	if fs.NArg() > 0 {
		// Flag parsing stops there: the flags after it were ignored, and
		// the run went on without them (found by the planner's trial).
		return fmt.Errorf("unexpected argument %q: every argument is a flag (%s -h lists them)", fs.Arg(0), fs.Name())
	}
	return nil
}

// proxyBase is the proxy's base URL without a trailing slash, or /v1:
// an OpenAI client's base URL (http://host:8080/v1) names the same proxy.
func proxyBase(u string) string {
	u = strings.TrimRight(u, "/")
	return strings.TrimRight(strings.TrimSuffix(u, "/v1"), "/")
}

// firstModel is the first model a proxy's GET /v1/models lists.
func firstModel(url, key string) (string, error) {
	req, err := http.NewRequest(http.MethodGet, strings.TrimSuffix(url, "/")+"/v1/models", nil)
	if err != nil {
		return "", err
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		return "", fmt.Errorf("no -model given, and the proxy's model list: %w", err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || resp.StatusCode != http.StatusOK || len(list.Data) == 0 {
		return "", fmt.Errorf("no -model given, and %s/v1/models answered %s with no model", url, resp.Status)
	}
	return list.Data[0].ID, nil
}

// reportErrors tells how many of a run's requests failed, by reason, with
// the most common reasons first.
func reportErrors(out io.Writer, prefix string, res bench.Result, total int) {
	if res.Errors == 0 {
		return
	}
	count := res.ErrorReasons
	reasons := make([]string, 0, len(count))
	for e := range count {
		reasons = append(reasons, e)
	}
	slices.SortFunc(reasons, func(a, b string) int {
		if c := count[b] - count[a]; c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	fmt.Fprintf(out, "%s: %d of %d requests failed:\n", prefix, res.Errors, total)
	for i, e := range reasons {
		if i == 5 {
			fmt.Fprintf(out, "  ... and %d other reasons\n", len(reasons)-i)
			break
		}
		fmt.Fprintf(out, "  %d × %s\n", count[e], e)
	}
}

// checkOutputs fails early when a -dump file or -plot directory cannot be
// written.
func checkOutputs(dump, plot string) error {
	if dump != "" {
		_, statErr := os.Stat(dump)
		f, err := os.OpenFile(dump, os.O_WRONLY|os.O_CREATE, 0o644)
		if err != nil {
			return err
		}
		f.Close()
		if errors.Is(statErr, os.ErrNotExist) {
			os.Remove(dump) // no empty file left behind if the run fails
		}
	}
	if plot != "" {
		if err := os.MkdirAll(plot, 0o755); err != nil {
			return err
		}
		f, err := os.CreateTemp(plot, ".kvbench-*")
		if err != nil {
			return err
		}
		f.Close()
		os.Remove(f.Name())
	}
	return nil
}

// writeDump writes per-request records, sorted by request index.
func writeDump(path string, recs []bench.RequestRecord) error {
	slices.SortFunc(recs, func(a, b bench.RequestRecord) int { return a.Index - b.Index })
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := bench.WriteRecords(f, recs); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// readPins reads a -dump file's assignment: for request i, the trailing
// number of its worker's name (-1 where unknown). A number that names no
// engine of the fleet is an error.
func readPins(path string, n, engines int) ([]int, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	pins := make([]int, n)
	for i := range pins {
		pins[i] = -1
	}
	cr := csv.NewReader(f)
	for first := true; ; first = false {
		row, err := cr.Read()
		if err == io.EOF {
			return pins, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if first {
			continue // the header
		}
		line, _ := cr.FieldPos(0)
		if len(row) < 4 {
			return nil, fmt.Errorf("%s line %d: short line %q", path, line, row)
		}
		i, err := strconv.Atoi(row[0])
		if err != nil || i < 0 || i >= n {
			return nil, fmt.Errorf("%s line %d: bad request index %q", path, line, row[0])
		}
		name := row[3]
		k := len(name)
		for k > 0 && name[k-1] >= '0' && name[k-1] <= '9' {
			k--
		}
		if e, err := strconv.Atoi(name[k:]); err == nil {
			if e >= engines {
				return nil, fmt.Errorf("%s line %d: worker %q is engine %d, and the fleet has %d (-engines)", path, line, name, e, engines)
			}
			pins[i] = e
		}
	}
}
