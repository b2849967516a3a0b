package main

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// runCheck runs kvproxy -check on a config of yaml and returns its exit
// code, standard output and standard error.
func runCheck(t *testing.T, yaml string) (int, string, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kvproxy.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	c := &command{stdout: &out, stderr: &errOut}
	code := c.run([]string{"-check", "-config", path})
	return code, out.String(), errOut.String()
}

// -check starts nothing: with the listen address and a simulated engine's
// port held by others, a start would fail, the check says valid.
func TestCheckStartsNothing(t *testing.T) {
	held := make([]net.Listener, 2)
	for i := range held {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		held[i] = ln
	}
	yaml := "listen: " + held[0].Addr().String() + "\nreplicas: {subject: kvproxy.load}\n" +
		"models: [{name: m, tokenizer: cl100k_base, template: chatml}]\nbackends:\n" +
		"  - {id: sim, url: 'http://" + held[1].Addr().String() + "', model: m, kind: mock}\n" +
		"  - {id: real, url: 'http://127.0.0.1:1', model: m}\n"
	code, out, errOut := runCheck(t, yaml)
	if code != 0 || !strings.Contains(out, "is valid (1 model, 2 backends)") {
		t.Fatalf("exit %d, stdout %q, stderr:\n%s", code, out, errOut)
	}
	if strings.Contains(errOut, "kvproxy starting") || strings.Contains(errOut, "simulated engine started") {
		t.Fatalf("the check started something:\n%s", errOut)
	}
	if !strings.Contains(errOut, `"setting":"replicas.nats"`) {
		t.Fatalf("the start's warning of a replicas block without nats is missing:\n%s", errOut)
	}
}

// A chat template that does not parse passes the file's own checks (the
// file is there): a start would fail building the model, and so does the
// check, whether a simulated engine or the proxy's model reads it first.
func TestCheckBuildsTemplates(t *testing.T) {
	tc := filepath.Join(t.TempDir(), "tokenizer_config.json")
	if err := os.WriteFile(tc, []byte(`{"chat_template": "{% for m in messages %}{{ m.content "}`), 0o644); err != nil {
		t.Fatal(err)
	}
	models := "models: [{name: m, tokenizer: cl100k_base, template: " + strconv.Quote(tc) + "}]\nbackends:\n"
	for backend, says := range map[string]string{
		// Named by the model's field and line, a simulated engine's too
		// (it named only the engine: the twenty-ninth session's trial).
		"  - {id: sim, url: 'http://127.0.0.1:1', model: m, kind: mock}\n": "model m: models[0].template (line 1): ",
		"  - {id: real, url: 'http://127.0.0.1:1', model: m}\n":            "model m: models[0].template (line 1): ",
	} {
		code, out, errOut := runCheck(t, models+backend)
		if code != 1 || out != "" || !strings.Contains(errOut, says) || !strings.Contains(errOut, "chat template") {
			t.Errorf("%s: exit %d, stdout %q, stderr:\n%s", backend, code, out, errOut)
		}
	}
	if code, _, errOut := runCheck(t, "models: [\n"); code != 2 || !strings.Contains(errOut, "yaml") {
		t.Errorf("a file that does not parse: exit %d, stderr:\n%s", code, errOut)
	}
}

// -listen is checked as the file's listen is: -check passed "localhost",
// which a start refused with "missing port in address" (the twenty-ninth
// session's trial).
func TestCheckListenFlag(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kvproxy.yaml")
	if err := os.WriteFile(path, []byte("models: [{name: m}]\nbackends: [{id: a, url: 'http://127.0.0.1:1', model: m}]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, start := range []bool{true, false} {
		var out, errOut bytes.Buffer
		c := &command{stdout: &out, stderr: &errOut}
		args := []string{"-config", path, "-listen", "localhost"}
		if !start {
			args = append(args, "-check")
		}
		if code := c.run(args); code != 2 || !strings.Contains(errOut.String(), `kvproxy: -listen: want host:port, got "localhost"`) {
			t.Fatalf("%v: exit %d, stderr:\n%s", args, code, errOut.String())
		}
	}
}
