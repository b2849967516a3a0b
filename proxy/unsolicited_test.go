package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// An engine that answers a request twice, the second time after its
// connection went back to the pool, gives no client the unasked answer: the
// next request was sent on that connection and read it as its own, and each
// later one read the previous request's, across tenants (the twenty-sixth
// session's security review). The connection is counted in /admin/backends.
func TestUnaskedAnswerReachesNoClient(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var answered atomic.Int32
	answer := func(c net.Conn, text string) {
		body := fmt.Sprintf(`{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,"text":%q,"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`, text)
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					var req fasthttp.Request
					if req.Read(br) != nil {
						return
					}
					if string(req.Header.Method()) != "POST" {
						io.WriteString(c, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
						continue
					}
					prompt := string(req.Body())
					answer(c, "answer to "+prompt[strings.Index(prompt, `"prompt"`):])
					if answered.Add(1) == 1 {
						time.Sleep(20 * time.Millisecond)
						answer(c, "unasked")
					}
				}
			}()
		}
	}()
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://"+ln.Addr().String()+"', kind: openai}]\n")
	for i := range 3 {
		resp, b := post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"p%d"}`, i))
		if resp.StatusCode != 200 || !strings.Contains(string(b), fmt.Sprintf(`p%d`, i)) {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
		time.Sleep(50 * time.Millisecond) // the unasked answer comes meanwhile
	}
	if _, b := fetch(t, p.url+"/admin/backends"); !strings.Contains(string(b), `"unsolicited_answers":1`) {
		t.Fatalf("/admin/backends: %s", b)
	}
}
