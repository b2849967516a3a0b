package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// soakKey is the soak clients' API key.
const soakKey = "soak-key-12345"

// keyed sends every request with soakKey.
type keyed struct{ http.RoundTripper }

func (k keyed) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+soakKey)
	return k.RoundTripper.RoundTrip(r)
}

// promValue reads one sample (name with its labels, if any) from kvproxy's /metrics.
func promValue(t *testing.T, url, name string) float64 {
	t.Helper()
	v, ok := metricValue(t, url, name)
	if !ok {
		t.Fatalf("no metric %s", name)
	}
	return v
}

func metricValue(t *testing.T, url, name string) (float64, bool) {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, name+" ") {
			v, _ := strconv.ParseFloat(strings.TrimSpace(l[len(name):]), 64)
			return v, true
		}
	}
	return 0, false
}

// promValueOr0 is promValue, 0 for a series not (yet) there.
func promValueOr0(t *testing.T, url, name string) float64 {
	t.Helper()
	v, _ := metricValue(t, url, name)
	return v
}

type soakStats struct {
	mu          sync.Mutex
	completions int
	errors      map[int]int
	disconnects int
	malformed   int
	bad         []string
	latencies   []time.Duration
}

func (s *soakStats) fail(msg string) {
	s.mu.Lock()
	if len(s.bad) < 20 {
		s.bad = append(s.bad, msg)
	}
	s.mu.Unlock()
}

// isOpenAIError reports whether b is an OpenAI error object.
func isOpenAIError(b []byte) bool {
	var e struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
	}
	return json.Unmarshal(b, &e) == nil && e.Error != nil && e.Error.Message != "" && e.Error.Type != ""
}

// TestSoak: 200 concurrent clients against kvproxy and three engines for a
// bounded time; 20% of the streams disconnect midway, 10% of the requests
// are malformed, 5% are embeddings (passed through); all come with one
// tenant's key, whose max_concurrency (150) is below the clients' count; one
// engine is killed and restarted, the config is reloaded once. Afterwards the proxy serves, every request ended in a completion or
// an OpenAI error, every load counter is zero (the tenant's in-flight count too), goroutines are back to their
// baseline and memory stayed bounded. KVPROXY_SOAK_SECONDS sets the length
// (default 60; 15 with -short).
func TestSoak(t *testing.T) {
	dur := 60 * time.Second
	if testing.Short() {
		dur = 15 * time.Second
	}
	if v, err := strconv.Atoi(os.Getenv("KVPROXY_SOAK_SECONDS")); err == nil && v > 0 {
		dur = time.Duration(v) * time.Second
	}
	const clients = 200
	a := fleet(t, 2, "-speedup", "10", "-cache-blocks", "2000")
	port := strings.Split(freePort(t), ":")[1]
	victimArgs := []string{"-speedup", "10", "-cache-blocks", "2000", "-base-port", port}
	victim, victimProc := fleetProc(t, 1, victimArgs[:4]...)
	_ = victim
	victimProc.cmd.Process.Kill()
	victimProc.cmd.Wait()
	victimAddrs, victimProc := fleetProc(t, 1, victimArgs...)
	backends := map[string]string{"a0": a[0], "a1": a[1], "victim": victimAddrs[0]}
	// Clients come with a key, as one tenant whose max_concurrency is below
	// the clients' count: its places must all come back too.
	health := "health: {interval: 250ms, fall: 1, eject_base: 200ms, eject_max: 2s, forget_after: 3s}\n" +
		"auth: {keys: [{key: " + soakKey + ", tenant: soak}], admin_keys: [admin-key-0005]}\n" +
		"tenants: [{name: soak, max_concurrency: 150}]\n" +
		"limits: {migration_limit: 1}\n" // streams on the killed engine go on from another
	url, p, path := startProxyConfig(t, backendsYAML(backends, health))

	http.DefaultTransport.(*http.Transport).MaxIdleConnsPerHost = clients
	baseGoroutines := promValue(t, url, "go_goroutines")
	stats := &soakStats{errors: map[int]int{}}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var requests atomic.Int64
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func(seed int64) {
			defer wg.Done()
			r := rand.New(rand.NewSource(seed))
			client := &http.Client{Timeout: 30 * time.Second, Transport: keyed{http.DefaultTransport}}
			for {
				select {
				case <-stop:
					return
				default:
				}
				requests.Add(1)
				soakOne(r, client, url, stats)
			}
		}(int64(c))
	}

	// Chaos, on a timeline relative to the run.
	time.Sleep(dur / 4)
	victimProc.cmd.Process.Signal(syscall.SIGKILL)
	victimProc.cmd.Wait()
	t.Logf("%v: killed engine victim", dur/4)
	time.Sleep(dur / 4)
	fleetProc(t, 1, victimArgs...) // stopped by the test's cleanup
	t.Logf("%v: restarted engine victim", dur/2)
	time.Sleep(dur / 8)
	rewriteConfig(t, p, path, backendsYAML(backends, health+"router: {policy: kv, temperature: 0.05}\n"))
	t.Logf("%v: reloaded the configuration", dur*5/8)
	time.Sleep(dur * 3 / 8)
	close(stop)
	wg.Wait()

	// Still serving, nothing leaked. Client keep-alive connections are
	// closed first: each holds a server goroutine by design.
	http.DefaultTransport.(*http.Transport).CloseIdleConnections()
	alive, err := (&http.Client{Transport: keyed{http.DefaultTransport}}).Post(url+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"default","max_tokens":2,"messages":[{"role":"user","content":"are you alive?"}]}`))
	if err != nil || alive.StatusCode != 200 {
		t.Fatalf("after the soak: %v %v", err, alive)
	}
	alive.Body.Close()
	assertIdle(t, url)
	if n := promValue(t, url, `kvproxy_tenant_inflight_requests{tenant="soak"}`); n != 0 {
		t.Fatalf("the tenant has %v requests in flight after the soak", n)
	}
	var goroutines float64
	// fasthttp keeps idle worker goroutines for MaxIdleWorkerDuration (5s
	// here) before they exit: wait a few of its sweeps.
	deadline := time.Now().Add(25 * time.Second)
	for {
		http.DefaultTransport.(*http.Transport).CloseIdleConnections()
		goroutines = promValue(t, url, "go_goroutines")
		if goroutines <= baseGoroutines+10 {
			break
		}
		if time.Now().After(deadline) {
			if f := os.Getenv("KVPROXY_SOAK_DUMP"); f != "" {
				p.cmd.Process.Signal(syscall.SIGQUIT)
				time.Sleep(time.Second)
				os.WriteFile(f, []byte(p.String()), 0o644)
			}
			t.Fatalf("kvproxy goroutines %.0f, baseline %.0f", goroutines, baseGoroutines)
		}
		time.Sleep(200 * time.Millisecond)
	}
	rss := promValue(t, url, "process_resident_memory_bytes")
	heap := promValue(t, url, "go_memstats_heap_inuse_bytes")
	if rss > 1<<30 {
		t.Fatalf("kvproxy RSS %.0f MiB after the soak", rss/(1<<20))
	}
	if !strings.Contains(p.String(), "configuration reloaded") {
		t.Fatal("the reload did not happen")
	}
	stats.mu.Lock()
	defer stats.mu.Unlock()
	if len(stats.bad) > 0 {
		t.Fatalf("%d requests ended in neither a completion nor an OpenAI error, e.g.:\n%s", len(stats.bad), strings.Join(stats.bad, "\n"))
	}
	sort.Slice(stats.latencies, func(i, j int) bool { return stats.latencies[i] < stats.latencies[j] })
	pct := func(q float64) time.Duration {
		if len(stats.latencies) == 0 {
			return 0
		}
		return stats.latencies[int(q*float64(len(stats.latencies)-1))]
	}
	t.Logf("soak %v, %d clients: %d requests; %d completions, %d disconnects, %d malformed (all answered with OpenAI errors), errors by status %v",
		dur, clients, requests.Load(), stats.completions, stats.disconnects, stats.malformed, stats.errors)
	t.Logf("streams migrated off the killed engine: %.0f, not migrated: %.0f",
		promValueOr0(t, url, `kvproxy_stream_migrations_total{backend="victim",result="ok"}`),
		promValueOr0(t, url, `kvproxy_stream_migrations_total{backend="victim",result="failed"}`))
	t.Logf("completion latency p50 %v p99 %v; kvproxy after: goroutines %.0f (baseline %.0f), RSS %.1f MiB, heap in use %.1f MiB",
		pct(0.5), pct(0.99), goroutines, baseGoroutines, rss/(1<<20), heap/(1<<20))
	if stats.completions < clients {
		t.Fatalf("only %d completions", stats.completions)
	}
}

var malformedBodies = []string{
	`{"model":"default","messages":[`,
	`{"model":"default"}`,
	`{"model":7,"messages":[{"role":"user","content":"a model that is not a name"}]}`,
	`{"model":"default","messages":[{"role":"","content":"x"}]}`,
	`{"model":"nope","messages":[{"role":"user","content":"x"}]}`,
	`{"model":"default","messages":[{"role":"user","content":42}]}`,
	`[]`,
	`{"model":"default","messages":[{"role":"user","content":"x"}],"nvext":{"token_data":[-1]}}`,
	"\x00\x01\x02garbage",
}

func soakOne(r *rand.Rand, client *http.Client, url string, s *soakStats) {
	roll := r.Float64()
	if roll < 0.10 {
		body := malformedBodies[r.Intn(len(malformedBodies))]
		resp, err := client.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			s.fail("malformed request: transport error " + err.Error())
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode < 400 || !isOpenAIError(b) {
			s.fail(fmt.Sprintf("malformed request: %d %s", resp.StatusCode, b))
			return
		}
		s.mu.Lock()
		s.malformed++
		s.mu.Unlock()
		return
	}
	stream := roll < 0.70
	disconnect := roll >= 0.50 && roll < 0.70 // 20% of all requests
	embed := roll >= 0.95                     // 5%: embeddings, passed through
	conv := r.Intn(40)
	prompt := strings.Repeat(fmt.Sprintf("conversation %d shares this long system prompt. ", conv), 10) + fmt.Sprintf(" question %d", r.Intn(1000))
	tokens := 5 + r.Intn(40)
	path, body := "/v1/chat/completions", fmt.Sprintf(`{"model":"default","stream":%v,"max_tokens":%d,"ignore_eos":true,"messages":[{"role":"user","content":%q}]}`, stream, tokens, prompt)
	if embed {
		path, body = "/v1/embeddings", fmt.Sprintf(`{"model":"default","input":[%q,"second input"]}`, prompt)
	}
	start := time.Now()
	resp, err := client.Post(url+path, "application/json", strings.NewReader(body))
	if err != nil {
		s.fail("transport error " + err.Error())
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		if !isOpenAIError(b) {
			s.fail(fmt.Sprintf("status %d without an OpenAI error: %s", resp.StatusCode, b))
			return
		}
		s.mu.Lock()
		s.errors[resp.StatusCode]++
		s.mu.Unlock()
		return
	}
	if disconnect {
		br := bufio.NewReader(resp.Body)
		readEvents(br, 1+r.Intn(3))
		s.mu.Lock()
		s.disconnects++
		s.mu.Unlock()
		return // closing the body mid-stream drops the connection
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		s.fail("reading the answer: " + err.Error())
		return
	}
	ok := false
	if stream {
		str := string(b)
		switch {
		case strings.Contains(str, `data: {"error":{`) && strings.HasSuffix(str, "data: [DONE]\n\n"):
			s.mu.Lock()
			s.errors[502]++ // an engine died mid-stream: an OpenAI error event
			s.mu.Unlock()
			return
		case strings.HasSuffix(str, "data: [DONE]\n\n") && strings.Count(str, `"content"`) >= tokens:
			ok = true
		}
	} else if embed {
		var e struct {
			Data []struct {
				Embedding []float64 `json:"embedding"`
			} `json:"data"`
		}
		ok = json.Unmarshal(b, &e) == nil && len(e.Data) == 2 && len(e.Data[1].Embedding) > 0
	} else {
		var c struct {
			Choices []struct{} `json:"choices"`
		}
		ok = json.Unmarshal(b, &c) == nil && len(c.Choices) == 1
	}
	if !ok {
		s.fail(fmt.Sprintf("incomplete answer (stream=%v): %s", stream, tail(string(b), 300)))
		return
	}
	s.mu.Lock()
	s.completions++
	s.latencies = append(s.latencies, time.Since(start))
	s.mu.Unlock()
}
