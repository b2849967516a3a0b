package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// goBuild builds ./cmd/<name> of the module in the working directory into dir.
func goBuild(dir, name string) (string, error) {
	out := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-o", out, "github.com/kvproxy/kvproxy/cmd/"+name)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build %s (run from the repository, or pass -%s): %v\n%s", name, name, err, b)
	}
	return out, nil
}

// findNginx resolves the nginx binary: the flag's value, else nginx on PATH
// (and /usr/sbin, where Debian puts it and root's PATH may not). Without one
// it returns "" and a note saying how to get it.
func findNginx(flagValue string) (path, note string) {
	const howTo = "install it with `apt-get update -qq && apt-get install -y -qq nginx-light` (or nginx), or pass -nginx PATH"
	if flagValue != "" {
		if p, err := exec.LookPath(flagValue); err == nil {
			return p, ""
		}
		return "", fmt.Sprintf("nginx %q not found: skipping the nginx column; %s", flagValue, howTo)
	}
	if p, err := exec.LookPath("nginx"); err == nil {
		return p, ""
	}
	if _, err := os.Stat("/usr/sbin/nginx"); err == nil {
		return "/usr/sbin/nginx", ""
	}
	return "", "nginx not found on PATH: skipping the nginx column; " + howTo
}

// proc is a child process with its combined output kept.
type proc struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  bytes.Buffer
	done chan struct{}
}

func (p *proc) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.out.Len() < 1<<20 {
		p.out.Write(b)
	}
	return len(b), nil
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func startProc(name, path string, args ...string) (*proc, error) {
	p := &proc{name: name, cmd: exec.Command(path, args...), done: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = p, p
	p.cmd.SysProcAttr = procAttr()
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() { p.cmd.Wait(); close(p.done) }()
	return p, nil
}

// stop sends SIGTERM, then SIGKILL after 5s.
func (p *proc) stop() {
	if p == nil || p.exited() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
}

// target is one way to reach the engine.
type target struct {
	name string // direct, kvproxy, kvproxy2, fasthttp, nginx
	addr string // host:port
	// pids lists the processes whose CPU counts as this target's cost
	// (none for direct).
	pids func() []int
	// mallocs reads the target's heap allocations so far (kvproxy's
	// go_memstats_mallocs_total); nil where there is none.
	mallocs func() (uint64, error)
}

// setup is the running fleet: the engine and the proxies in front of it.
type setup struct {
	engine  *proc
	proxies []*proc
	targets []target
	// nginxWorkers is nginx's worker_processes (0 without nginx).
	nginxWorkers int
}

// kvproxyFeed reports what kvproxy's backend saw of the engine's KV event
// feed, from /admin/backends: proof that routing ran on live events.
func (s *setup) kvproxyFeed() string {
	for _, t := range s.targets {
		if t.name != "kvproxy" { // kvproxy2 sees the same feed
			continue
		}
		resp, err := http.Get("http://" + t.addr + "/admin/backends")
		if err != nil {
			return err.Error()
		}
		defer resp.Body.Close()
		var rows []struct {
			ID       string `json:"id"`
			KVEvents struct {
				Mode   string `json:"mode"`
				Events uint64 `json:"events_received"`
			} `json:"kv_events"`
			IndexedBlocks int64 `json:"indexed_blocks"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
			return "/admin/backends: " + err.Error()
		}
		var b strings.Builder
		for _, r := range rows {
			fmt.Fprintf(&b, "backend %s: kv_events %s, %d events received, %d blocks indexed; ",
				r.ID, r.KVEvents.Mode, r.KVEvents.Events, r.IndexedBlocks)
		}
		return strings.TrimSuffix(b.String(), "; ")
	}
	return "no kvproxy"
}

func (s *setup) stop() {
	for _, p := range s.proxies {
		p.stop()
	}
	s.engine.stop()
}

var (
	listenRe = regexp.MustCompile(`listening on http://([0-9.:]+)`)
	eventsRe = regexp.MustCompile(`kv events (tcp://[0-9.:]+) replay (tcp://[0-9.:]+)`)
)

func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// startAll starts the engine, kvproxy and (when nginxPath is set) nginx,
// and waits until each answers. The returned setup is never nil.
func startAll(ctx context.Context, tmp string, o options, nginxPath string, logf func(string, ...any)) (*setup, error) {
	s := &setup{}
	var err error
	s.engine, err = startProc("kvmock", o.kvmock, "-n", "1", "-base-port", "0", "-speedup", strconv.FormatFloat(o.speedup, 'g', -1, 64),
		"-kv-events", "-kv-events-base-port", "0")
	if err != nil {
		return s, err
	}
	var engineAddr, pub, replay string
	if err := waitFor(ctx, s.engine, func() bool {
		out := s.engine.output()
		m, ev := listenRe.FindStringSubmatch(out), eventsRe.FindStringSubmatch(out)
		if m == nil || ev == nil {
			return false
		}
		engineAddr, pub, replay = m[1], ev[1], ev[2]
		return true
	}); err != nil {
		return s, err
	}
	if err := waitHTTP(ctx, s.engine, "http://"+engineAddr+"/health"); err != nil {
		return s, err
	}
	s.targets = append(s.targets, target{name: "direct", addr: engineAddr, pids: func() []int { return nil }})
	logf("engine on %s (events %s, replay %s)", engineAddr, pub, replay)

	for _, k := range []struct{ name, path string }{{"kvproxy", o.kvproxy}, {"kvproxy2", o.kvproxy2}} {
		if k.path == "" {
			continue
		}
		if err := s.startKVProxy(ctx, tmp, k.name, k.path, engineAddr, pub, replay, logf); err != nil {
			return s, err
		}
	}

	if o.floor {
		if err := s.startFloor(ctx, "fasthttp", floorCommand, engineAddr, logf); err != nil {
			return s, err
		}
	}
	if o.eventLoop {
		if err := s.startFloor(ctx, "eventloop", eventLoopCommand, engineAddr, logf); err != nil {
			return s, err
		}
	}

	listen, err := freePort()
	if err != nil {
		return s, err
	}
	if nginxPath == "" {
		return s, nil
	}
	ndir := filepath.Join(tmp, "nginx")
	if err := os.MkdirAll(ndir, 0o755); err != nil {
		return s, err
	}
	conf := filepath.Join(ndir, "nginx.conf")
	user := ""
	if os.Geteuid() == 0 {
		user = "root" // workers would otherwise drop to nobody
	}
	if err := os.WriteFile(conf, []byte(nginxConfig(ndir, listen, engineAddr, o.nginxWorkers, user)), 0o644); err != nil {
		return s, err
	}
	np, err := startProc("nginx", nginxPath, "-p", ndir, "-c", conf, "-e", filepath.Join(ndir, "error.log"))
	if err != nil {
		return s, err
	}
	s.proxies = append(s.proxies, np)
	if err := waitHTTP(ctx, np, "http://"+listen+"/health"); err != nil {
		b, _ := os.ReadFile(filepath.Join(ndir, "error.log"))
		return s, fmt.Errorf("%w\nnginx error.log:\n%s", err, b)
	}
	master := np.cmd.Process.Pid
	s.nginxWorkers = o.nginxWorkers
	s.targets = append(s.targets, target{name: "nginx", addr: listen, pids: func() []int {
		return append([]int{master}, childrenOf(master)...)
	}})
	logf("nginx on %s (master pid %d, %d workers)", listen, master, o.nginxWorkers)
	return s, nil
}

// startKVProxy starts one kvproxy in front of the engine as target name.
func (s *setup) startKVProxy(ctx context.Context, tmp, name, path, engineAddr, pub, replay string, logf func(string, ...any)) error {
	listen, err := freePort()
	if err != nil {
		return err
	}
	cfgPath := filepath.Join(tmp, name+".yaml")
	if err := os.WriteFile(cfgPath, []byte(kvproxyConfig(listen, engineAddr, pub, replay)), 0o600); err != nil {
		return err
	}
	kp, err := startProc(name, path, "-config", cfgPath)
	if err != nil {
		return err
	}
	s.proxies = append(s.proxies, kp)
	if err := waitHTTP(ctx, kp, "http://"+listen+"/health"); err != nil {
		return err
	}
	pid := kp.cmd.Process.Pid
	metricsURL := "http://" + listen + "/metrics"
	s.targets = append(s.targets, target{name: name, addr: listen, pids: func() []int { return []int{pid} },
		mallocs: func() (uint64, error) { return scrapeMallocs(metricsURL) }})
	logf("%s %s on %s (pid %d)", name, path, listen, pid)
	return nil
}

// waitFor polls cond every 10ms for up to 15s, failing early if p exits.
func waitFor(ctx context.Context, p *proc, cond func() bool) error {
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if p.exited() {
			return fmt.Errorf("%s exited:\n%s", p.name, p.output())
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("%s did not start:\n%s", p.name, p.output())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

func waitHTTP(ctx context.Context, p *proc, url string) error {
	return waitFor(ctx, p, func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
}

// benchModel is the model name the engine serves and the proxy exposes.
const benchModel = "mock-model"

// kvproxyConfig is kvproxy's configuration: one vLLM-kind backend with its
// KV event feed, routing on (policy kv), the access log off (warn).
func kvproxyConfig(listen, engine, pub, replay string) string {
	return fmt.Sprintf(`listen: %s
log_level: warn
models:
  - {name: %s, aliases: [default], tokenizer: cl100k_base, template: chatml, block_size: 16}
backends:
  - id: engine-0
    url: http://%s
    model: %s
    kind: vllm
    kv_events: {mode: zmq, endpoint: %q, replay: %q}
router: {policy: kv}
`, listen, benchModel, engine, benchModel, pub, replay)
}

// nginxConfig renders nginx.conf for a reverse proxy on listen in front of
// engine, with everything nginx writes kept under dir. user is the
// "user" directive's value ("" leaves it out: only root may set it).
//
// Tuned as one would for streaming LLM answers: buffering off (each SSE
// event is passed on as it arrives), HTTP/1.1 keep-alive to the engine (64
// idle connections per worker), no access log (kvproxy runs at warn and
// writes none either), and keep-alive request limits raised so neither side
// closes connections every 1000 requests.
func nginxConfig(dir, listen, engine string, workers int, user string) string {
	var b strings.Builder
	if user != "" {
		fmt.Fprintf(&b, "user %s;\n", user)
	}
	fmt.Fprintf(&b, `daemon off;
master_process on;
worker_processes %d;
pid %s;
error_log %s warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path %s;
    proxy_temp_path %s;
    fastcgi_temp_path %s;
    uwsgi_temp_path %s;
    scgi_temp_path %s;
    keepalive_requests 1000000;
    upstream engine {
        server %s;
        keepalive 64;
        keepalive_requests 1000000;
    }
    server {
        listen %s;
        location / {
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
`, workers, filepath.Join(dir, "nginx.pid"), filepath.Join(dir, "error.log"),
		filepath.Join(dir, "client_body"), filepath.Join(dir, "proxy"), filepath.Join(dir, "fastcgi"),
		filepath.Join(dir, "uwsgi"), filepath.Join(dir, "scgi"), engine, listen)
	return b.String()
}

// clockTicks is USER_HZ, the unit of utime and stime in /proc/PID/stat: 100
// on every Linux architecture Go supports.
const clockTicks = 100

// procStat is what kvoverhead reads of /proc/PID/stat.
type procStat struct {
	PPID         int
	UTime, STime uint64 // clock ticks
}

// parseProcStat parses the contents of /proc/PID/stat. The command name (in
// parentheses) may hold spaces and parentheses, so fields are counted from
// the last ')'.
func parseProcStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, errors.New("no ')' in /proc stat")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): field n is f[n-3].
	if len(f) < 13 {
		return procStat{}, fmt.Errorf("/proc stat has %d fields after the name, want at least 13", len(f))
	}
	var s procStat
	var err error
	if s.PPID, err = strconv.Atoi(f[1]); err != nil {
		return s, fmt.Errorf("ppid: %w", err)
	}
	if s.UTime, err = strconv.ParseUint(f[11], 10, 64); err != nil {
		return s, fmt.Errorf("utime: %w", err)
	}
	if s.STime, err = strconv.ParseUint(f[12], 10, 64); err != nil {
		return s, fmt.Errorf("stime: %w", err)
	}
	return s, nil
}

func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(b)
}

// cpuSeconds is the user+system CPU time of pids so far. A process that is
// gone counts nothing.
func cpuSeconds(pids []int) float64 {
	var ticks uint64
	for _, pid := range pids {
		if s, err := readProcStat(pid); err == nil {
			ticks += s.UTime + s.STime
		}
	}
	return float64(ticks) / clockTicks
}

// childrenOf lists the processes whose parent is pid (nginx's workers).
func childrenOf(pid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var kids []int
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if s, err := readProcStat(n); err == nil && s.PPID == pid {
			kids = append(kids, n)
		}
	}
	return kids
}

var mallocsLine = []byte("\ngo_memstats_mallocs_total ")

// scrapeMallocs reads go_memstats_mallocs_total from a Prometheus endpoint.
func scrapeMallocs(url string) (uint64, error) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	return parseMallocs(b)
}

func parseMallocs(b []byte) (uint64, error) {
	i := bytes.Index(b, mallocsLine)
	if i < 0 {
		return 0, errors.New("no go_memstats_mallocs_total in /metrics")
	}
	v := b[i+len(mallocsLine):]
	if j := bytes.IndexByte(v, '\n'); j >= 0 {
		v = v[:j]
	}
	f, err := strconv.ParseFloat(string(bytes.TrimSpace(v)), 64)
	if err != nil {
		return 0, fmt.Errorf("go_memstats_mallocs_total: %w", err)
	}
	return uint64(f), nil
}
