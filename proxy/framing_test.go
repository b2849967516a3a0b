package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// rawExchange writes req on a new connection to the proxy and returns all it
// answers until it closes the connection (or 3 s pass: closed is false).
func rawExchange(t *testing.T, p *testProxy, req string) (answer string, closed bool) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	io.WriteString(c, req)
	b, err := io.ReadAll(c)
	return string(b), err == nil
}

// A request with both Content-Length and Transfer-Encoding is refused and
// its connection closed: the bytes after its chunked body, a request to a
// front proxy that reads Content-Length, are never served (they were, as a
// second request on a connection kept open; the security review).
func TestBothContentLengthAndChunkedRefused(t *testing.T) {
	p := startProxy(t, "kv", startFake(t, "e0", nil))
	body := `{"model":"m","prompt":"hi"}`
	chunked := "1b\r\n" + body + "\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
	for _, head := range []string{
		"Content-Length: 64\r\nTransfer-Encoding: chunked\r\n",
		"Transfer-Encoding: chunked\r\ncontent-LENGTH: 64\r\n",
	} {
		answer, closed := rawExchange(t, p, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+head+"\r\n"+chunked)
		resp, err := http.ReadResponse(bufio.NewReader(strings.NewReader(answer)), nil)
		if err != nil || resp.StatusCode != 400 || !resp.Close || !strings.Contains(answer, `"code":"ambiguous_framing"`) {
			t.Fatalf("%q: %v\n%s", head, err, answer)
		}
		if !closed || strings.Count(answer, "HTTP/1.1 ") != 1 {
			t.Fatalf("%q: the connection went on (closed %v):\n%s", head, closed, answer)
		}
	}
	// A coding other than chunked is refused, 400 as RFC 9112 §6.3 has it, and
	// the connection closed: fasthttp ignored identity, and read the body
	// as the next request (the HTTP trial reached /admin/backends so).
	for _, head := range []string{"Transfer-Encoding: identity\r\n", "transfer-encoding: IDENTITY\r\nContent-Length: 27\r\n",
		"Transfer-Encoding: gzip\r\n", "Transfer-Encoding: gzip, chunked\r\n", "Transfer-Encoding: chunked, gzip\r\n"} { // the last three fasthttp refuses itself
		smuggled := "GET /admin/backends HTTP/1.1\r\nHost: x\r\n\r\n"
		if strings.Contains(head, "Length") {
			smuggled = body + smuggled
		}
		answer, closed := rawExchange(t, p, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+head+"\r\n"+smuggled)
		if !strings.HasPrefix(answer, "HTTP/1.1 400 ") || !strings.Contains(answer, `"code":"unsupported_transfer_encoding"`) ||
			!closed || strings.Count(answer, "HTTP/1.1 ") != 1 {
			t.Fatalf("%q: closed %v:\n%s", head, closed, answer)
		}
	}
	// On /v1/messages, in Anthropic's shape, as every error there is.
	answer, _ := rawExchange(t, p, "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
	if !strings.HasPrefix(answer, "HTTP/1.1 400 ") || !strings.Contains(answer, `{"type":"error","error":{"type":"invalid_request_error"`) {
		t.Fatalf("ambiguous framing on /v1/messages:\n%s", answer)
	}
	// Chunked alone is served.
	answer, _ = rawExchange(t, p, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n1b\r\n"+body+"\r\n0\r\n\r\n")
	if !strings.HasPrefix(answer, "HTTP/1.1 200 ") {
		t.Fatalf("a chunked request: %s", answer)
	}
	p.waitIdle(t)
}

// Connection: close is heard in any case and in a list (RFC 9110 §7.6.1):
// the connection closes after the answer. fasthttp heard only "close".
func TestConnectionCloseInAnyCase(t *testing.T) {
	p := startProxy(t, "kv", startFake(t, "e0", nil))
	for _, v := range []string{"close", "Close", "CLOSE", "keep-alive, close", "close, x-foo"} {
		answer, closed := rawExchange(t, p, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: "+v+"\r\n\r\n")
		if !closed || !strings.HasPrefix(answer, "HTTP/1.1 200 ") {
			t.Errorf("Connection: %s: closed %v\n%s", v, closed, answer)
		}
	}
	if hasToken([]byte("keep-alive, closed"), "close") || hasToken([]byte("xclose"), "close") {
		t.Error("a token that is not close")
	}
}

// Paths fasthttp would resolve to another endpoint are refused, whatever
// their encoding; ordinary paths, queries with dots and model ids with
// dots or an encoded slash are not.
func TestDotSegments(t *testing.T) {
	for target, want := range map[string]bool{
		"/v1/chat/completions":                  false,
		"/v1/models/meta-llama%2FLlama-3.1-8B":  false,
		"/v1/models/Qwen2.5-7B...x":             false,
		"/metrics?x=/../admin":                  false,
		"/v1/responses/resp_1.2":                false,
		"/%6detrics":                            false, // the same resource, RFC 3986 6.2.2.2
		"/v1/../metrics":                        true,
		"/v1/%2e%2e/metrics":                    true,
		"/v1/%2E./metrics":                      true,
		"/v1/..%2fmetrics":                      true,
		"/live%2f..%2fmetrics":                  true,
		"/v1/./chat/completions":                true,
		"/v1/%2e/chat/completions":              true,
		"/v1/models/..":                         true,
		"/v1/..%5cadmin/backends":               true,
		"http://h/v1/%2e%2e/admin/backends?a=b": true,
		"/v1/models/%2":                         false,
	} {
		if got := dotSegments([]byte(target)); got != want {
			t.Errorf("dotSegments(%q) = %v, want %v", target, got, want)
		}
	}
}

func TestCommentsOnly(t *testing.T) {
	for ev, want := range map[string]bool{
		": ping - 2026-11-25 04:00:00\n":   true,
		":\r\n: keep-alive\r\n":            true,
		"\n\n":                             true,
		"  : indented ping":                true,
		"data: {}\n":                       false,
		": ping\ndata: {}\n":               false,
		"event: response.created\n":        false,
		"  data: indented\n":               false,
		"retry: 10\n":                      false,
		"garbage without a field at all\n": false,
	} {
		if got := commentsOnly([]byte(ev)); got != want {
			t.Errorf("commentsOnly(%q) = %v, want %v", ev, got, want)
		}
	}
}
