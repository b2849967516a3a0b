package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kvproxy/kvproxy/bench"
)

var smallSim = []string{"-format", "multiturn", "-conversations", "20", "-system-len", "300",
	"-user-len", "60", "-output-len", "20", "-rate", "5", "-think", "2s",
	"-engines", "3", "-cache-blocks", "1000", "-speedup", "1"}

func TestSimJSONIsReproducible(t *testing.T) {
	run := func() []byte {
		var out bytes.Buffer
		args := append(append([]string(nil), smallSim...), "-json", "-policies", "kv,round_robin,kv_fixed")
		if err := runSim(args, &out); err != nil {
			t.Fatal(err)
		}
		return out.Bytes()
	}
	a, b := run(), run()
	if !bytes.Equal(a, b) {
		t.Fatalf("same flags, different output:\n%s\n%s", a, b)
	}
	var rep struct {
		Results []struct {
			Policy  string  `json:"policy"`
			TTFTP90 float64 `json:"ttft_p90_ms"`
			HitRate float64 `json:"hit_rate"`
			Errors  int     `json:"errors"`
		} `json:"results"`
		Ceiling float64 `json:"ceiling_hit_rate"`
	}
	if err := json.Unmarshal(a, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 3 || rep.Results[0].Policy != "kv" || rep.Results[2].Policy != "kv_fixed" {
		t.Fatalf("results: %+v", rep.Results)
	}
	for _, r := range rep.Results {
		if r.Errors != 0 || r.TTFTP90 <= 0 || r.HitRate > rep.Ceiling+1e-9 {
			t.Fatalf("%+v (ceiling %v)", r, rep.Ceiling)
		}
	}
}

func TestSimTableAndCharts(t *testing.T) {
	dir := t.TempDir()
	var out bytes.Buffer
	args := append(append([]string(nil), smallSim...), "-policies", "least_load", "-hetero", "0.5", "-plot", dir)
	if err := runSim(args, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "least_load") || !strings.Contains(out.String(), "ceiling") {
		t.Fatalf("table: %s", out.String())
	}
	for _, f := range []string{"multiturn-ttft-cdf.png", "multiturn-hit-rate.png"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Fatalf("%s: %v", f, err)
		}
	}
}

func TestSimRejectsBadFlags(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "empty.jsonl")
	os.WriteFile(empty, []byte("\n\n"), 0o644)
	for _, args := range [][]string{
		{"-trace", filepath.Join(t.TempDir(), "missing.jsonl")},
		{"-format", "multiturn", "-speedup", "0"},
		{"-format", "multiturn", "-policies", "nope"},
		{"-format", "multiturn", "-policies", ","},
		{"-format", "multiturn", "-policies", "kv,kv"},
		{"-format", "json", "-trace", "x.jsonl"},
		{"-format", "multiturn", "-index-ttl", "40s"},
		{"-format", "multiturn", "-block-size", "0"},
		{"-format", "multiturn", "-engines", "-3"},
		{"-format", "multiturn", "-cache-blocks", "0"},
		{"-format", "multiturn", "-replicas", "0"},
		{"-format", "multiturn", "-rate", "0"},
		{"-format", "multiturn", "-rate", "NaN"},
		{"-format", "multiturn", "-speedup", "NaN"},
		{"-format", "multiturn", "-speedup", "1e-300"},
		{"-format", "multiturn", "-speedup", "Inf"},
		{"-format", "multiturn", "-hetero", "Inf"},
		{"-format", "multiturn", "-hetero", "1e-9"},
		{"-format", "multiturn", "-hetero", "NaN"},
		{"-format", "multiturn", "-temperature", "NaN"},
		{"-format", "multiturn", "-think", "-10s"},
		{"-format", "multiturn", "-conversations", "0"},
		{"-format", "multiturn", "-limit", "-5"},
		{"-format", "multiturn", "-from", "10h"}, // keeps no request
		{"-format", "multiturn", "-dump", filepath.Join(t.TempDir(), "no", "such", "dir", "d.csv"), "-policies", "kv"},
		{"-trace", empty},
		{},
		{"-format", "multiturn", "stray", "-policies", "kv"}, // the flags after it were dropped
		{"-format", "multiturn", "-prefill-engines", "8"},
		{"-format", "multiturn", "-hop-per-token", "-1ns"},
		{"-format", "multiturn", "-hop-jitter", "-2ms"},
	} {
		if err := runSim(args, &bytes.Buffer{}); err == nil {
			t.Errorf("kvbench sim %v succeeded", args)
		}
	}
}

// A sim's -dump, fed back with -pin, reproduces the run; -dump takes one
// policy only.
func TestSimDumpAndPin(t *testing.T) {
	dir := t.TempDir()
	dump := filepath.Join(dir, "rr.csv")
	run := func(extra ...string) []byte {
		var out bytes.Buffer
		args := append(append([]string(nil), smallSim...), append([]string{"-json", "-policies", "round_robin", "-ceiling=false"}, extra...)...)
		if err := runSim(args, &out); err != nil {
			t.Fatal(err)
		}
		return out.Bytes()
	}
	a := run("-dump", dump)
	b, err := os.ReadFile(dump)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if lines[0] != bench.DumpHeader || len(lines) < 20 || !strings.HasPrefix(lines[1], "0,") || !strings.Contains(lines[1], ",engine-") {
		t.Fatalf("dump:\n%s", b)
	}
	if again := run("-pin", dump); !bytes.Equal(a, again) {
		t.Fatalf("pinned to its own dump, the run differs:\n%s\n%s", a, again)
	}
	args := append(append([]string(nil), smallSim...), "-policies", "kv,round_robin", "-dump", dump)
	if err := runSim(args, io.Discard); err == nil {
		t.Fatal("-dump with two policies accepted")
	}
	// The dump names engines 0-2; a fleet of 2 has no engine-2.
	badLine := 0
	for n, l := range lines {
		if strings.Contains(l, ",engine-2,") {
			badLine = n + 1
			break
		}
	}
	args = append(append([]string(nil), smallSim...), "-policies", "round_robin", "-engines", "2", "-pin", dump)
	if err := runSim(args, io.Discard); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("line %d: worker \"engine-2\" is engine 2, and the fleet has 2", badLine)) {
		t.Fatalf("a pin to engine 2 of 2 (line %d): %v", badLine, err)
	}
}

// Replay refuses flags it cannot honour, before sending anything.
func TestReplayRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-speedup", "NaN"},
		{"-speedup", "1e-300"},
		{"-time-scale", "0"},
		{"-time-scale", "-2"},
		{"-time-scale", "NaN"},
		{"-concurrency", "-3"},
		{"-url", "127.0.0.1:1"}, // no scheme: said so, not Go's URL parser's words
		{"stray"},
	} {
		args = append([]string{"-url", "http://127.0.0.1:1", "-model", "m", "-format", "multiturn", "-conversations", "2"}, args...)
		if err := runReplay(args, io.Discard); err == nil || strings.Contains(err.Error(), "every request failed") {
			t.Errorf("kvbench replay %v: %v", args, err)
		}
	}
}

// A replay where every request fails says so and exits non-zero; the
// reasons are counted (reportErrors).
func TestReplayEveryRequestFailed(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there now
	if _, err := firstModel(url, ""); err == nil {
		t.Fatal("a model from a proxy that is not there")
	}
	args := []string{"-url", url, "-model", "m", "-format", "multiturn", "-conversations", "3", "-limit", "3", "-speedup", "1000", "-timeout", "2s"}
	if err := runReplay(args, io.Discard); err == nil || !strings.Contains(err.Error(), "every request failed") {
		t.Fatalf("replay against nothing: %v", err)
	}
	var out bytes.Buffer
	reportErrors(&out, "kvbench replay", bench.Result{Errors: 3, ErrorReasons: map[string]int{"refused": 1, "status 404": 2}}, 4)
	if !strings.Contains(out.String(), "kvbench replay: 3 of 4 requests failed:\n  2 × status 404\n  1 × refused\n") {
		t.Fatalf("%q", out.String())
	}
}

// Without -model, replay sends the first model the proxy lists.
func TestReplayAsksTheProxyForAModel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" || r.Header.Get("Authorization") != "Bearer k" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(`{"object":"list","data":[{"id":"llama-3.1-8b-instruct","object":"model"},{"id":"llama","object":"model"}]}`))
	}))
	defer srv.Close()
	if m, err := firstModel(srv.URL+"/", "k"); err != nil || m != "llama-3.1-8b-instruct" {
		t.Fatalf("%q %v", m, err)
	}
	if _, err := firstModel(srv.URL, "wrong"); err == nil {
		t.Fatal("a model from a 404")
	}
}

// A -name holding a path still gets its charts, named with '_' for '/',
// and the table is printed whatever becomes of the files.
func TestSimNameWithASlash(t *testing.T) {
	dir := t.TempDir()
	var out bytes.Buffer
	args := append(append([]string(nil), smallSim...), "-policies", "round_robin", "-name", "p/run", "-plot", dir)
	if err := runSim(args, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "round_robin") {
		t.Fatalf("table: %s", out.String())
	}
	for _, f := range []string{"p_run-ttft-cdf.png", "p_run-hit-rate.png"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Fatalf("%s: %v", f, err)
		}
	}
}

// A chart that cannot be written is reported after the table.
func TestSimPrintsResultsBeforeCharts(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "x-ttft-cdf.png"), 0o755); err != nil { // in the way of the chart
		t.Fatal(err)
	}
	var out bytes.Buffer
	args := append(append([]string(nil), smallSim...), "-policies", "round_robin", "-name", "x", "-plot", dir)
	if err := runSim(args, &out); err == nil {
		t.Fatal("no error for a chart that cannot be written")
	}
	if !strings.Contains(out.String(), "round_robin") {
		t.Fatalf("no table before the error: %q", out.String())
	}
}

// A run that fails before its results leaves no empty -dump file behind.
func TestFailedRunLeavesNoDumpFile(t *testing.T) {
	dir := t.TempDir()
	dump := filepath.Join(dir, "d.csv")
	if err := runSim([]string{"-trace", filepath.Join(dir, "missing.jsonl"), "-policies", "kv", "-dump", dump}, io.Discard); err == nil {
		t.Fatal("no error for a missing trace")
	}
	if _, err := os.Stat(dump); !os.IsNotExist(err) {
		t.Fatalf("dump file left behind: %v", err)
	}
}

// captureStderr runs f with os.Stderr going to a buffer, and returns it.
func captureStderr(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	saved := os.Stderr
	os.Stderr = w
	done := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(r)
		done <- b
	}()
	defer func() {
		os.Stderr = saved
	}()
	f()
	w.Close()
	return string(<-done)
}

// writeTrace writes Mooncake lines into a trace file in t's temp dir.
func writeTrace(t *testing.T, lines ...string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "t.jsonl")
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// sim names why requests failed, dumps them with their reason, and fails
// when every request failed.
func TestSimReportsFailures(t *testing.T) {
	trace := writeTrace(t,
		`{"timestamp":0,"input_length":100,"output_length":5,"hash_ids":[1]}`,
		`{"timestamp":1000,"input_length":20000,"output_length":5,"hash_ids":[1]}`,
		`{"timestamp":2000,"input_length":200,"output_length":5,"hash_ids":[1]}`,
		`{"timestamp":3000,"input_length":30000,"output_length":5,"hash_ids":[1]}`)
	dump := filepath.Join(t.TempDir(), "d.csv")
	base := []string{"-trace", trace, "-speedup", "1", "-engines", "2", "-policies", "round_robin", "-ceiling=false"}
	var out bytes.Buffer
	var err error
	stderr := captureStderr(t, func() {
		err = runSim(append(append([]string(nil), base...), "-cache-blocks", "1000", "-dump", dump), &out)
	})
	if err != nil {
		t.Fatal(err)
	}
	// One reason for prompts of any length: the failures group.
	if !strings.Contains(stderr, "round_robin: 2 of 4 requests failed:\n  2 × prompt and output exceed an engine's KV cache") {
		t.Fatalf("stderr: %s", stderr)
	}
	b, _ := os.ReadFile(dump)
	if lines := strings.Split(strings.TrimSpace(string(b)), "\n"); len(lines) != 5 || !strings.HasPrefix(lines[2], "1,") || !strings.Contains(lines[2], "exceed an engine's KV cache") {
		t.Fatalf("dump:\n%s", b)
	}
	out.Reset()
	captureStderr(t, func() { err = runSim(append(append([]string(nil), base...), "-cache-blocks", "1"), &out) })
	if err == nil || !strings.Contains(err.Error(), "every request failed") || !strings.Contains(out.String(), "round_robin") {
		t.Fatalf("all failed: %v, table %q", err, out.String())
	}
}

// -h prints every flag to stdout, as kvbench -h does; the policies' help
// names them.
func TestHelpGoesToStdout(t *testing.T) {
	for name, run := range map[string]func([]string, io.Writer) error{"sim": runSim, "replay": runReplay} {
		var out bytes.Buffer
		if err := run([]string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "-speedup") {
			t.Fatalf("%s -h: %v, %q", name, err, out.String())
		}
	}
	var out bytes.Buffer
	runSim([]string{"-h"}, &out)
	if !strings.Contains(out.String(), "round_robin") || !strings.Contains(out.String(), "use 1 for your own trace") {
		t.Fatalf("sim -h: %s", out.String())
	}
	if err := runSim([]string{"-nope"}, &out); err == nil || !strings.Contains(err.Error(), "kvbench sim -h lists the flags") {
		t.Fatalf("bad flag: %v", err)
	}
}

// An OpenAI base URL (ending in /v1) reaches the same endpoints as the
// proxy's base URL.
func TestReplayTakesAnOpenAIBaseURL(t *testing.T) {
	var paths []string
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths = append(paths, r.URL.Path)
		mu.Unlock()
		switch r.URL.Path {
		case "/v1/models":
			w.Write([]byte(`{"data":[{"id":"m"}]}`))
		case "/v1/completions":
			w.Write([]byte("data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: [DONE]\n\n"))
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	args := []string{"-url", srv.URL + "/v1/", "-format", "multiturn", "-conversations", "2", "-limit", "2", "-concurrency", "1"}
	var out bytes.Buffer
	if err := runReplay(args, &out); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(paths) != 3 || paths[0] != "/v1/models" || paths[1] != "/v1/completions" {
		t.Fatalf("paths %v", paths)
	}
}

// A generated workload too long to simulate is refused before it is built:
// its arrival times overflowed, and the simulator stepped through years.
func TestMultiTurnSpanIsBounded(t *testing.T) {
	var out bytes.Buffer
	err := runSim([]string{"-format", "multiturn", "-rate", "1e-6", "-conversations", "20000", "-turns", "1", "-policies", "round_robin"}, &out)
	if err == nil || !strings.Contains(err.Error(), "days") {
		t.Fatalf("a workload of 20000 conversations at 1e-6 per second: %v", err)
	}
}
