package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
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

// A client that goes on sending after its answer is held no longer than
// limits.body_timeout when that is shorter than the linger (the last
// review: a fixed 10 s let slow senders hold connections an operator's
// timeouts would have closed).
func TestLingerIsBoundedByBodyTimeout(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {max_request_body_bytes: 65536, body_timeout: 1s}\n", e)
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
	chunk := strings.Repeat("x", 64<<10)
	for range 200 { // 12.5 MiB: past what kvproxy drains before it answers
		fmt.Fprintf(c, "%x\r\n%s\r\n", len(chunk), chunk)
	}
	rd := bufio.NewReader(c)
	resp, err := http.ReadResponse(rd, nil)
	if err != nil || resp.StatusCode != 413 {
		t.Fatalf("%v %v", resp, err)
	}
	start := time.Now()
	// Keep sending a little, never quiet for long: only the bound ends it.
	// Once kvproxy has closed for good, a write meets its reset.
	for time.Since(start) < 6*time.Second {
		if _, err := fmt.Fprintf(c, "1\r\nx\r\n"); err != nil {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if held := time.Since(start); held > 4*time.Second {
		t.Fatalf("the connection was held %v after its answer with body_timeout 1s", held)
	}
}

// A request refused before the handler (headers too large, malformed
// headers) is answered to a client still sending its body, as a body over
// the limit is: the connection closed on unread data reset the client,
// which lost the 431 (Python's urllib, Go's net/http; the HTTP trial; nginx
// answers it).
func TestHeaderRefusalIsAnsweredToAClientStillSending(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	req, err := http.NewRequest("POST", p.url+"/v1/completions", bytes.NewReader(bytes.Repeat([]byte("x"), 10<<20)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Cookie", strings.Repeat("c", 17000))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("a client still sending its body lost the answer: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 431 || !strings.Contains(string(b), "headers_too_large") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}
