// Command kvoverhead measures what kvproxy adds to a request, on this
// machine and over loopback, against talking to the engine directly and
// against nginx as a plain reverse proxy:
//
//	go run ./cmd/kvoverhead                      # builds kvproxy and kvmock itself
//	go run ./cmd/kvoverhead -rounds 5 -duration 1s -json -png docs/img/overhead.png
//
// It starts one simulated engine (kvmock, fast: -speedup 1000 by default, with vLLM-format
// KV events over ZMQ), kvproxy in front of it (one vllm backend with the
// engine's event feed, policy kv, log_level warn) and nginx in front of it
// (proxy_pass to an upstream with keepalive 64, proxy_buffering off, access
// log off), then runs, for each concurrency of -conc:
//
//   - chat: non-streaming chat completions with max_tokens 1: requests/s,
//     p50/p99 latency, latency added over direct, proxy CPU per request;
//   - stream: SSE chat streams of -stream-tokens tokens (ignore_eos): time to
//     first event p50/p99, events/s, proxy CPU seconds per relayed event.
//
// Every cell is run against direct, kvproxy and nginx one after the other,
// the order rotating each round, for -rounds rounds of -duration each, so
// machine noise falls on all three alike. Latency percentiles and CPU are
// taken over the samples of all rounds pooled; throughput is the median of
// the rounds' rates.
// CPU is utime+stime from /proc/PID/stat of the kvproxy process and of the
// nginx master and workers, read before and after each cell.
//
// The fasthttp column (-floor, on by default) is the floor of kvproxy's
// stack: a plain fasthttp reverse proxy with no parsing, routing, metrics or
// logging, this binary run again as "kvoverhead floor-proxy LISTEN ENGINE".
// kvproxy/fasthttp is what kvproxy's own work costs; fasthttp/nginx is what
// Go's runtime and fasthttp cost against nginx's event loop.
//
// The eventloop column (-eventloop) is Go with nginx's I/O model: a minimal
// HTTP relay on one epoll loop per core, edge-triggered, no goroutine per
// connection (this binary run again as "kvoverhead eventloop-proxy LISTEN
// ENGINE", Linux only). eventloop/nginx is what Go itself costs against C
// when the runtime's netpoller and scheduler are out of the way.
//
// With -kvproxy2 PATH a second kvproxy build runs alongside as one more
// configuration (column kvproxy2, ratio kvproxy2/kvproxy): the way to A/B a
// change of the hot path under the same noise.
//
// nginx is optional: with none found (-nginx, else nginx on PATH) the nginx
// column is skipped with a message. To install it on Debian or Ubuntu:
//
//	apt-get update -qq && apt-get install -y -qq nginx-light   # or: nginx
//
// nginx runs in the foreground as the current user with its config, pid, logs
// and temp files in a temporary directory; nothing of the system install is
// used but the binary. It gets 2 worker processes when the machine has 2 or
// more cores (as many as cores, up to -nginx-workers), because kvproxy's Go
// runtime uses every core (GOMAXPROCS = cores): both proxies may use the same
// CPUs.
//
// Linux only (it reads /proc). Run it from the repository when it builds the
// binaries; -kvproxy and -kvmock take prebuilt ones.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) == 4 && (os.Args[1] == floorCommand || os.Args[1] == eventLoopCommand) {
		serve := serveFloor
		if os.Args[1] == eventLoopCommand {
			serve = serveEventLoop
		}
		if err := serve(os.Args[2], os.Args[3]); err != nil {
			fmt.Fprintln(os.Stderr, "kvoverhead "+os.Args[1]+":", err)
			os.Exit(1)
		}
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "kvoverhead:", err)
		os.Exit(1)
	}
}

// options are the command's flags.
type options struct {
	kvproxy, kvmock, nginx string
	kvproxy2               string
	nginxWorkers           int
	floor, eventLoop       bool
	rounds                 int
	duration               time.Duration
	conc                   []int
	workloads              []string
	streamTokens           int
	speedup                float64
	json                   bool
	png                    string
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("kvoverhead", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.kvproxy, "kvproxy", "", "kvproxy binary (default: go build ./cmd/kvproxy into a temp dir)")
	fs.StringVar(&o.kvproxy2, "kvproxy2", "", "a second kvproxy binary to compare with the first (A/B of a change), run alongside as column kvproxy2")
	fs.StringVar(&o.kvmock, "kvmock", "", "kvmock binary (default: go build ./cmd/kvmock into a temp dir)")
	fs.StringVar(&o.nginx, "nginx", "", "nginx binary (default: nginx on PATH; none: the nginx column is skipped)")
	fs.BoolVar(&o.floor, "floor", true, "also measure the floor of kvproxy's stack: a plain fasthttp reverse proxy with no logic (column fasthttp), this binary run again")
	fs.BoolVar(&o.eventLoop, "eventloop", false, "also measure Go with nginx's I/O model: a minimal HTTP relay on its own epoll loops, no goroutine per connection (column eventloop; Linux only), this binary run again")
	fs.IntVar(&o.nginxWorkers, "nginx-workers", 2, "nginx worker_processes at most (capped at the number of cores)")
	fs.IntVar(&o.rounds, "rounds", 5, "rounds; each runs every cell once against every configuration")
	fs.DurationVar(&o.duration, "duration", time.Second, "length of one cell (one workload, concurrency and configuration) per round")
	conc := fs.String("conc", "1,16,64", "comma-separated concurrencies")
	wl := fs.String("workloads", "chat,stream", "comma-separated workloads: chat, stream")
	fs.IntVar(&o.streamTokens, "stream-tokens", 64, "max_tokens of each streamed request (ignore_eos)")
	fs.Float64Var(&o.speedup, "speedup", 1000, "kvmock -speedup: engine steps take 1/speedup of a real engine's (1000: the engine is far faster than any proxy; ~10: one event per stream per write, as a busy real engine sends)")
	fs.BoolVar(&o.json, "json", false, "print one JSON object instead of the table")
	fs.StringVar(&o.png, "png", "", "also draw a bar chart of the ratios to this PNG file")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	for _, s := range strings.Split(*conc, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return o, fmt.Errorf("-conc value %q: want a positive integer", s)
		}
		o.conc = append(o.conc, n)
	}
	for _, w := range strings.Split(*wl, ",") {
		if w = strings.TrimSpace(w); w != chat && w != stream {
			return o, fmt.Errorf("-workloads value %q: want chat or stream", w)
		}
		o.workloads = append(o.workloads, strings.TrimSpace(w))
	}
	if o.rounds < 1 || o.duration <= 0 || o.streamTokens < 1 || o.nginxWorkers < 1 || o.speedup <= 0 {
		return o, errors.New("-rounds, -duration, -stream-tokens, -nginx-workers and -speedup must be positive")
	}
	o.nginxWorkers = min(o.nginxWorkers, runtime.NumCPU())
	return o, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "kvoverhead-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)

	logf := func(format string, a ...any) { fmt.Fprintf(stderr, "kvoverhead: "+format+"\n", a...) }
	nginxPath, note := findNginx(o.nginx)
	if note != "" {
		logf("%s", note)
	}
	for _, b := range []struct {
		path *string
		pkg  string
	}{{&o.kvproxy, "kvproxy"}, {&o.kvmock, "kvmock"}} {
		if *b.path != "" {
			continue
		}
		logf("building %s", b.pkg)
		if *b.path, err = goBuild(tmp, b.pkg); err != nil {
			return err
		}
	}

	setup, err := startAll(ctx, tmp, o, nginxPath, logf)
	defer setup.stop()
	if err != nil {
		return err
	}
	res, err := measure(ctx, setup, o, logf)
	if err != nil {
		return err
	}
	logf("kvproxy %s", setup.kvproxyFeed())
	rep := buildReport(res, o, setup)
	if o.png != "" {
		if err := writeChart(o.png, rep); err != nil {
			logf("no chart: %v", err)
		} else {
			logf("wrote %s", o.png)
		}
	}
	if o.json {
		return writeJSON(stdout, rep)
	}
	writeTable(stdout, rep)
	return nil
}
