package proxy

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// Notes are swept once past their use and capped in number.
func TestOverLimitNotesAreSweptAndCapped(t *testing.T) {
	var n overLimitNotes
	headers := make([]fasthttp.RequestHeader, maxOverLimitNotes+10)
	t0 := time.Now().Add(-time.Hour)
	for i := range headers {
		n.add(&headers[i], overLimitBody{at: t0})
	}
	if n.len() != maxOverLimitNotes {
		t.Fatalf("%d notes kept, want the cap, %d", n.len(), maxOverLimitNotes)
	}
	var late fasthttp.RequestHeader
	n.add(&late, overLimitBody{at: t0.Add(noteTTL + 2*time.Second)})
	if n.len() != 1 {
		t.Fatalf("%d notes after a sweep, want only the new one", n.len())
	}
	if _, ok := n.take(&late); ok {
		t.Fatal("a note an hour old was of use")
	}
}

// Clients that declare a body over the limit and leave before sending it,
// or that ask with Expect: 100-continue and get the refusal, left their
// note behind for good: without a key, 35 KB of memory each (the soak
// trial). A hang-up's note now goes with its error; the sweep stays for
// notes of requests fasthttp reports nothing of.
func TestOverLimitNotesDoNotOutliveTheirRequests(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, bodyLimitYAML, e)
	addr := strings.TrimPrefix(p.url, "http://")
	hangUp := func(n int) {
		for range n {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 90000000\r\n\r\n")
			c.Close()
		}
	}
	hangUp(50)
	// Each hang-up is counted as a 499 before its note goes: the notes
	// are all gone once all 50 are counted and none is left (a hang-up
	// not yet read, on a loaded machine, left a note after the check).
	waitFor(t, "the hang-ups' notes to go", func() bool {
		return strings.Contains(p.metrics(t), `kvproxy_requests_total{backend="",code="499"} 50`+"\n") && p.s.overLimit.len() == 0
	})
	before := p.s.overLimit.len()
	for _, key := range []string{"key-free-45678", ""} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		auth := ""
		if key != "" {
			auth = "Authorization: Bearer " + key + "\r\n"
		}
		fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n%sExpect: 100-continue\r\nContent-Type: application/json\r\nContent-Length: 90000000\r\n\r\n", auth)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		c.Close()
		if err != nil || resp.StatusCode != 413 && resp.StatusCode != 401 {
			t.Fatalf("Expect: 100-continue over the limit: %v %v", resp, err)
		}
	}
	if n := p.s.overLimit.len(); n > before {
		t.Fatalf("%d notes after two refused Expect requests, %d before", n, before)
	}
}
