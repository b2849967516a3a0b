package config

import (
	"fmt"
	"strings"
	"testing"
)

// lineWith is the number of the line of doc that holds s (once).
func lineWith(t *testing.T, doc, s string) int {
	t.Helper()
	n := 0
	for i, l := range strings.Split(doc, "\n") {
		if strings.Contains(l, s) {
			if n != 0 {
				t.Fatalf("%q is on lines %d and %d", s, n, i+1)
			}
			n = i + 1
		}
	}
	if n == 0 {
		t.Fatalf("%q is not in the document", s)
	}
	return n
}

// Each problem Validate finds in a file names its line there: the
// field's key, or the entry of a field left out. The lines are the file's,
// not those of the document as re-encoded after ${VAR} expansion (which
// drops blank lines and gives a multi-line value its own lines).
func TestValidationNamesFileLines(t *testing.T) {
	t.Setenv("KVP_LINES_SECRET", "one\ntwo\nthree\nfour")
	t.Setenv("KVP_LINES_POLICY", "fastest")
	doc := `# a file as an operator writes it

auth:
  cache_salt_secret: "${KVP_LINES_SECRET}"

  keys:
    - {key: short, tenant: a}
    - key: long-enough-key

listen: no-port

models:
  - name: m
    # the template
    template: no-such-template

backends:
  - id: a
    url: http://127.0.0.1:9000
    role: decode
  - url: http://127.0.0.1:9001

limits:
  max_request_body_bytes: 10
router:
  policy: ${KVP_LINES_POLICY}
`
	_, err := Parse([]byte(doc))
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{
		fmt.Sprintf(`listen: want host:port, got "no-port" (line %d)`, lineWith(t, doc, "listen:")),
		fmt.Sprintf(`models[0].template: unknown template "no-such-template" (want chatml, llama3, raw, or the path of a tokenizer_config.json) (line %d)`, lineWith(t, doc, "template:")),
		fmt.Sprintf(`backends[0].role: want both or prefill, got "decode" (line %d)`, lineWith(t, doc, "role:")),
		fmt.Sprintf(`backends[1].id: required (line %d)`, lineWith(t, doc, "9001")), // left out: its entry
		fmt.Sprintf(`limits.max_request_body_bytes: must be between 1024 and 1099511627776 (1 TiB), got 10 (line %d)`, lineWith(t, doc, "max_request_body_bytes")),
		fmt.Sprintf(`router.policy: unknown policy "fastest" (known: %s) (line %d)`, strings.Join(Policies, ", "), lineWith(t, doc, "policy:")),
		fmt.Sprintf(`auth.keys[0].key: must be at least 8 characters (line %d)`, lineWith(t, doc, "key: short")),
		fmt.Sprintf(`auth.keys[1].tenant: required (line %d)`, lineWith(t, doc, "long-enough-key")),
	} {
		if !strings.Contains(err.Error()+";", want+";") {
			t.Errorf("%v\ndoes not say %q", err, want)
		}
	}
	if n := strings.Count(err.Error(), "(line "); n != 8 {
		t.Errorf("%d lines named, want 8: %v", n, err)
	}

	// A top-level field left out has no line (the document is no place),
	// nor has a configuration built in code.
	_, err = Parse([]byte("\n\nlisten: 127.0.0.1:1\n"))
	if err == nil || !strings.Contains(err.Error(), "models: at least one model is required;") || !strings.Contains(err.Error(), "backends: at least one backend is required") {
		t.Fatalf("%v", err)
	}
	c := Config{Listen: "no-port", Models: []Model{{Name: "m"}}}
	c.applyDefaults()
	if err := c.Validate(); err == nil || strings.Contains(err.Error(), "(line") || !strings.Contains(err.Error(), `listen: want host:port, got "no-port"`) {
		t.Fatalf("built in code: %v", err)
	}
}

// A parse error, and a fractional whole number, name the file's line too.
func TestParseErrorsNameFileLines(t *testing.T) {
	t.Setenv("KVP_LINES_SECRET", "one\ntwo\nthree")
	head := "auth: {cache_salt_secret: \"${KVP_LINES_SECRET}\"}\n\n\nmodels: [{name: m}]\n\nbackends: [{id: a, url: 'http://127.0.0.1:9000'}]\n\n"
	for _, c := range []struct{ tail, marker, want string }{
		{"router:\n\n  index_ttl: soon\n", "index_ttl", "router.index_ttl (line %d): cannot unmarshal"},
		{"health:\n\n  fall: 1.5\n", "fall", "health.fall: 1.5 is not a whole number (line %d)"},
		{"limits:\n\n  max_queu: 3\n", "max_queu", "limits.max_queu (line %d): unknown field max_queu"},
		// Flow style: the field at fault, not the last of its line.
		{"limits: {idle_timeout: abc, body_memory_mb: 3}\n", "idle_timeout", "limits.idle_timeout (line %d): cannot unmarshal"},
		{"limits: {\n  idle_timeout: abc,\n  body_memory_mb: 3}\n", "idle_timeout", "limits.idle_timeout (line %d): cannot unmarshal"},
		// A key given twice: named where it comes again, with the first's
		// line. yaml named the first, with lines of the re-encoded
		// document, past the end of the file (the twenty-ninth session's
		// trial).
		{"limits:\n  max_queue: 1\nlimits: # again\n  max_queue: 2\n", "limits: # again", fmt.Sprintf("limits (line %%d): defined again, first at line %d", strings.Count(head, "\n")+1)},
		{"router:\n  policy: kv\n  policy: least_load\n", "policy: least_load", "router.policy (line %d): defined again, first at line"},
		// No Go type names (the same trial).
		{"health: fast\n", "health: fast", "health (line %d): cannot unmarshal !!str `fast` into a mapping"},
		{"tenants:\n  name: t\n", "name: t", "tenants.name (line %d): cannot unmarshal !!map into a list"},
	} {
		doc := head + c.tail
		_, err := Parse([]byte(doc))
		if want := fmt.Sprintf(c.want, lineWith(t, doc, c.marker)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%v\ndoes not say %q", err, want)
		}
	}
}

// Expand's backends are numbered as the expansion lists them, not as the
// file does: a problem of one names the line of its entry in the file (a
// discovered engine's: its template's). Its other fields may have been
// changed in code since the file was read (kvproxy -listen): no line.
func TestExpandNamesTemplateLines(t *testing.T) {
	doc := `models: [{name: m}]
backends:
  - id: pool
    url: http://engines:8000
    discover: dns
    kv_events:
      mode: zmq
      endpoint: tcp://engines:5557
  - id: fixed
    url: http://10.0.0.9:8000
`
	c, err := Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	// 0.0.0.0 as an engine's address makes its endpoint one to bind.
	_, _, err = c.Expand(map[string][]string{"pool": {"10.0.0.5", "0.0.0.0"}})
	want := fmt.Sprintf(`backends[2].kv_events.endpoint: zmq mode needs a publisher endpoint (the engine's address: 0.0.0.0 is what the engine binds, kvproxy connects), got "tcp://0.0.0.0:5557" (line %d)`, lineWith(t, doc, "endpoint:"))
	if err == nil || err.Error() != want {
		t.Fatalf("%v\nwant %s", err, want)
	}
	c.Listen = "no-port" // as -listen sets it
	_, _, err = c.Expand(map[string][]string{"pool": {"10.0.0.5"}})
	if err == nil || err.Error() != `listen: want host:port, got "no-port"` {
		t.Fatalf("%v", err)
	}
}
