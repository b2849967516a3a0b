package config

import (
	"strings"
	"testing"
)

const discoverYAML = `models: [{name: m}]
backends:
  - {id: fixed, url: "http://10.0.0.9:8000"}
  - id: pool
    url: http://vllm.default.svc.cluster.local:8000
    discover: dns
    kv_events: {mode: zmq, endpoint: "tcp://vllm.default.svc.cluster.local:5557", replay: "tcp://vllm.default.svc.cluster.local:5558"}
`

// A template stands for one backend per address, named by it, the address
// in its url and in the KV event endpoints; with none it stands for no
// backend, and a configuration of templates alone is valid then.
func TestExpandDiscoveryTemplates(t *testing.T) {
	c, err := Parse([]byte(discoverYAML))
	if err != nil {
		t.Fatal(err)
	}
	if ts := c.Templates(); len(ts) != 1 || ts[0].DiscoverInterval.String() != "10s" || ts[0].DiscoverHost() != "vllm.default.svc.cluster.local" {
		t.Fatalf("templates %+v", ts)
	}
	x, skipped, err := c.Expand(map[string][]string{"pool": {"10.0.0.5", "fd00::7", "10.0.0.9"}})
	if err != nil {
		t.Fatal(err)
	}
	// 10.0.0.9:8000 is the static backend's engine: left out, said why.
	if len(skipped) != 1 || !strings.HasPrefix(skipped[0], "pool@10.0.0.9 (http://10.0.0.9:8000)") {
		t.Errorf("skipped %q", skipped)
	}
	var got []string
	for _, b := range x.Backends {
		got = append(got, b.ID+" "+b.URL+" "+b.KVEvents.Endpoint+" "+b.KVEvents.Replay)
	}
	want := []string{
		"fixed http://10.0.0.9:8000  ",
		"pool@10.0.0.5 http://10.0.0.5:8000 tcp://10.0.0.5:5557 tcp://10.0.0.5:5558",
		"pool@fd00::7 http://[fd00::7]:8000 tcp://[fd00::7]:5557 tcp://[fd00::7]:5558",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("expanded:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if len(c.Backends) != 2 || c.Backends[1].Discover != DiscoverDNS {
		t.Fatal("Expand changed the template configuration")
	}
	only, err := Parse([]byte("models: [{name: m}]\nbackends: [{id: pool, url: 'http://engines:8000', discover: dns}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if x, _, err := only.Expand(nil); err != nil || len(x.Backends) != 0 || len(x.Templates()) != 0 {
		t.Fatalf("no address: %v, %+v", err, x)
	}
	if withHost("tcp://vllmx:5557", "vllm", "10.0.0.1") != "tcp://vllmx:5557" {
		t.Error("a longer name that starts with the host was rewritten")
	}
	// A dual-stack name: the IPv4 addresses, one per engine; IPv6 only
	// when that is all.
	if got := ResolvedAddrs([]string{"10.0.0.2", "10.0.0.1", "10.0.0.2", "FD00:0::7"}); strings.Join(got, ",") != "10.0.0.1,10.0.0.2" {
		t.Errorf("resolved %v", got)
	}
	if got := ResolvedAddrs([]string{"FD00:0::7", "fd00::6"}); strings.Join(got, ",") != "fd00::6,fd00::7" {
		t.Errorf("resolved %v", got)
	}
	if withHost("tcp://VLLM.default:5557", "vllm.DEFAULT", "10.0.0.1") != "tcp://10.0.0.1:5557" {
		t.Error("the host is a name: in any case")
	}
	// Letters whose lower case is longer moved the index (the second
	// review: a panic while reading the file).
	if got := withHost("tcp://ȺȺȺȺȺȺ//h", "h", "10.0.0.1"); got != "tcp://ȺȺȺȺȺȺ//10.0.0.1" {
		t.Errorf("withHost: %q", got)
	}
	// A prefill engine beside a decoding template that stands for none
	// is a model that waits for its engines, not a mistake.
	pd, err := Parse([]byte("models: [{name: m}]\nbackends:\n  - {id: pre, url: 'http://10.0.0.9:8000', role: prefill}\n  - {id: dec, url: 'http://dec:8000', discover: dns}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := pd.Expand(nil); err != nil {
		t.Errorf("prefill engine and a template of none: %v", err)
	}
}

func TestDiscoveryValidation(t *testing.T) {
	for name, tc := range map[string]struct{ line, want string }{
		"unknown mode":          {`{id: a, url: "http://engines:8000", discover: srv}`, "backends[0].discover: want dns"},
		"mock":                  {`{id: a, url: "http://127.0.0.1:9000", kind: mock, discover: dns}`, "backends[0].discover: a mock backend"},
		"https":                 {`{id: a, url: "https://engines", discover: dns}`, "backends[0].discover: needs an http url"},
		"interval too short":    {`{id: a, url: "http://engines:8000", discover: dns, discover_interval: 100ms}`, "backends[0].discover_interval: must be at least 1s"},
		"interval, no discover": {`{id: a, url: "http://engines:8000", discover_interval: 5s}`, "backends[0].discover_interval: only applies with discover"},
		"user info":             {`{id: a, url: "http://u:p@engines:8000", discover: dns}`, "backends[0].url: with discover, no user info"},
		"events elsewhere": {`{id: a, url: "http://engines:8000", discover: dns, kv_events: {mode: zmq, endpoint: "tcp://events:5557"}}`,
			"backends[0].kv_events: with discover, the endpoints must name the url's host"},
	} {
		_, err := Parse([]byte("models: [{name: m}]\nbackends:\n  - " + tc.line + "\n"))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}
}
