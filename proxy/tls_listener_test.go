package proxy

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
	"github.com/kvproxy/kvproxy/internal/testutil"
)

// With tls configured kvproxy serves HTTPS: requests and streams, a reload
// that rotates the certificate (new connections get the new one), and a
// client hanging up while the engine is silent is noticed under TLS as on
// a plain socket (the request is cut at the engine and its slot freed).
func TestTLSListener(t *testing.T) {
	dir := t.TempDir()
	first := testutil.SelfSignedCert(t, dir, 1)
	e := startFake(t, "e0", nil)
	slow := startFake(t, "e1", func(f *fakeEngine) { f.prefillDelay = 10 * time.Second })
	yaml := fmt.Sprintf("tls: {cert_file: %s, key_file: %s}\nmodels: [{name: m, tokenizer: cl100k_base, template: chatml}, {name: slow, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m}, {id: e1, url: 'http://{{e1}}', model: slow}]\n",
		filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem"))
	p := startProxyYAML(t, yaml, e, slow)
	addr := strings.TrimPrefix(p.url, "http://")

	client := func(trust *x509.Certificate) *http.Client {
		pool := x509.NewCertPool()
		pool.AddCert(trust)
		return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 5 * time.Second}
	}
	post := func(c *http.Client, body string) (*http.Response, string) {
		t.Helper()
		resp, err := c.Post("https://"+addr+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	if resp, b := post(client(first), `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`); resp.StatusCode != 200 || resp.TLS == nil || !strings.HasSuffix(strings.TrimSpace(b), "data: [DONE]") {
		t.Fatalf("over TLS: %d %s", resp.StatusCode, b)
	}
	// Plain HTTP gets a 400 that says why, as Go's net/http answers it.
	if resp, err := http.Get(p.url + "/health"); err != nil || resp.StatusCode != 400 {
		t.Fatalf("plain HTTP on the TLS listener: %v %v", resp, err)
	} else if b, _ := io.ReadAll(resp.Body); !strings.Contains(string(b), "https_required") {
		t.Fatalf("plain HTTP on the TLS listener: %s", b)
	}
	for deadline := time.Now().Add(3 * time.Second); !strings.Contains(p.logs.String(), `"error":"TLS handshake failed`); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a failed handshake is not logged as one:\n%s", p.logs.String())
		}
	}

	// Rotation: the files change, a reload reads them again.
	second := testutil.SelfSignedCert(t, dir, 2)
	cfg, err := config.Parse([]byte(strings.NewReplacer("{{e0}}", e.addr, "{{e1}}", slow.addr).Replace(yaml)))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	resp, b := post(client(second), `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 || resp.TLS.PeerCertificates[0].SerialNumber.Int64() != 2 {
		t.Fatalf("after rotation: %d %s", resp.StatusCode, b)
	}

	// A client that hangs up while the engine is silent.
	conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: func() *x509.CertPool { p := x509.NewCertPool(); p.AddCert(second); return p }()})
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"slow","messages":[{"role":"user","content":"hi"}]}`
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	for deadline := time.Now().Add(3 * time.Second); slow.current.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the slow engine never got the request")
		}
	}
	conn.Close()
	for deadline := time.Now().Add(3 * time.Second); slow.aborted.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a TLS client's hang-up was not noticed while the engine was silent")
		}
	}
	p.waitIdle(t)
}

// tls needs both files, and they must hold a certificate and its key.
func TestTLSListenerConfig(t *testing.T) {
	dir := t.TempDir()
	testutil.SelfSignedCert(t, dir, 1)
	base := "models: [{name: m}]\nbackends: [{id: e0, url: 'http://127.0.0.1:9', model: m}]\n"
	for _, c := range []struct{ tls, err string }{
		{"tls: {cert_file: " + filepath.Join(dir, "cert.pem") + "}\n", "cert_file and key_file go together"},
		{"tls: {cert_file: " + filepath.Join(dir, "cert.pem") + ", key_file: " + filepath.Join(dir, "missing.pem") + "}\n", "missing.pem"},
		{"tls: {cert_file: " + filepath.Join(dir, "key.pem") + ", key_file: " + filepath.Join(dir, "cert.pem") + "}\n", "tls:"},
	} {
		if _, err := config.Parse([]byte(c.tls + base)); err == nil || !strings.Contains(err.Error(), c.err) || strings.Contains(err.Error(), "tls: tls:") {
			t.Errorf("%s: %v, want %q", c.tls, err, c.err)
		}
	}
}

// admin_listen serves HTTPS when listen does, with the same certificate,
// and only the operators' endpoints.
func TestTLSAdminListener(t *testing.T) {
	dir := t.TempDir()
	cert := testutil.SelfSignedCert(t, dir, 1)
	e := startFake(t, "e0", nil)
	yaml := fmt.Sprintf("admin_listen: 127.0.0.1:0\ntls: {cert_file: %s, key_file: %s}\nmodels: [{name: m, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem"))
	p := startProxyYAML(t, yaml, e)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go p.s.ServeAdmin(ln)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 5 * time.Second}
	get := func(url string) (int, string) {
		t.Helper()
		resp, err := c.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	admin, api := "https://"+ln.Addr().String(), strings.Replace(p.url, "http://", "https://", 1)
	if code, b := get(admin + "/metrics"); code != 200 || !strings.Contains(b, "kvproxy_client_connections") {
		t.Fatalf("/metrics on admin_listen over TLS: %d %.200s", code, b)
	}
	if code, b := get(api + "/metrics"); code != 404 || !strings.Contains(b, "admin_listen") {
		t.Fatalf("/metrics on listen: %d %s", code, b)
	}
	if code, b := get(admin + "/v1/models"); code != 404 || !strings.Contains(b, "admin_listen") {
		t.Fatalf("/v1/models on admin_listen: %d %s", code, b)
	}
	if resp, err := http.Get("http://" + ln.Addr().String() + "/live"); err != nil || resp.StatusCode != 400 {
		t.Fatalf("plain HTTP on admin_listen under TLS: %v %v", resp, err)
	}
}
