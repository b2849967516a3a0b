package main

import (
	"bytes"
	"context"
	"io"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// kvmemory runs real kvproxy processes: under a 400 MiB memory limit the
// default budget is 100 MiB and every answer passes; a 3 MiB budget takes
// one 2 MiB answer at a time, and the clients of the others, whose answers
// came at the same time, get 503 body_memory_full.
func TestKVMemoryMeasuresBudgets(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs kvproxy")
	}
	bin := filepath.Join(t.TempDir(), "kvproxy")
	if out, err := exec.Command("go", "build", "-o", bin, "../kvproxy").CombinedOutput(); err != nil {
		t.Fatalf("building kvproxy: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, log bytes.Buffer
	err := run(ctx, []string{"-kvproxy", bin, "-budgets", "default,3", "-gomemlimit", "400MiB",
		"-answer-mb", "2", "-clients", "4", "-rounds", "1", "-answer-wait", "1"}, &out, &log)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	rows := map[string]string{} // the first cell: the row
	for line := range strings.SplitSeq(out.String(), "\n") {
		if cells := strings.Split(line, " | "); len(cells) == 3 {
			rows[strings.TrimPrefix(cells[0], "| ")] = line
		}
	}
	def, small := rows["default (100)"], rows["3"]
	hasRSS := regexp.MustCompile(`\| [1-9][0-9,]* MB \|`)
	if !strings.HasSuffix(def, "| 4 × 200 |") || !hasRSS.MatchString(def) ||
		!strings.Contains(small, " × 503 body_memory_full") || !strings.Contains(small, " × 200") || !hasRSS.MatchString(small) {
		t.Fatalf("table:\n%s\nlog:\n%s", out.String(), log.String())
	}
}

func TestParseVmHWM(t *testing.T) {
	n, err := parseVmHWM(strings.NewReader("Name:\tkvproxy\nVmPeak:\t  900 kB\nVmHWM:\t   1024 kB\nVmRSS:\t 512 kB\n"))
	if err != nil || n != 1<<20 {
		t.Fatalf("%d %v, want 1 MiB", n, err)
	}
	if _, err := parseVmHWM(strings.NewReader("Name:\tx\n")); err == nil {
		t.Fatal("no error without the line")
	}
}

func TestFlagsRefuseNonsense(t *testing.T) {
	for _, args := range [][]string{{"-budgets", "lots"}, {"-budgets", ","}, {"-answer-mb", "1"}, {"-answer-mb", "65"}, {"-clients", "0"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}
