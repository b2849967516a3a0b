// Command kvproxy is an OpenAI-compatible reverse proxy that routes each
// request to the engine already caching the longest part of its prompt.
//
//	kvproxy -config config.yaml [-listen 127.0.0.1:8080]
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/internal/buildinfo"
	"github.com/kvproxy/kvproxy/mockengine"
	"github.com/kvproxy/kvproxy/proxy"
)

// Log times to the millisecond: ten requests in one second must be told
// apart and matched with the engines' logs.
func init() { zerolog.TimeFieldFormat = "2006-01-02T15:04:05.000Z07:00" }

func main() {
	if len(os.Args) > 1 && os.Args[1] == "tokenize" {
		os.Exit(tokenizeCmd(os.Args[2:], os.Stdin, os.Stdout, os.Stderr))
	}
	// Signals are caught from the start: a SIGHUP while the engines and
	// tokenizers load must not end the process. SIGHUP has a channel of its
	// own: signal delivery drops what does not fit, and a SIGTERM must
	// not be dropped because a SIGHUP waits (a reload may take a while).
	hup, term := make(chan os.Signal, 1), make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGINT)
	c := &command{hup: hup, term: term, stdout: os.Stdout, stderr: os.Stderr}
	// A container's memory limit becomes the garbage collector's soft
	// limit, unless GOMEMLIMIT sets one: near it the collector works
	// harder, where the kernel would kill the process.
	memLimit := debug.SetMemoryLimit(-1) // GOMEMLIMIT's, else none (MaxInt64)
	if limit, ok := cgroupMemoryLimit("/proc/self/cgroup", "/sys/fs/cgroup"); ok {
		share := int64(float64(limit) * memoryLimitShare)
		if os.Getenv("GOMEMLIMIT") == "" {
			c.memoryLimit = share
			debug.SetMemoryLimit(share)
		}
		memLimit = min(memLimit, share) // GOMEMLIMIT=off, or over the container's, does not lift the container's
	}
	if memLimit < math.MaxInt64 {
		config.MemoryLimit = memLimit // before any configuration is read: limits.body_memory_mb's default follows it
	}
	os.Exit(c.run(os.Args[1:]))
}

// command is one run of kvproxy: SIGHUP arrives on hup, SIGTERM and SIGINT
// on term; ready, when set, is told the listen address once serving (tests).
type command struct {
	hup    <-chan os.Signal
	term   <-chan os.Signal
	stdout io.Writer
	stderr io.Writer
	ready  func(addr string)
	// adminReady, when set, is told admin_listen's address once serving.
	adminReady func(addr string)

	// memoryLimit is the soft memory limit main set from the cgroup's (0:
	// none), for the log.
	memoryLimit int64

	// stopSignal and stopAt: the signal that began the shutdown, and when.
	// Within repeatWindow of it (repeatedSignal if 0), the same is a copy.
	stopSignal   os.Signal
	stopAt       time.Time
	repeatWindow time.Duration

	mocks *mockFleet
	// listen, when set, opens the mocks' listeners (tests).
	listen func(network, addr string) (net.Listener, error)
	// lookup, when set, resolves discovery templates' hosts (tests).
	lookup func(ctx context.Context, host string) ([]string, error)
}

// errShuttingDown refuses a reload once the drain began.
var errShuttingDown = errors.New("shutting down: the configuration is not reloaded")

// logSkipped warns of the discovered addresses Expand left out.
func logSkipped(log zerolog.Logger, skipped []string) {
	for _, sk := range skipped {
		log.Warn().Str("backend", sk).Msg("discovery: address left out")
	}
}

func (c *command) discoverer(log zerolog.Logger) *discoverer {
	d := newDiscoverer(log)
	if c.lookup != nil {
		d.lookup = c.lookup
	}
	return d
}

func (c *command) run(args []string) (code int) {
	fs := flag.NewFlagSet("kvproxy", flag.ContinueOnError)
	fs.SetOutput(c.stderr)
	cfgPath := fs.String("config", "config.example.yaml", "path to the YAML config")
	listen := fs.String("listen", "", "listen address, overrides the config's listen")
	drainFlag := fs.Duration("drain-timeout", 0, "how long SIGTERM waits for in-flight requests (default: limits.drain_timeout)")
	version := fs.Bool("version", false, "print the version and commit, and exit")
	check := fs.Bool("check", false, "check the config as a start would (tokenizers, templates, certificates, discovery), start nothing, and exit: 0 if valid")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: kvproxy [flags]            serve (README.md: Configuration reference)")
		fmt.Fprintln(fs.Output(), "       kvproxy tokenize [flags]   print a text's token ids as kvproxy routes on them (kvproxy tokenize -h)")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		// "kvproxy prod.yaml" started the example configuration, and
		// "kvproxy -check prod.yaml" checked it (the docs review).
		fmt.Fprintf(c.stderr, "kvproxy: unexpected argument %q: name the configuration with -config FILE\n", fs.Arg(0))
		fs.Usage()
		return 2
	}
	build := buildinfo.Read()
	if *version {
		fmt.Fprintln(c.stdout, build)
		return 0
	}

	tmpl, err := config.Load(*cfgPath)
	if err != nil {
		fmt.Fprintln(c.stderr, "kvproxy:", err)
		return 2
	}
	if *listen != "" {
		if _, _, err := net.SplitHostPort(*listen); err != nil {
			// The file's listen is checked with the file; the flag's was
			// not, and -check passed what a start refused (the trial).
			fmt.Fprintf(c.stderr, "kvproxy: -listen: want host:port, got %q\n", *listen)
			return 2
		}
		tmpl.Listen = *listen
	}
	level := &logLevel{}
	level.set(tmpl.LogLevel)
	log := zerolog.New(c.stderr).Sample(level).With().Timestamp().Logger()
	if *check {
		return c.check(log, tmpl, *cfgPath)
	}
	start := log.Info().Str("config", *cfgPath).Str("version", build.Version).Str("revision", build.Revision).Int("pid", os.Getpid())
	if c.memoryLimit > 0 {
		start = start.Int64("go_memory_limit_mb", c.memoryLimit>>20) // 90% of the cgroup's
	}
	start.Msg("kvproxy starting")
	defer func() {
		ev := log.Info()
		if code != 0 {
			ev = log.Error()
		}
		ev.Int("code", code).Msg("kvproxy exited")
	}()
	disc := c.discoverer(log)
	cfg, err := c.expandAtStart(log, disc, tmpl)
	if err != nil {
		fmt.Fprintln(c.stderr, "kvproxy:", err)
		return 2
	}

	c.mocks = newMockFleet(log)
	if c.listen != nil {
		c.mocks.listen = c.listen
	}
	defer c.mocks.close()
	started, err := c.mocks.start(cfg)
	if err != nil {
		fmt.Fprintln(c.stderr, "kvproxy:", err)
		return 1
	}
	srv, err := proxy.New(cfg, proxy.Options{Logger: log})
	if err != nil {
		c.mocks.abort(started)
		fmt.Fprintln(c.stderr, "kvproxy:", err)
		return 1
	}
	c.mocks.commit(cfg, started, srv) // retires nothing: none ran before

	defer srv.FlushLogs() // before "kvproxy exited"
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		fmt.Fprintln(c.stderr, "kvproxy:", err)
		return 1
	}
	var adminLn net.Listener
	if cfg.AdminListen != "" {
		if adminLn, err = net.Listen("tcp", cfg.AdminListen); err != nil {
			ln.Close()
			fmt.Fprintln(c.stderr, "kvproxy: admin_listen:", err)
			return 1
		}
	}
	serving := log.Info().Str("listen", ln.Addr().String())
	if adminLn != nil {
		serving = serving.Str("admin_listen", adminLn.Addr().String())
	}
	serving.Bool("tls", cfg.TLS.Enabled()).Int("backends", len(cfg.Backends)).
		Str("policy", cfg.Router.Policy).Int("max_connections", srv.MaxConnections()).Int("body_memory_mb", cfg.Limits.BodyMemoryMB).Msg("kvproxy serving")

	// A reload (SIGHUP or POST /admin/reload, which may come at once) is
	// applied whole under reloadMu: load, start the mocks it adds, swap the
	// proxy's configuration, retire the mocks it drops. Whatever fails
	// leaves the configuration in force and its mocks as they were.
	//
	// A change in what a discovery template stands for applies the same
	// way, to the configuration in force (the file is read only at a
	// reload).
	var reloadMu sync.Mutex
	current, currentTmpl, applied := cfg, tmpl, disc.found(tmpl.Templates(), nil)
	// apply applies nextTmpl with what its templates stand for (staged:
	// a reload's own lookups, kept only if it applies); discovered: only
	// the engines found changed.
	apply := func(nextTmpl *config.Config, staged map[string][]string, discovered bool) error {
		found := disc.found(nextTmpl.Templates(), staged)
		next, skipped, err := nextTmpl.Expand(found)
		if err != nil {
			srv.ReloadFailed()
			return err
		}
		logSkipped(log, skipped)
		started, err := c.mocks.start(next)
		if err != nil {
			srv.ReloadFailed()
			return err
		}
		// The new level applies before the reload logs its summary, which
		// a reload from warn to info lost (found by the twelfth session's
		// operator trial). Its own line is said at the old level or the
		// new one, whichever lets it through.
		var levelChanged *zerolog.Event
		if next.LogLevel != current.LogLevel {
			levelChanged = log.Info()
			level.set(next.LogLevel)
			if levelChanged == nil {
				levelChanged = log.Info()
			}
		}
		reloadSrv := srv.Reload
		if discovered {
			reloadSrv = srv.ReloadBackends
		}
		if err := reloadSrv(next); err != nil {
			level.set(current.LogLevel)
			levelChanged.Discard()
			c.mocks.abort(started)
			return err
		}
		c.mocks.commit(next, started, srv)
		if levelChanged != nil {
			levelChanged.Str("log_level", next.LogLevel).Str("was", current.LogLevel).Msg("log level changed")
		}
		current, currentTmpl, applied = next, nextTmpl, found
		disc.record(staged, false)
		disc.keep(hosts(nextTmpl.Templates()))
		return nil
	}
	draining := false // under reloadMu: no reload applies once the drain began
	reload := func() error {
		// The names the reload adds are looked up first, outside the
		// lock, within lookupsTime: a template renamed goes on serving.
		// (One the file gains meanwhile is resolved by the watcher.)
		var staged map[string][]string
		if peek, err := config.Load(*cfgPath); err == nil {
			reloadMu.Lock()
			inForce, shutting := hosts(currentTmpl.Templates()), draining
			reloadMu.Unlock()
			if shutting {
				return errShuttingDown
			}
			added := slices.DeleteFunc(hosts(peek.Templates()), func(h string) bool { return slices.Contains(inForce, h) })
			ctx, cancel := context.WithTimeout(context.Background(), lookupsTime)
			staged = disc.lookupAll(ctx, added)
			cancel()
		}
		reloadMu.Lock()
		defer reloadMu.Unlock()
		if draining {
			return errShuttingDown
		}
		nextTmpl, err := config.Load(*cfgPath)
		if err != nil {
			srv.ReloadFailed()
			return err
		}
		if *listen != "" {
			nextTmpl.Listen = current.Listen // the flag, not the file, says where to listen
		}
		return apply(nextTmpl, staged, false)
	}
	srv.SetReloader(reload)
	watchCtx, stopWatch := context.WithCancel(context.Background())
	defer stopWatch()
	go disc.watch(watchCtx, func() time.Duration {
		reloadMu.Lock()
		defer reloadMu.Unlock()
		return every(currentTmpl.Templates())
	}, func(hs []string) {
		// The lookups run outside the reload's lock (a SIGTERM or a
		// reload does not wait for them); what they found is applied,
		// once, to the templates in force then, a reload's since
		// included.
		ctx, cancel := context.WithTimeout(watchCtx, lookupsTime)
		disc.record(disc.lookupAll(ctx, hs), true)
		cancel()
		reloadMu.Lock()
		defer reloadMu.Unlock()
		if draining || watchCtx.Err() != nil || maps.EqualFunc(applied, disc.found(currentTmpl.Templates(), nil), slices.Equal) {
			return // draining, or nothing changed since the last apply
		}
		if err := apply(currentTmpl, nil, true); err != nil {
			log.Error().Err(err).Msg("discovery: the backends found could not be applied; the current ones keep serving")
		}
	})

	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(ln) }()
	if adminLn != nil {
		go func() { errc <- srv.ServeAdmin(adminLn) }()
		if c.adminReady != nil {
			c.adminReady(adminLn.Addr().String())
		}
	}
	if c.ready != nil {
		c.ready(ln.Addr().String())
	}
wait:
	for {
		select {
		case err := <-errc:
			log.Error().Err(err).Msg("server stopped")
			return 1
		case <-c.hup:
			if err := reload(); err != nil {
				log.Error().Err(err).Msg("reload rejected; the current configuration keeps serving")
			}
		case sig := <-c.term:
			c.stopSignal, c.stopAt = sig, time.Now()
			log.Info().Str("signal", sig.String()).Msg("shutting down; a second signal exits at once")
			stopWatch() // no engine comes or goes while draining, as no reload does
			break wait
		}
	}
	reloadMu.Lock()
	draining = true
	drain := current.Limits.DrainTimeout
	reloadMu.Unlock()
	if *drainFlag > 0 {
		drain = *drainFlag
	}
	log.Info().Str("drain_timeout", drain.String()).Int("requests_in_flight", srv.InFlight()).Msg("draining")
	ctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- srv.Shutdown() }()
	switch c.awaitDrain(log, srv, done, ctx.Done(), "second signal: exiting without waiting for the requests in flight") {
	case drained:
		log.Info().Msg("drained")
		return 0
	case signalled:
		return 1
	}
	// Answer what is left (an error event and [DONE], or a 503) rather
	// than drop it mid-answer; a client that does not read gets cutGrace.
	n := srv.Cut()
	log.Warn().Int("requests", n).Msg("drain timeout: cutting the requests still in flight")
	grace, cancelGrace := context.WithTimeout(context.Background(), cutGrace)
	defer cancelGrace()
	switch c.awaitDrain(log, srv, done, grace.Done(), "second signal: exiting without waiting for the requests cut") {
	case signalled:
		return 1
	case timedOut:
		log.Warn().Int("requests", srv.InFlight()).Msg("exiting with requests still unanswered")
	}
	return 0
}

// expandAtStart gives tmpl's templates the engines their names resolve to
// now (within lookupsTime).
func (c *command) expandAtStart(log zerolog.Logger, disc *discoverer, tmpl *config.Config) (*config.Config, error) {
	ctx, cancel := context.WithTimeout(context.Background(), lookupsTime)
	disc.record(disc.lookupAll(ctx, hosts(tmpl.Templates())), false)
	cancel()
	disc.keep(hosts(tmpl.Templates()))
	cfg, skipped, err := tmpl.Expand(disc.found(tmpl.Templates(), nil))
	if err != nil {
		return nil, err
	}
	logSkipped(log, skipped)
	return cfg, nil
}

// check is kvproxy -check: everything a start does before it serves, short
// of starting anything (the simulated engines are built, not run; no port
// is bound, so one in use is not found). It exits with the status a start
// would: 2 when config.Load or the expansion refuses the file, 1 when a
// tokenizer or template it names does not build.
func (c *command) check(log zerolog.Logger, tmpl *config.Config, path string) int {
	cfg, err := c.expandAtStart(log, c.discoverer(log), tmpl)
	if err != nil {
		fmt.Fprintln(c.stderr, "kvproxy:", err)
		return 2
	}
	// The proxy's models first: a tokenizer or template that does not
	// build is named by its field and line, where a simulated engine
	// built from it named only itself (the trial).
	if err := proxy.Check(cfg, proxy.Options{Logger: log}); err != nil {
		fmt.Fprintln(c.stderr, "kvproxy:", err)
		return 1
	}
	for _, b := range cfg.Backends {
		if b.Kind != config.KindMock {
			continue
		}
		e, err := mockengine.New(mockConfig(cfg, b, keyOf(cfg, b)))
		if err != nil {
			fmt.Fprintf(c.stderr, "kvproxy: mock backend %s: %v\n", b.ID, err)
			return 1
		}
		e.Close()
	}
	fmt.Fprintf(c.stdout, "kvproxy: %s is valid (%s, %s)\n", path, count(len(cfg.Models), "model"), count(len(cfg.Backends), "backend"))
	return 0
}

// count is "1 thing" or "n things".
func count(n int, thing string) string {
	if n == 1 {
		return "1 " + thing
	}
	return strconv.Itoa(n) + " " + thing + "s"
}

// How a wait of the drain ended.
type drainEnd int

const (
	drained drainEnd = iota
	timedOut
	signalled
)

// awaitDrain waits for the shutdown to be done until timeout, or until a
// second SIGTERM or SIGINT, which exits at once: it logs exiting (with the
// requests it drops). A SIGHUP now is logged and ignored (it used to go
// unread, and the operator saw no reload and no word why).
func (c *command) awaitDrain(log zerolog.Logger, srv *proxy.Server, done <-chan error, timeout <-chan struct{}, exiting string) drainEnd {
	for {
		select {
		case <-done:
			return drained
		case <-timeout:
			return timedOut
		case sig := <-c.term:
			if window := cmp.Or(c.repeatWindow, repeatedSignal); sig == c.stopSignal && time.Since(c.stopAt) < window {
				log.Info().Str("signal", sig.String()).Msg("the same signal again at once: taken as the first, sent twice")
				continue
			}
			log.Warn().Str("signal", sig.String()).Int("requests_dropped", srv.InFlight()).Msg(exiting)
			return signalled
		case sig := <-c.hup:
			log.Warn().Str("signal", sig.String()).Int("requests_in_flight", srv.InFlight()).
				Msg("SIGHUP ignored: shutting down, the configuration is not reloaded")
		}
	}
}

// repeatedSignal: the signal that began the shutdown, come again this
// soon, is the same one sent twice, not a second: coreutils' timeout
// signals kvproxy and then its process group, and kvproxy dropped its
// requests in flight on two SIGTERMs a millisecond apart (the twenty-ninth
// session's trial). An operator's second Ctrl-C comes later.
const repeatedSignal = 250 * time.Millisecond

// logLevel is log_level, which a reload may change: the logger's sampler,
// shared by every copy of it (a zerolog level is copied with the logger,
// and the proxy's parts hold copies).
type logLevel struct{ lvl atomic.Int32 }

func (l *logLevel) set(name string) {
	if lvl, err := zerolog.ParseLevel(name); err == nil {
		l.lvl.Store(int32(lvl))
	}
}

// Sample reports whether an event of lvl is logged.
func (l *logLevel) Sample(lvl zerolog.Level) bool { return lvl >= zerolog.Level(l.lvl.Load()) }

// cutGrace is how long the requests cut at the drain deadline have to
// receive their ending.
const cutGrace = 2 * time.Second

// waitRetired waits until every mock dropped by a reload has stopped.
func (c *command) waitRetired() { c.mocks.retired.Wait() }
