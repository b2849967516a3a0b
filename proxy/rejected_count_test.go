package proxy

import (
	"net/http"
	"strings"
	"testing"
)

// Requests kvproxy answers before an endpoint takes them (unknown path,
// wrong method) are counted in kvproxy_requests_total as every other
// answer is (the SDK trial saw 13 logged 404s and 7 counted), and a
// client's model name or path is cut in the log line: a 10 MB model made
// a 10 MB line (the security review).
func TestUnroutedCountedAndLogLinesBounded(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	for _, path := range []string{"/v1/audio/speech", "/v1/files/" + strings.Repeat("f", 5000)} {
		if resp, b := post(t, p.url+path, `{}`); resp.StatusCode != 404 {
			t.Fatalf("%s: %d %s", path[:20], resp.StatusCode, b)
		}
	}
	req, _ := http.NewRequest("DELETE", p.url+"/v1/models", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 {
		t.Fatalf("DELETE /v1/models: %d", resp.StatusCode)
	}
	long := strings.Repeat("é", 5000) // cut at a character's start
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"`+long+`","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 404 {
		t.Fatalf("unknown model: %d %s", resp.StatusCode, b)
	}
	m := p.metrics(t)
	for _, want := range []string{`kvproxy_requests_total{backend="",code="404"} 3`, `kvproxy_requests_total{backend="",code="405"} 1`} {
		if !strings.Contains(m, want) {
			t.Errorf("want %s:\n%s", want, grepLines(m, "requests_total"))
		}
	}
	lines := strings.Split(strings.TrimSpace(p.logs.String()), "\n")
	n := 0
	for _, l := range lines {
		if !strings.Contains(l, `"message":"request"`) {
			continue
		}
		n++
		if len(l) > 1000 {
			t.Errorf("a log line of %d bytes: %.300s", len(l), l)
		}
		if strings.Contains(l, "\\ufffd") || !strings.Contains(l, "…") && strings.Contains(l, "éé") {
			t.Errorf("the model is not cut at a character: %.400s", l)
		}
	}
	if n != 4 {
		t.Fatalf("want 4 access lines, got %d:\n%s", n, p.logs.String())
	}
}
