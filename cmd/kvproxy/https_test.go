package main

import (
	"encoding/json"
	"encoding/pem"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// kvproxy checks an https engine's certificate against the system's roots,
// which SSL_CERT_FILE extends with a private CA: a process started with the
// engine's CA in it proxies to the engine, certificate verified.
func TestHTTPSEngineTrustedThroughSSLCertFile(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"over tls"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`)
	}))
	srv.StartTLS()
	defer srv.Close()
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "kvproxy.yaml")
	if err := os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nlog_level: info\nmodels:\n  - {name: m, tokenizer: o200k_base}\n"+
		"backends:\n  - {id: a, url: \"https://"+srv.Listener.Addr().String()+"\", model: m, kind: openai}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startChild(t, cfg, "SSL_CERT_FILE="+ca)
	var v struct{ Listen string }
	if err := json.Unmarshal([]byte(c.waitLine("kvproxy serving", nil)), &v); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post("http://"+v.Listen+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), "over tls") {
		t.Fatalf("%d %s\n%s", resp.StatusCode, b, c.output())
	}
}
