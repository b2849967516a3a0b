package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
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
	for _, args := range [][]string{
		{"-trace", filepath.Join(t.TempDir(), "missing.jsonl")},
		{"-format", "multiturn", "-speedup", "0"},
		{"-format", "multiturn", "-policies", "nope"},
		{},
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
}
