//go:build unix

package main

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// SIGTERM (like Ctrl-C) ends a replay with its partial results printed
// and dumped, requests in flight reported as cut off, and an error that
// names the signal (exit status 128+15).
func TestReplaySIGTERMPrintsPartialResults(t *testing.T) {
	started := make(chan struct{}, 8)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"text\":\"x\"}]}\n\n")
		w.(http.Flusher).Flush()
		started <- struct{}{}
		<-r.Context().Done()
	}))
	defer srv.Close()
	go func() {
		for range 2 {
			<-started
		}
		syscall.Kill(os.Getpid(), syscall.SIGTERM) // kvbench is listening by now: it has sent requests
	}()
	dump := filepath.Join(t.TempDir(), "d.csv")
	var out bytes.Buffer
	args := []string{"-url", srv.URL, "-model", "m", "-format", "multiturn", "-conversations", "5", "-limit", "5",
		"-concurrency", "2", "-dump", dump}
	err := runReplay(args, &out)
	var ie *interruptedError
	if !errors.As(err, &ie) || ie.sig != syscall.SIGTERM || !strings.Contains(err.Error(), "2 requests cut off in flight") ||
		!strings.Contains(err.Error(), "3 of 5 never sent") {
		t.Fatalf("want an interruption by SIGTERM: %v", err)
	}
	if !strings.Contains(out.String(), "live") || !strings.Contains(out.String(), "interrupted") {
		t.Fatalf("no table: %q", out.String())
	}
	if b, err := os.ReadFile(dump); err != nil || strings.Count(string(b), ",interrupted\n") != 2 {
		t.Fatalf("dump: %v %q", err, b)
	}
}
