package config

import (
	"strings"
	"testing"
)

// A fractional number for a whole-number field is an error naming the
// field; yaml.v3 alone would take `fall: 1.5` as 1 (found by the seventh
// session's trial). Whole numbers written as floats, floats where floats
// belong and durations still load.
func TestFractionalCountsAreRejected(t *testing.T) {
	base := "models: [{name: m}]\nbackends: [{id: e0, url: 'http://127.0.0.1:9', model: m, max_concurrency: %s}]\nhealth: {fall: %s}\nrouter: {temperature: 0.5, cost: {prefill_ms_per_token: 0.02}}\nlimits: {stream_idle_timeout: 1.5s}\n"
	for _, c := range []struct{ conc, fall, err string }{
		{"4", "1.5", "health.fall: 1.5 is not a whole number"},
		{"2.5", "2", "backends[0].max_concurrency: 2.5 is not a whole number"},
		{"4", "2", ""},
		{"1e1", "2.0", ""},
	} {
		_, err := Parse([]byte(fill(base, c.conc, c.fall)))
		switch {
		case c.err == "" && err != nil:
			t.Errorf("max_concurrency %s, fall %s: %v", c.conc, c.fall, err)
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("max_concurrency %s, fall %s: %v, want %q", c.conc, c.fall, err, c.err)
		}
	}
}

func fill(s string, vals ...string) string {
	for _, v := range vals {
		s = strings.Replace(s, "%s", v, 1)
	}
	return s
}

func TestHTTPSBackendURLs(t *testing.T) {
	for _, c := range []struct{ backend, err string }{
		{"{id: e0, url: 'https://engine.example:8443', model: m}", ""},
		{"{id: e0, url: 'https://engine.example', model: m, insecure_skip_verify: true}", ""},
		{"{id: e0, url: 'http://engine.example:8000', model: m, insecure_skip_verify: true}", "backends[0].insecure_skip_verify: only applies to an https url"},
		{"{id: e0, url: 'https://127.0.0.1:9000', model: m, kind: mock}", "a mock backend serves plain http"},
		{"{id: e0, url: 'ftp://engine.example', model: m}", "want http://host:port or https://host[:port]"},
		// A port out of range was accepted, and the engine ejected at its
		// first request (found by the fourteenth session's operator trial).
		{"{id: e0, url: 'http://127.0.0.1:99999', model: m}", "backends[0].url: port must be 1-65535"},
		{"{id: e0, url: 'http://127.0.0.1:0', model: m}", "backends[0].url: port must be 1-65535"},
		{"{id: e0, url: 'http://127.0.0.1:65535', model: m}", ""},
	} {
		_, err := Parse([]byte("models: [{name: m}]\nbackends: [" + c.backend + "]\n"))
		switch {
		case c.err == "" && err != nil:
			t.Errorf("%s: %v", c.backend, err)
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%s: %v, want %q", c.backend, err, c.err)
		}
	}
}
