package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// TestEventLoopProxyProcess runs kvoverhead as the event-loop proxy and
// checks it relays JSON, SSE (chunked), errors and large bodies, and keeps
// connections alive across requests from many clients at once.
func TestEventLoopProxyProcess(t *testing.T) {
	base := startFloorProc(t, eventLoopCommand, testUpstream(t))
	checkRelays(t, base)

	// Keep-alive: 8 clients × 50 requests, each client on one connection.
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close()
			r := bufio.NewReader(conn)
			for j := range 50 {
				path, body := "/json", fmt.Sprintf("[%d,%d]", i, j)
				if j%5 == 4 {
					path, body = "/sse", ""
				}
				fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
				resp, err := http.ReadResponse(r, nil)
				if err != nil {
					errs <- fmt.Errorf("client %d request %d: %v", i, j, err)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				want := `{"echo":` + body + `}`
				if path == "/sse" {
					want = "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
				}
				if string(b) != want {
					errs <- fmt.Errorf("client %d request %d: %q, want %q", i, j, b, want)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	// A HEAD answer has no body, whatever its Content-Length says: the next
	// request on the connection must still be answered.
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	r := bufio.NewReader(conn)
	fmt.Fprint(conn, "HEAD /big HTTP/1.1\r\nHost: x\r\n\r\n")
	if resp, err := http.ReadResponse(r, &http.Request{Method: "HEAD"}); err != nil || resp.StatusCode != 200 {
		t.Fatalf("HEAD: %v %v", resp, err)
	}
	fmt.Fprint(conn, "POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n7")
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(resp.Body); string(b) != `{"echo":7}` {
		t.Fatalf("after HEAD: %q", b)
	}
}

// TestResponseFramer feeds answers split at every byte and checks the
// framer finds their ends exactly there.
func TestResponseFramer(t *testing.T) {
	for _, c := range []struct{ name, answer string }{
		{"length", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"},
		{"empty", "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"},
		{"204", "HTTP/1.1 204 No Content\r\n\r\n"},
		{"chunked", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n1a;ext=1\r\n" + strings.Repeat("x", 26) + "\r\n0\r\n\r\n"},
		{"trailer", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nA\r\n0123456789\r\n0\r\nX-Trailer: 1\r\n\r\n"},
	} {
		for cut := 1; cut < len(c.answer); cut++ {
			var f responseFramer
			done1, err1 := f.feed([]byte(c.answer[:cut]))
			done2, err2 := f.feed([]byte(c.answer[cut:]))
			if err1 != nil || err2 != nil || done1 || !done2 {
				t.Fatalf("%s cut at %d: done %v %v, errors %v %v", c.name, cut, done1, done2, err1, err2)
			}
		}
	}
	var f responseFramer
	if done, err := f.feed([]byte("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")); err == nil || done {
		t.Fatalf("bad chunk size: done %v, err %v", done, err)
	}
	f = responseFramer{}
	if done, _ := f.feed([]byte("HTTP/1.1 200 OK\r\n\r\nuntil close")); done {
		t.Fatal("an answer without length ended before the connection did")
	}
	if n := requestEnd([]byte("POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\nab")); n != 0 {
		t.Fatalf("incomplete request: %d", n)
	}
	if n := requestEnd([]byte("POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET")); n != 41 {
		t.Fatalf("complete request: %d", n)
	}
	if n := requestEnd([]byte("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")); n != -1 {
		t.Fatalf("chunked request: %d", n)
	}
}
