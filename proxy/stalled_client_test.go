package proxy

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// A client that sends a request and then stops reading, its connection
// left open, loses the connection once it has taken no bytes for
// stream_idle_timeout, and every slot its request held is free again
// (found by the eighth session's review: the slots were held for as long
// as the client kept the connection). Streams over HTTP/1.1 and HTTP/1.0
// (a hijacked connection), and a large whole answer.
func TestStalledClientFreesItsSlots(t *testing.T) {
	chunk := strings.Repeat("x", 8000)
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(body), `"stream":true`) {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"choices":[{"text":"%s"}]}`, strings.Repeat(chunk, 2000)) // 16 MB
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for range 5000 { // 40 MB, more than any socket buffers
			if _, err := fmt.Fprintf(w, "data: {\"choices\":[{\"text\":\"%s\"}]}\n\n", chunk); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	p := startProxyYAML(t, "models: [{name: m, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m, max_concurrency: 1}]\n"+
		"limits: {stream_idle_timeout: 1s, queue_timeout: 200ms}\n")
	post(t, p.url+"/v1/completions", `{"model":"m","prompt":"y","max_tokens":1}`) // the server is serving
	for _, c := range []struct{ name, proto, body string }{
		{"stream", "HTTP/1.1", `{"model":"m","prompt":"x","stream":true}`},
		{"stream to an HTTP/1.0 client", "HTTP/1.0", `{"model":"m","prompt":"x","stream":true}`},
		{"whole answer", "HTTP/1.1", `{"model":"m","prompt":"x"}`},
	} {
		open := p.s.srv.GetOpenConnectionsCount()
		conn, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		conn.(*net.TCPConn).SetReadBuffer(4096)
		fmt.Fprintf(conn, "POST /v1/completions %s\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
			c.proto, len(c.body), c.body)
		// Never read. The slot is taken, then freed within about the idle time.
		deadline := time.Now().Add(10 * time.Second)
		for p.s.Idle() && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		stalled := time.Now()
		for !p.s.Idle() && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if !p.s.Idle() {
			conn.Close()
			t.Fatalf("%s: 10 s after a client stopped reading (stream_idle_timeout 1s) its request holds %+v",
				c.name, p.s.backendRows(p.s.st.Load()))
		}
		t.Logf("%s: slots free %v after the client stopped reading", c.name, time.Since(stalled).Round(10*time.Millisecond))
		// The proxy has closed the connection, the whole answer's too (its
		// slot was free as soon as the engine's answer was read).
		for p.s.srv.GetOpenConnectionsCount() > open && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if n := p.s.srv.GetOpenConnectionsCount(); n > open {
			t.Fatalf("%s: the stalled connection is still open (%d open, %d before)", c.name, n, open)
		}
		if resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":"y","max_tokens":1}`); resp.StatusCode != 200 || len(b) == 0 {
			t.Fatalf("%s: the next request: %d", c.name, resp.StatusCode)
		}
		conn.Close()
	}
	p.waitIdle(t)
}
