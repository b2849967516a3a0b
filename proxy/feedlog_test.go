package proxy

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// An event feed's problems reach the log (they used to show only in
// /admin/backends): a warning per problem, not one per retry while it
// lasts, and a line when the feed connects again.
func TestFeedLogWarnsOncePerProblem(t *testing.T) {
	var buf bytes.Buffer
	f := &feedLog{log: zerolog.New(&buf), backend: "e0"}
	for _, p := range []string{"", "", "dial tcp://x: refused", "dial tcp://x: refused", "dial tcp://x: refused", "", "cleared: engine restarted",
		"connection to tcp://x lost: EOF", "dial tcp://x: refused", "dial tcp://x: refused"} {
		f.change(p)
	}
	out := buf.String()
	if n := strings.Count(out, "kv event feed connected"); n != 2 {
		t.Errorf("%d connection lines, want 2 (the first, and the end of the problem):\n%s", n, out)
	}
	if n := strings.Count(out, "kv event feed problem"); n != 4 {
		t.Errorf("%d problem lines, want 4 (one for the first three failed dials, the clear, the lost connection, one for the last two dials):\n%s", n, out)
	}
	if !strings.Contains(out, `"problem":"cleared: engine restarted"`) || !strings.Contains(out, `"backend":"e0"`) {
		t.Errorf("lines lack the backend or the problem:\n%s", out)
	}
}

// A backend whose event endpoint is wrong is logged at once; the feeds of
// its data-parallel ranks share the log (run with -race: they call it at
// the same time).
func TestWrongEventEndpointIsLogged(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m, kv_events: {mode: zmq, endpoint: 'tcp://127.0.0.1:1', dp_size: 4}}]\n", e)
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(p.logs.String(), "kv event feed problem"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no warning for an event feed that cannot connect:\n%s", p.logs.String())
		}
	}
	if !strings.Contains(p.logs.String(), "dial tcp://127.0.0.1:") {
		t.Fatalf("the warning does not say which endpoint:\n%s", p.logs.String())
	}
	time.Sleep(time.Second) // the ranks' feeds retry meanwhile

}
