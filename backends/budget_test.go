package backends

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/valyala/fasthttp"
)

// framedEngine answers each request with the answer that answer returns
// for its number (0, 1, ...), written as it is; one with Connection: close
// closes the connection after it.
func framedEngine(t *testing.T, answer func(n int) string) string {
	var n atomic.Int64
	return rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for readRequest(br) == nil {
			a := answer(int(n.Add(1) - 1))
			if _, err := io.WriteString(c, a); err != nil || strings.Contains(a, "Connection: close") {
				return
			}
		}
	})
}

func lengthAnswer(body string) string {
	return fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}

func chunkedAnswer(body string, chunk int) string {
	var b strings.Builder
	b.WriteString("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
	for len(body) > 0 {
		k := min(chunk, len(body))
		fmt.Fprintf(&b, "%x\r\n%s\r\n", k, body[:k])
		body = body[k:]
	}
	b.WriteString("0\r\n\r\n")
	return b.String()
}

func doWhole(t *testing.T, u *Upstream) (int64, []byte, error) {
	return doWholeOwning(t, u, 0)
}

// doWholeOwning is doWhole for a request that holds own bytes already.
func doWholeOwning(t *testing.T, u *Upstream, own int64) (int64, []byte, error) {
	t.Helper()
	req := newRequest(u.Addr, "{}")
	defer fasthttp.ReleaseRequest(req)
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseResponse(resp)
	held, err := u.DoWhole(req, resp, nil, own)
	return held, bytes.Clone(resp.Body()), err
}

// An answer of a declared length over Untracked takes its size before it
// is read; one that does not fit fails, and the connection it came on is
// not reused (its body is unread).
func TestWholeAnswerOfDeclaredLengthTakesItsSize(t *testing.T) {
	big := strings.Repeat("a", 2<<20)
	addr := framedEngine(t, func(int) string { return lengthAnswer(big) })
	budget := NewBudget(3 << 20)
	u := &Upstream{Addr: addr, Budget: budget}
	defer u.Close()

	held, body, err := doWhole(t, u)
	if err != nil || held != int64(len(big)) || string(body) != big || budget.Used() != held {
		t.Fatalf("first: held %d, %d bytes, used %d, %v", held, len(body), budget.Used(), err)
	}
	if held2, _, err := doWhole(t, u); !errors.Is(err, ErrOverBudget) || held2 != 0 || budget.Used() != held || budget.Refused() != 1 {
		t.Fatalf("second: held %d, used %d, refused %d, %v; want ErrOverBudget", held2, budget.Used(), budget.Refused(), err)
	}
	budget.SetLimit(2<<20 - 1)
	if _, _, err := doWhole(t, u); !errors.Is(err, ErrBeyondBudget) {
		t.Fatalf("an answer over the whole budget: %v, want ErrBeyondBudget", err)
	}
	budget.SetLimit(4 << 20)
	if _, _, err := doWholeOwning(t, u, 3<<20); !errors.Is(err, ErrBeyondBudget) {
		t.Fatalf("an answer over what its request leaves of the budget: %v, want ErrBeyondBudget", err)
	}
	budget.SetLimit(3 << 20)
	budget.Give(held)
	if held, body, err := doWhole(t, u); err != nil || string(body) != big || held != int64(len(big)) {
		t.Fatalf("after the first was given back: held %d, %d bytes, %v", held, len(body), err)
	}
	if d := u.Dials.Load(); d != 4 {
		t.Fatalf("%d dials, want 4: the refused answers' connections are closed, the others' reused", d)
	}
}

// An answer of no declared length (chunked) takes room as it grows, gives
// it all back when it does not fit, and leaves its connection reusable
// when it does.
func TestChunkedWholeAnswerTakesRoomAsItGrows(t *testing.T) {
	big := strings.Repeat("b", 5<<19) // 2.5 MiB
	addr := framedEngine(t, func(int) string { return chunkedAnswer(big, 300<<10) })
	budget := NewBudget(8 << 20)
	u := &Upstream{Addr: addr, Budget: budget}
	defer u.Close()

	for range 2 {
		held, body, err := doWhole(t, u)
		if err != nil || string(body) != big || held < int64(len(big)) || held > 2*int64(len(big)) || budget.Used() != held {
			t.Fatalf("held %d, %d bytes, used %d, %v", held, len(body), budget.Used(), err)
		}
		budget.Give(held)
	}
	if d := u.Dials.Load(); d != 1 {
		t.Fatalf("%d dials, want 1: a chunked answer read whole leaves its connection reusable", d)
	}
	// Doubling stops at the budget: 2.5 MiB fit in 3, not 4.
	budget.SetLimit(3 << 20)
	if held, body, err := doWhole(t, u); err != nil || string(body) != big || held != 3<<20 {
		t.Fatalf("in a budget of 3 MiB: held %d, %d bytes, %v", held, len(body), err)
	} else {
		budget.Give(held)
	}
	// Room held by others may come back; a body over the whole budget
	// never fits.
	budget.Take(1 << 20)
	if held, _, err := doWhole(t, u); !errors.Is(err, ErrOverBudget) || held != 0 || budget.Used() != 1<<20 {
		t.Fatalf("held %d, used %d, %v; want ErrOverBudget with nothing held", held, budget.Used(), err)
	}
	budget.Give(1 << 20)
	budget.SetLimit(2 << 20)
	if held, _, err := doWhole(t, u); !errors.Is(err, ErrBeyondBudget) || held != 0 || budget.Used() != 0 {
		t.Fatalf("held %d, used %d, %v; want ErrBeyondBudget with nothing held", held, budget.Used(), err)
	}
}

// Small answers are not counted, and the answers fasthttp's ReadLimitBody
// reads in its own way still are: informational answers before the
// answer, bodiless ones, and one that ends with its connection.
func TestWholeAnswersReadAsFasthttpReadsThem(t *testing.T) {
	answers := []string{
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + lengthAnswer("ok"),
		"HTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
		chunkedAnswer("small", 2),
		"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
	}
	addr := framedEngine(t, func(n int) string { return answers[n] })
	budget := NewBudget(1)
	u := &Upstream{Addr: addr, Budget: budget}
	defer u.Close()
	for i, want := range []string{"ok", "", "", "small", "until the end"} {
		held, body, err := doWhole(t, u)
		if err != nil || string(body) != want || held != 0 {
			t.Fatalf("answer %d: %q held %d, %v; want %q", i, body, held, err, want)
		}
	}
	if d, used := u.Dials.Load(), budget.Used(); d != 1 || used != 0 {
		t.Fatalf("%d dials, %d bytes used; want 1 and 0", d, used)
	}
}

// An answer that breaks off gives back what it took.
func TestBrokenWholeAnswerGivesBackItsRoom(t *testing.T) {
	big := strings.Repeat("c", 3<<20)
	for name, answer := range map[string]string{
		"length":  lengthAnswer(big)[:2<<20],
		"chunked": strings.TrimSuffix(chunkedAnswer(big, 1<<20), "0\r\n\r\n"),
		"too big": lengthAnswer(big + big),
	} {
		t.Run(name, func(t *testing.T) {
			addr := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
				readRequest(br)
				io.WriteString(c, answer)
			})
			budget := NewBudget(16 << 20)
			u := &Upstream{Addr: addr, Budget: budget, MaxBodySize: 4 << 20}
			defer u.Close()
			if held, _, err := doWhole(t, u); err == nil || held != 0 || budget.Used() != 0 {
				t.Fatalf("held %d, used %d, %v; want an error with nothing held", held, budget.Used(), err)
			}
		})
	}
}
