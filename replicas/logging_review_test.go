package replicas

import (
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/kvproxy/kvproxy/router"
)

// While NATS is down the reports are not kept to be sent later (they would
// reach the others stale, megabytes at once, when it is back) and the
// outage is said once, not a warning per interval for as long as it lasts.
func TestOutageLogsOnceAndKeepsNoReports(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	// ~100 KB a report, every 10 ms: nats.go's default reconnect buffer
	// (8 MB) filled within a second.
	loads := make([]Entry, 1500)
	for i := range loads {
		loads[i] = Entry{Model: "model", Worker: fmt.Sprintf("worker-%04d", i), Load: router.Load{Inflight: 1}}
	}
	a, logs := startLogged(t, Config{URL: url, ID: "a", Interval: 10 * time.Millisecond},
		func() []Entry { return loads }, func(map[Key]router.Load) {})
	for i := 0; i < 200; i++ {
		a.Publish()
	}
	time.Sleep(300 * time.Millisecond) // the loop's own reports meanwhile
	if n := strings.Count(logs.String(), "replicas: publish"); n > 0 {
		t.Fatalf("%d publish warnings while NATS is down: %.600s", n, logs.String())
	}
	if p, _ := a.nc.Buffered(); p > 0 {
		t.Fatalf("%d bytes of reports kept to send once NATS is back", p)
	}
}

// A malformed report on the subject (another program, another version) is
// warned about once, not at every one of its reports.
func TestMalformedReportsWarnOnce(t *testing.T) {
	url := startNATS(t).ClientURL()
	_, logs := startLogged(t, Config{URL: url, ID: "a", Interval: 20 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	ks := newSink()
	start(t, url, "b", []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 1}}}, ks)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	for i := 0; i < 50; i++ {
		nc.Publish("kvproxy.load", []byte(`garbage`))
	}
	nc.Flush()
	// A well-formed report from nc after the garbage: once it is in, the
	// garbage before it has been handled too (one connection, in order).
	b, _ := jsonReport("z")
	nc.Publish("kvproxy.load", b)
	nc.Flush()
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(logs.String(), `"replica":"z"`); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("z's report never arrived: %s", logs.String())
		}
	}
	if n := strings.Count(logs.String(), "malformed load report"); n != 1 {
		t.Fatalf("%d malformed-report warnings for 50 reports, want 1", n)
	}
}

func jsonReport(id string) ([]byte, error) {
	return json.Marshal(report{Replica: id, Instance: id, Loads: []Entry{{Model: "m", Worker: "e9"}}})
}

// A report the server refuses (over its max_payload) is warned about once,
// not at every interval; a smaller one goes out again.
func TestPublishErrorWarnsOnce(t *testing.T) {
	ns := startNATSWith(t, &server.Options{Port: -1, MaxPayload: 2048})
	big := make([]Entry, 100)
	for i := range big {
		big[i] = Entry{Model: "m", Worker: fmt.Sprint("w", i), Load: router.Load{Inflight: 1}}
	}
	var mu sync.Mutex
	loads := big
	a, logs := startLogged(t, Config{URL: ns.ClientURL(), ID: "a", Interval: time.Hour},
		func() []Entry { mu.Lock(); defer mu.Unlock(); return loads }, func(map[Key]router.Load) {})
	for i := 0; i < 20; i++ {
		a.Publish()
	}
	if n := strings.Count(logs.String(), "replicas: publish"); n != 1 {
		t.Fatalf("%d publish warnings for 20 refused reports, want 1: %s", n, logs.String())
	}
	mu.Lock()
	loads = big[:1]
	mu.Unlock()
	a.Publish() // goes out: the next refusal is news again
	mu.Lock()
	loads = big
	mu.Unlock()
	a.Publish()
	if n := strings.Count(logs.String(), "replicas: publish"); n != 2 {
		t.Fatalf("%d publish warnings, want 2: %s", n, logs.String())
	}
}
