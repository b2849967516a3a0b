package proxy

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"
)

// A client that sends its whole body before it reads (Go's net/http,
// Python's urllib) gets kvproxy's answer to a body over the limit, not
// "connection reset by peer": kvproxy drains at most 8 MiB before it
// answers, and closing on the unread rest made the kernel reset the
// connection, the answer with it (the benchmark trial's kvbench replay of
// a 16M-token line). The connection closes after the answer once the
// client has sent its body or gone quiet, as nginx's lingering close does.
func TestBodyOverTheLimitIsAnsweredToAClientStillSending(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {max_request_body_bytes: 65536}\n", e)
	body := bytes.Repeat([]byte("x"), 48<<20)
	for _, declared := range []bool{true, false} {
		var r io.Reader = bytes.NewReader(body)
		if !declared {
			r = io.MultiReader(r) // no length: chunked
		}
		resp, err := http.Post(p.url+"/v1/completions", "application/json", r)
		if err != nil {
			t.Fatalf("declared %v: %v", declared, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 413 || !strings.Contains(string(b), "request_too_large") {
			t.Fatalf("declared %v: %d %s", declared, resp.StatusCode, b)
		}
	}
}
