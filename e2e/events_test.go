package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func eventBackends(es []engine, extra string) string {
	var b strings.Builder
	b.WriteString("models: [{name: mock-model, aliases: [default], block_size: 16}]\nbackends:\n")
	for i, e := range es {
		fmt.Fprintf(&b, "  - {id: mock-%d, url: 'http://%s', model: mock-model, kind: vllm, kv_events: {mode: zmq, endpoint: '%s', replay: '%s'}}\n", i, e.addr, e.pub, e.replay)
	}
	b.WriteString(extra)
	return b.String()
}

// engineBlocks is an engine's resident blocks as router-scheme hashes.
func engineBlocks(t *testing.T, addr string) []uint64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/debug/cache")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var dc struct {
		Blocks []struct {
			Hash uint64 `json:"hash"`
		} `json:"blocks"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&dc); err != nil {
		t.Fatal(err)
	}
	hs := make([]uint64, len(dc.Blocks))
	for i, b := range dc.Blocks {
		hs[i] = b.Hash
	}
	return hs
}

func indexHeld(t *testing.T, url string, hashes []uint64) map[string]int {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "mock-model", "hashes": hashes})
	resp, err := http.Post(url+"/admin/index/lookup", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Held map[string]int `json:"held"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("index lookup: %v %d", err, resp.StatusCode)
	}
	return out.Held
}

// precisionRecall compares an engine's true cache with the proxy's index.
func precisionRecall(t *testing.T, url string, id string, addr string) (float64, float64, int) {
	truth := engineBlocks(t, addr)
	held := indexHeld(t, url, truth)[id]
	var indexed int64
	for _, r := range adminBackends(t, url) {
		if r.ID == id {
			indexed = r.IndexedBlocks
		}
	}
	if len(truth) == 0 || indexed == 0 {
		return 0, 0, len(truth)
	}
	return float64(held) / float64(indexed), float64(held) / float64(len(truth)), len(truth)
}

func chat(t *testing.T, url, body string) *http.Response {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	return resp
}

func churnBody(r *rand.Rand, i int) string {
	sys := fmt.Sprintf("System prompt number %d. ", r.Intn(6))
	words := make([]string, 60+r.Intn(200))
	for j := range words {
		words[j] = fmt.Sprintf("w%d", r.Intn(5000))
	}
	b, _ := json.Marshal(map[string]any{"model": "default", "max_tokens": 4 + r.Intn(12),
		"messages": []map[string]string{{"role": "system", "content": strings.Repeat(sys, 30)}, {"role": "user", "content": strings.Join(words, " ")}}})
	return string(b)
}

// After a churn run that evicts, the index agrees with what the engines
// really hold.
func TestEventModeIndexMatchesEngines(t *testing.T) {
	es, _ := fleetWithEvents(t, 2, "-cache-blocks", "400", "-speedup", "50")
	url, _, _ := startProxyConfig(t, eventBackends(es, ""))
	r := rand.New(rand.NewSource(7))
	bodies := make([]string, 160)
	for i := range bodies {
		bodies[i] = churnBody(r, i)
	}
	var wg sync.WaitGroup
	next := make(chan string)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range next {
				chat(t, url, b)
			}
		}()
	}
	for _, b := range bodies {
		next <- b
	}
	close(next)
	wg.Wait()
	assertIdle(t, url)
	for i, e := range es {
		id := fmt.Sprintf("mock-%d", i)
		var p, rc float64
		var n int
		waitFor(t, 10*time.Second, "index to agree with "+id, func() bool {
			p, rc, n = precisionRecall(t, url, id, e.addr)
			return p >= 0.99 && rc >= 0.99
		})
		t.Logf("%s: %d resident blocks, precision %.4f recall %.4f", id, n, p, rc)
	}
	rows := adminBackends(t, url)
	for _, r := range rows {
		if r.KVEvents.Mode != "zmq" || r.KVEvents.Events == 0 {
			t.Fatalf("%s: event feed not used: %+v", r.ID, r.KVEvents)
		}
	}
	// The router prices KV memory with the capacity the engines report on
	// /metrics (scraped every second), not an estimate.
	waitFor(t, 5*time.Second, "the engines' reported capacity", func() bool {
		for _, r := range adminBackends(t, url) {
			if r.CacheBlocks != 400 {
				return false
			}
		}
		return true
	})
	if engineMetric(t, es[0].addr, "vllm:prefix_cache_queries_total") == 0 {
		t.Fatal("engine saw no queries")
	}
}

// An engine that dies loses its index entries; when it comes back, they
// are rebuilt from its new events.
func TestEngineRestartClearsAndRebuilds(t *testing.T) {
	hp := strings.Split(freePort(t), ":")[1]
	args := []string{"-base-port", hp, "-kv-events-base-port", fmt.Sprint(freePortPair(t)), "-speedup", "50"}
	es, mock := fleetWithEvents(t, 1, args...)
	url, _, _ := startProxyConfig(t, eventBackends(es, "health: {interval: 200ms, fall: 1, forget_after: 500ms}\n"))
	r := rand.New(rand.NewSource(1))
	for i := 0; i < 10; i++ {
		chat(t, url, churnBody(r, i))
	}
	waitFor(t, 5*time.Second, "blocks indexed", func() bool { return adminBackends(t, url)[0].IndexedBlocks > 0 })

	mock.cmd.Process.Signal(syscall.SIGKILL)
	mock.cmd.Wait()
	waitFor(t, 10*time.Second, "the dead engine's entries to go", func() bool { return adminBackends(t, url)[0].IndexedBlocks == 0 })

	es2, _ := fleetWithEvents(t, 1, args...)
	waitFor(t, 10*time.Second, "the engine to be healthy again", func() bool { return adminBackends(t, url)[0].Healthy })
	for i := 0; i < 10; i++ {
		chat(t, url, churnBody(r, i))
	}
	var p, rc float64
	waitFor(t, 10*time.Second, "entries rebuilt from the new engine", func() bool {
		p, rc, _ = precisionRecall(t, url, "mock-0", es2[0].addr)
		return p >= 0.99 && rc >= 0.99
	})
	assertIdle(t, url)
}

// Removing a backend from the configuration removes its index entries.
func TestRemovedBackendLeavesTheIndex(t *testing.T) {
	es, _ := fleetWithEvents(t, 2, "-speedup", "50")
	url, p, path := startProxyConfig(t, eventBackends(es, ""))
	r := rand.New(rand.NewSource(3))
	for i := 0; i < 6; i++ {
		b := churnBody(r, i)
		b = strings.Replace(b, `"model":"default"`, fmt.Sprintf(`"model":"default","nvext":{"backend_instance_id":"mock-%d"}`, i%2), 1)
		chat(t, url, b)
	}
	waitFor(t, 5*time.Second, "both backends indexed", func() bool {
		rows := adminBackends(t, url)
		return rows[0].IndexedBlocks > 0 && rows[1].IndexedBlocks > 0
	})
	truth := engineBlocks(t, es[1].addr)
	if indexHeld(t, url, truth)["mock-1"] == 0 {
		t.Fatal("mock-1's blocks should be indexed before the reload")
	}
	rewriteConfig(t, p, path, eventBackends(es[:1], ""))
	waitFor(t, 10*time.Second, "mock-1 to leave", func() bool {
		return len(adminBackends(t, url)) == 1 && indexHeld(t, url, truth)["mock-1"] == 0
	})
	if adminBackends(t, url)[0].IndexedBlocks == 0 {
		t.Fatal("the remaining backend lost its entries")
	}
	assertIdle(t, url)
}
