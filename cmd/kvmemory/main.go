// Command kvmemory measures kvproxy's memory relaying large non-streamed
// answers, by limits.body_memory_mb:
//
//	go run ./cmd/kvmemory                                  # builds kvproxy itself
//	go run ./cmd/kvmemory -budgets default,256,128 -gomemlimit 1GiB
//
// It serves one engine of its own on loopback that answers every
// completion with -answer-mb MiB of JSON, its length declared, and for
// each budget starts a kvproxy in front of it and sends -rounds rounds of
// -clients concurrent requests. It reports kvproxy's peak RSS (VmHWM, from
// /proc: Linux only) and the statuses its clients got: 200, or 503
// body_memory_full when others held the budget.
//
// A budget is a number of MiB, or "default" for the setting left out:
// 1024, or under -gomemlimit (GOMEMLIMIT in kvproxy's environment, as a
// container's memory limit sets it) a quarter of that limit.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "kvmemory:", err)
		os.Exit(1)
	}
}

// options are the command's flags.
type options struct {
	kvproxy    string
	budgets    []string // MiB, or "default"
	gomemlimit string
	answerMB   int
	clients    int
	rounds     int
	answerWait float64 // seconds the engine waits between an answer's headers and its body
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	fs := flag.NewFlagSet("kvmemory", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	budgets := fs.String("budgets", "default,256,128", "limits.body_memory_mb values to run, comma-separated: MiB, or default (the setting left out)")
	fs.StringVar(&o.kvproxy, "kvproxy", "", "kvproxy binary (default: go build ./cmd/kvproxy, from the repository)")
	fs.StringVar(&o.gomemlimit, "gomemlimit", "", "GOMEMLIMIT for kvproxy (e.g. 1GiB): a container's memory limit does the same")
	fs.IntVar(&o.answerMB, "answer-mb", 50, "size of each answer, MiB (kvproxy reads whole answers up to 64 MiB)")
	fs.IntVar(&o.clients, "clients", 8, "concurrent clients")
	fs.IntVar(&o.rounds, "rounds", 3, "rounds of -clients requests")
	fs.Float64Var(&o.answerWait, "answer-wait", 0.2, "seconds the engine waits between an answer's headers and its body, so that the clients' answers overlap")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	for b := range strings.SplitSeq(*budgets, ",") {
		if b = strings.TrimSpace(b); b != "" {
			o.budgets = append(o.budgets, b)
		}
	}
	switch {
	case len(o.budgets) == 0:
		return o, errors.New("-budgets: none given")
	case o.answerMB < 2 || o.answerMB > 64:
		return o, errors.New("-answer-mb: want 2 to 64 (smaller answers are not budgeted, larger ones refused)")
	case o.clients < 1 || o.rounds < 1:
		return o, errors.New("-clients and -rounds must be positive")
	}
	for _, b := range o.budgets {
		if _, err := budgetLine(b); err != nil {
			return o, err
		}
	}
	return o, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	bin := o.kvproxy
	if bin == "" {
		dir, err := os.MkdirTemp("", "kvmemory")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		if bin, err = buildKVProxy(ctx, dir); err != nil {
			return err
		}
	}
	eng, err := startEngine(o.answerMB<<20, o.answerWait)
	if err != nil {
		return err
	}
	defer eng.close()
	var rows []row
	for _, b := range o.budgets {
		r, err := measure(ctx, bin, eng.addr, b, o)
		if err != nil {
			return fmt.Errorf("budget %s: %w", b, err)
		}
		fmt.Fprintf(stderr, "kvmemory: budget %s: peak RSS %d MB, %s\n", b, r.peakRSS/1e6, r.statuses())
		rows = append(rows, r)
	}
	writeTable(stdout, o, rows)
	return nil
}
