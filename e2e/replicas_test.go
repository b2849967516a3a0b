package e2e

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvproxy/kvproxy/internal/testutil"
)

// Two kvproxy replicas in front of the same engines share their in-flight
// load over a real NATS server: while replica B's streams keep engine e0
// busy, replica A sends its own requests to e1, and once B is killed its
// load stops counting at A within a few reporting intervals.
func TestReplicasShareLoadOverNATS(t *testing.T) {
	ns := testutil.StartNATS(t, &server.Options{Port: -1})

	engines := fleet(t, 2, "-speedup", "1")
	addrs := map[string]string{"e0": engines[0], "e1": engines[1]}
	replica := func(id string) (string, *proc) {
		url, p, _ := startProxyConfig(t, backendsYAML(addrs, fmt.Sprintf("replicas: {nats: '%s', id: %s, interval: 50ms}\n", ns.ClientURL(), id)))
		return url, p
	}
	urlA, procA := replica("a")
	urlB, procB := replica("b")

	// B: four long streams pinned to e0.
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			body := fmt.Sprintf(`{"model":"default","stream":true,"max_tokens":2000,"ignore_eos":true,"messages":[{"role":"user","content":"long story %d"}],"nvext":{"backend_instance_id":"e0"}}`, i)
			resp, err := http.Post(urlB+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err == nil {
				io.Copy(io.Discard, resp.Body) // until B is killed
				resp.Body.Close()
			}
		}(i)
	}
	remote := func(id string) int64 {
		for _, r := range adminBackends(t, urlA) {
			if r.ID == id {
				return r.Remote.Inflight
			}
		}
		return -1
	}
	waitFor(t, 10*time.Second, "A to see B's four streams on e0", func() bool { return remote("e0") == 4 })
	metrics := func() string {
		resp, err := http.Get(urlA + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	if m := metrics(); !strings.Contains(m, "kvproxy_replicas_connected 1") || !strings.Contains(m, "kvproxy_replicas_peers 1") {
		t.Fatalf("A's metrics do not show it connected with one peer")
	}

	for i := 0; i < 6; i++ {
		body := fmt.Sprintf(`{"model":"default","max_tokens":2,"messages":[{"role":"user","content":"short question number %d about something else"}]}`, i)
		resp, err := http.Post(urlA+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if w := resp.Header.Get("x-kvproxy-worker"); resp.StatusCode != 200 || w != "e1" {
			t.Fatalf("request %d through A: %d from %q, while B keeps e0 busy", i, resp.StatusCode, w)
		}
	}

	procB.cmd.Process.Signal(syscall.SIGKILL)
	waitFor(t, 10*time.Second, "B's load to stop counting at A", func() bool { return remote("e0") == 0 })
	waitFor(t, 5*time.Second, "A to count no peer", func() bool { return strings.Contains(metrics(), "kvproxy_replicas_peers 0") })
	if out := procA.String(); !strings.Contains(out, "replicas: connected to NATS") || !strings.Contains(out, "replicas: a replica reports") ||
		!strings.Contains(out, "replicas: a replica stopped reporting") {
		t.Fatalf("A's log does not tell the replicas' story:\n%s", out)
	}
	wg.Wait()
	assertIdle(t, urlA)
}
