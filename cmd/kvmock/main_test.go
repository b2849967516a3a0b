package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestFleet(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan []string, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-n", "3", "-base-port", "0", "-speedup", "1000", "-model", "m"}, func(a []string) { got <- a })
	}()
	var addrs []string
	select {
	case addrs = <-got:
	case err := <-done:
		t.Fatal(err)
	}
	if len(addrs) != 3 {
		t.Fatalf("want 3 engines, got %v", addrs)
	}
	for _, a := range addrs {
		resp, err := http.Post("http://"+a+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"m","prompt":"hi","max_tokens":2}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), `"completion_tokens"`) {
			t.Fatalf("%s: %d %s", a, resp.StatusCode, b)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := http.Get("http://" + addrs[0] + "/health"); err == nil {
		t.Fatal("engines must be closed after shutdown")
	}
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-n", "0", "-base-port", "0"},
		{"-base-port", "65535", "-n", "2"},
		{"-tokenizer", "nope", "-base-port", "0"},
		{"-bogus"},
	} {
		if err := run(context.Background(), args, nil); err == nil {
			t.Fatalf("%v: want an error", args)
		}
	}
}
