package proxy

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/internal/testutil"
)

// Connections in the middle of a request are never taken for a new one at
// the cap, however long the client pauses: a second request's body half
// sent, a first request under TLS (whose handshake wrote to it), a first
// request's body after 100 Continue. Each was closed mid-request by the
// first version, which took any connection written to and waiting in a
// read for idle (the last review). Each case: max_connections 1, the
// client pauses past idleEvictAfter, a second client knocks (and is
// refused), then the first finishes its request and gets its answer.
func TestBusyConnectionsAreNotEvicted(t *testing.T) {
	evictAfter := idleEvictAfter
	idleEvictAfter = 300 * time.Millisecond
	t.Cleanup(func() { idleEvictAfter = evictAfter })
	const yaml = "models: [{name: m, tokenizer: cl100k_base, template: chatml}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nlimits: {max_connections: 1}\n"
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	knock := func(dial func() (net.Conn, error)) {
		time.Sleep(700 * time.Millisecond) // the first client pauses
		if d, err := dial(); err == nil {
			d.SetDeadline(time.Now().Add(2 * time.Second))
			fmt.Fprintf(d, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
			io.ReadAll(d)
			d.Close()
		}
	}
	answered := func(t *testing.T, what string, c net.Conn, br *bufio.Reader) {
		t.Helper()
		c.SetDeadline(time.Now().Add(3 * time.Second))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%s: evicted mid-request: %v", what, err)
		}
		io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d", what, resp.StatusCode)
		}
	}

	// plain starts a proxy and opens a connection to it.
	plain := func(t *testing.T) (addr string, c net.Conn, br *bufio.Reader) {
		p := startProxyYAML(t, yaml, startFake(t, "e0", nil))
		addr = strings.TrimPrefix(p.url, "http://")
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return addr, c, bufio.NewReader(c)
	}

	t.Run("second request's body", func(t *testing.T) {
		addr, c, br := plain(t)
		if st, _ := rawGet(t, c, br, "/health"); st != 200 {
			t.Fatal(st)
		}
		fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body[:20])
		knock(func() (net.Conn, error) { return net.Dial("tcp", addr) })
		io.WriteString(c, body[20:])
		answered(t, "a second request's body", c, br)
	})

	t.Run("first request under TLS", func(t *testing.T) {
		dir := t.TempDir()
		testutil.SelfSignedCert(t, dir, 1)
		p := startProxyYAML(t, fmt.Sprintf("tls: {cert_file: %s, key_file: %s}\n", filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem"))+yaml, startFake(t, "e0", nil))
		addr := strings.TrimPrefix(p.url, "http://")
		dial := func() (net.Conn, error) { return tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true}) }
		c, err := dial()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		io.WriteString(c, "GET /health HTTP/1.1\r\nHost: x\r\n")
		knock(dial)
		io.WriteString(c, "\r\n")
		answered(t, "a first request under TLS", c, bufio.NewReader(c))
	})

	t.Run("first request's body after 100 Continue", func(t *testing.T) {
		addr, c, br := plain(t)
		fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", len(body))
		c.SetDeadline(time.Now().Add(3 * time.Second))
		if line, _ := br.ReadString('\n'); !strings.HasPrefix(line, "HTTP/1.1 100") {
			t.Fatalf("interim answer %q", line)
		}
		br.ReadString('\n')
		io.WriteString(c, body[:10])
		knock(func() (net.Conn, error) { return net.Dial("tcp", addr) })
		io.WriteString(c, body[10:])
		answered(t, "a first request's body after 100 Continue", c, br)
	})
}
