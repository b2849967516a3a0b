package proxy

import (
	"encoding/json"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// startTLSEngine serves an engine over https with httptest's self-signed
// certificate (valid for 127.0.0.1): /health, a vLLM /metrics page and a
// two-token chat stream. It returns the engine's host:port.
func startTLSEngine(t *testing.T) string {
	t.Helper()
	var addr string
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/health":
		case "/metrics":
			io.WriteString(w, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n")
		default:
			if r.TLS == nil || r.Host != addr { // the engine's name, as a virtual host needs it
				w.WriteHeader(400)
				return
			}
			w.Header().Set("Content-Type", "text/event-stream")
			for _, tok := range []string{"he", "llo"} {
				io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"content":"`+tok+`"}}]}`+"\n\n")
			}
			io.WriteString(w, "data: [DONE]\n\n")
		}
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshakes of untrusting clients
	srv.StartTLS()
	t.Cleanup(srv.Close)
	addr = srv.Listener.Addr().String()
	return addr
}

// An https engine is proxied and scraped over TLS (backends tests probe
// it); with insecure_skip_verify its self-signed certificate is accepted.
func TestHTTPSBackend(t *testing.T) {
	addr := startTLSEngine(t)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: e0, url: 'https://"+addr+"', model: m, insecure_skip_verify: true}]\n"+
		"health: {interval: 100ms}\n")
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"llo"`) || !strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	// Scrapes reach it too: its load is read.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		r, err := http.Get(p.url + "/admin/backends")
		if err != nil {
			t.Fatal(err)
		}
		var rows []backendJSON
		json.NewDecoder(r.Body).Decode(&rows)
		r.Body.Close()
		if len(rows) == 1 && rows[0].Healthy && rows[0].Scrape != nil && rows[0].Scrape.OK && rows[0].Scrape.KVUsage == 0.1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the https engine's scrape never succeeded: %+v", rows)
		}
	}
	p.waitIdle(t)
	// The prober's reason reaches the log line of a backend going down.
	p.s.st.Load().backends["e0"].setProbe(false, "tls: failed to verify certificate: x509: certificate signed by unknown authority")
	if !strings.Contains(p.logs.String(), `"probe_error":"tls: failed to verify certificate`) {
		t.Fatalf("the probe's reason is not logged:\n%s", p.logs.String())
	}
}

// An https engine whose certificate kvproxy does not trust gets no request:
// the client's 502 says why, and the engine is ejected as one that refuses
// connections is.
func TestUntrustedHTTPSBackend(t *testing.T) {
	addr := startTLSEngine(t)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: e0, url: 'https://"+addr+"', model: m}]\n")
	resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 502 || !strings.Contains(string(b), "backend e0 failed the TLS handshake") || strings.Contains(string(b), addr) {
		t.Fatalf("%d %s (want the backend named, not its address)", resp.StatusCode, b)
	}
	if !strings.Contains(p.logs.String(), "x509: certificate signed by unknown authority") {
		t.Fatalf("the log does not say why:\n%s", p.logs.String())
	}
	if !ejected(p, "e0") {
		t.Fatal("an engine kvproxy cannot talk to stayed in")
	}
	p.waitIdle(t)
}
