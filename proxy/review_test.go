package proxy

import (
	"bufio"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
)

// TestStreamHangUpDuringEnginePause: a client that hangs up mid-stream
// while the engine is silent is noticed at once (the engine is aborted, the
// slot freed), on HTTP/1.0 (a hijacked connection) as on HTTP/1.1.
func TestStreamHangUpDuringEnginePause(t *testing.T) {
	for _, proto := range []string{"HTTP/1.1", "HTTP/1.0"} {
		t.Run(proto, func(t *testing.T) {
			e := startFake(t, "e0", func(f *fakeEngine) { f.tokens, f.pauseAfter, f.pause = 5, 2, 10*time.Second })
			p := startProxy(t, "kv", e)
			c, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			body := `{"model":"m","prompt":"hello","stream":true}`
			fmt.Fprintf(c, "POST /v1/completions %s\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", proto, len(body), body)
			c.SetDeadline(time.Now().Add(5 * time.Second))
			rd := bufio.NewReader(c)
			for seen := 0; seen < 3; { // the role chunk and two tokens, then the engine pauses
				line, err := rd.ReadString('\n')
				if err != nil {
					t.Fatal(err)
				}
				if strings.HasPrefix(line, "data: ") {
					seen++
				}
			}
			start := time.Now()
			c.Close()
			for e.aborted.Load() == 0 {
				if time.Since(start) > 3*time.Second {
					t.Fatal("the engine never saw the abort")
				}
				time.Sleep(time.Millisecond)
			}
			t.Logf("aborted after %v", time.Since(start))
			p.waitIdle(t)
		})
	}
}
