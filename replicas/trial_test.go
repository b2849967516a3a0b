package replicas

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/router"
)

// logLines is the log's lines whose message is msg, decoded.
func logLines(logs string, msg string) []map[string]any {
	var out []map[string]any
	for _, l := range strings.Split(logs, "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["message"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// The "left" line names the replica as the "joined" line does, by its id,
// with its instance as a field of its own: it said "proxy-b/782f1ab0c635d60b"
// (found by the replicas user trial).
func TestLeftLogNamesTheReplicaAsJoinedDoes(t *testing.T) {
	url := startNATS(t).ClientURL()
	_, logs := startLogged(t, Config{URL: url, ID: "proxy-a", Interval: 20 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	b := start(t, url, "proxy-b", []Entry{{Model: "m", Worker: "e0", Load: router.Load{Inflight: 1}}}, newSink())
	const joined, left = "replicas: a replica reports; its load counts", "replicas: a replica stopped reporting; its load no longer counts"
	waitLog := func(msg string) map[string]any {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if ls := logLines(logs.String(), msg); len(ls) > 0 {
				return ls[0]
			}
			if time.Now().After(deadline) {
				t.Fatalf("no %q line: %s", msg, logs.String())
			}
		}
	}
	j := waitLog(joined)
	b.Close()
	l := waitLog(left)
	if j["replica"] != "proxy-b" || l["replica"] != "proxy-b" || l["instance"] != b.instance || j["instance"] != b.instance {
		t.Fatalf("joined %v, left %v (instance %s)", j, l, b.instance)
	}
}
