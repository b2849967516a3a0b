package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestNginxConfigRenders(t *testing.T) {
	dir := t.TempDir()
	conf := nginxConfig(dir, "127.0.0.1:8081", "127.0.0.1:9001", 2, "root")
	for _, want := range []string{
		"user root;\n",
		"daemon off;\n",
		"worker_processes 2;\n",
		"pid " + filepath.Join(dir, "nginx.pid") + ";\n",
		"error_log " + filepath.Join(dir, "error.log") + " warn;\n",
		"server 127.0.0.1:9001;",
		"keepalive 64;",
		"listen 127.0.0.1:8081;",
		"proxy_pass http://engine;",
		"proxy_http_version 1.1;",
		`proxy_set_header Connection "";`,
		"proxy_buffering off;",
		"access_log off;",
	} {
		if !strings.Contains(conf, want) {
			t.Errorf("nginx.conf lacks %q:\n%s", want, conf)
		}
	}
	if strings.Contains(nginxConfig(dir, "a:1", "b:2", 1, ""), "user ") {
		t.Error("user directive rendered without a user")
	}
	if strings.Count(conf, "{") != strings.Count(conf, "}") {
		t.Errorf("unbalanced braces:\n%s", conf)
	}

	// With nginx installed, nginx itself must accept the file.
	ngx, note := findNginx("")
	if ngx == "" {
		t.Log(note)
		return
	}
	user := ""
	if os.Geteuid() == 0 {
		user = "root"
	}
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(nginxConfig(dir, "127.0.0.1:8081", "127.0.0.1:9001", 2, user)), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(ngx, "-t", "-p", dir, "-c", path, "-e", filepath.Join(dir, "error.log")).CombinedOutput()
	if err != nil {
		t.Fatalf("nginx -t rejects the config: %v\n%s", err, out)
	}
}

func TestKVProxyConfigHasEventsAndRouting(t *testing.T) {
	c := kvproxyConfig("127.0.0.1:8080", "127.0.0.1:9001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
	for _, want := range []string{
		"listen: 127.0.0.1:8080\n", "log_level: warn\n", "url: http://127.0.0.1:9001\n", "kind: vllm\n",
		`kv_events: {mode: zmq, endpoint: "tcp://127.0.0.1:5557", replay: "tcp://127.0.0.1:5558"}`,
		"router: {policy: kv}",
	} {
		if !strings.Contains(c, want) {
			t.Errorf("kvproxy config lacks %q:\n%s", want, c)
		}
	}
}

func TestParseProcStat(t *testing.T) {
	// The command name may hold spaces and parentheses.
	line := []byte("4242 (nginx: worker (x) ) S 4200 4200 4200 0 -1 4194624 120 0 0 0 1234 567 0 0 20 0 1 0 100 1000000 500 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n")
	s, err := parseProcStat(line)
	if err != nil {
		t.Fatal(err)
	}
	if s.PPID != 4200 || s.UTime != 1234 || s.STime != 567 {
		t.Fatalf("got %+v, want ppid 4200 utime 1234 stime 567", s)
	}
	for _, bad := range []string{"", "1 (x", "1 (x) S 2 3", "1 (x) S p 0 0 0 0 0 0 0 0 0 1 2"} {
		if _, err := parseProcStat([]byte(bad)); err == nil {
			t.Errorf("parseProcStat(%q) accepted", bad)
		}
	}

	// Our own process: CPU time only grows, and we are our parent's child.
	self, err := readProcStat(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	before := cpuSeconds([]int{os.Getpid()})
	for end := time.Now().Add(30 * time.Millisecond); time.Now().Before(end); {
	}
	if after := cpuSeconds([]int{os.Getpid()}); after < before {
		t.Fatalf("CPU time went back: %v then %v", before, after)
	}
	found := false
	for _, k := range childrenOf(self.PPID) {
		found = found || k == os.Getpid()
	}
	if !found {
		t.Fatalf("childrenOf(%d) misses pid %d", self.PPID, os.Getpid())
	}
}

func TestMissingNginxIsReportedClearly(t *testing.T) {
	path, note := findNginx(filepath.Join(t.TempDir(), "no-nginx-here"))
	if path != "" {
		t.Fatalf("found %q", path)
	}
	for _, want := range []string{"not found", "skipping the nginx column", "apt-get install -y -qq nginx-light"} {
		if !strings.Contains(note, want) {
			t.Errorf("note %q lacks %q", note, want)
		}
	}
}

func TestReportRatiosAndTable(t *testing.T) {
	mk := func(ok int, ms ...float64) sample {
		s := sample{ok: ok, events: int64(ok) * 10, elapsed: time.Second, cpu: float64(ok) * 1e-5}
		for _, m := range ms {
			s.lat = append(s.lat, time.Duration(m*float64(time.Millisecond)))
		}
		return s
	}
	res := results{
		{chat, 4, "direct"}:    {func() sample { s := mk(1000, 1, 1, 2); s.noMallocs = true; return s }()},
		{chat, 4, "kvproxy"}:   {mk(800, 2, 2, 3)},
		{chat, 4, "nginx"}:     {mk(400, 3, 3, 4), mk(600, 3)},
		{chat, 4, "fasthttp"}:  {mk(640, 2, 2, 2)},
		{chat, 4, "eventloop"}: {mk(450, 2, 2, 2)},
	}
	rep := buildReport(res, options{conc: []int{4}, workloads: []string{chat, stream}, rounds: 2, duration: time.Second, streamTokens: 8}, &setup{nginxWorkers: 2})
	get := func(metric string) row {
		for _, r := range rep.Results {
			if r.Workload == chat && r.Metric == metric {
				return r
			}
		}
		t.Fatalf("no %s row", metric)
		return row{}
	}
	thr := get("throughput")
	if *thr.Nginx != 500 || *thr.KVProxyDirect != 0.8 || *thr.KVProxyNginx != 1.6 {
		t.Errorf("throughput row %v %v %v: want nginx median 500, ratios 0.8 and 1.6", *thr.Nginx, *thr.KVProxyDirect, *thr.KVProxyNginx)
	}
	if *thr.Floor != 640 || *thr.KVProxyFloor != 1.25 || *thr.FloorNginx != 1.28 {
		t.Errorf("throughput row fasthttp %v, ratios %v %v: want 640, 1.25 and 1.28", *thr.Floor, *thr.KVProxyFloor, *thr.FloorNginx)
	}
	if *thr.EventLoop != 450 || *thr.EventLoopNginx != 0.9 {
		t.Errorf("throughput row eventloop %v, ratio %v: want 450 and 0.9", *thr.EventLoop, *thr.EventLoopNginx)
	}
	if a := get("added_p50"); a.Direct != nil || *a.KVProxy != 1 || a.KVProxyNginx != nil {
		t.Errorf("added_p50: %+v", a)
	}
	if c := get("cpu_per_request"); c.Direct != nil || *c.KVProxy != 10 {
		t.Errorf("cpu_per_request: %+v", c)
	}
	if a := get("allocs_per_request"); a.Direct != nil || a.KVProxy == nil {
		t.Errorf("allocs_per_request: %+v", a)
	}
	var b bytes.Buffer
	writeTable(&b, rep)
	if !strings.Contains(b.String(), "kvproxy/nginx") || !strings.Contains(b.String(), "1.60×") ||
		!strings.Contains(b.String(), "kvproxy/fasthttp") || !strings.Contains(b.String(), "1.25×") ||
		!strings.Contains(b.String(), "eventloop/nginx") || !strings.Contains(b.String(), "0.90×") {
		t.Errorf("table:\n%s", b.String())
	}
	if err := writeChart(filepath.Join(t.TempDir(), "o.png"), rep); err != nil {
		t.Fatal(err)
	}
}

func TestParseMallocs(t *testing.T) {
	b := []byte("# HELP go_memstats_mallocs_total Total number of heap objects allocated.\n# TYPE go_memstats_mallocs_total counter\ngo_memstats_mallocs_total 1.234567e+06\ngo_memstats_frees_total 7\n")
	if n, err := parseMallocs(b); err != nil || n != 1234567 {
		t.Fatalf("parseMallocs = %d, %v; want 1234567", n, err)
	}
	if _, err := parseMallocs([]byte("go_memstats_frees_total 7\n")); err == nil {
		t.Fatal("accepted /metrics without the counter")
	}
}
