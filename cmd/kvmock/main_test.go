package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvproxy/kvproxy/kv"
)

func TestFleet(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan []endpoints, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-n", "3", "-base-port", "0", "-speedup", "1000", "-model", "m"}, func(a []endpoints) { got <- a })
	}()
	var addrs []endpoints
	select {
	case addrs = <-got:
	case err := <-done:
		t.Fatal(err)
	}
	if len(addrs) != 3 {
		t.Fatalf("want 3 engines, got %v", addrs)
	}
	for _, a := range addrs {
		if a.Events != "" {
			t.Fatal("no event publisher without -kv-events")
		}
		resp, err := http.Post("http://"+a.HTTP+"/v1/completions", "application/json",
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
	if _, err := http.Get("http://" + addrs[0].HTTP + "/health"); err == nil {
		t.Fatal("engines must be closed after shutdown")
	}
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-n", "0", "-base-port", "0"},
		{"-base-port", "65535", "-n", "2"},
		{"-tokenizer", "nope", "-base-port", "0"},
		{"-bogus"},
		{"-kv-events-encoding", "xml", "-base-port", "0"},
		{"-n", "2", "-speeds", "1", "-base-port", "0"},
		{"-n", "2", "-speeds", "1,0", "-base-port", "0"},
	} {
		if err := run(context.Background(), args, nil); err == nil {
			t.Fatalf("%v: want an error", args)
		}
	}
}

// With -kv-events each engine publishes vLLM-format batches; the replay
// socket hands them back from seq 0.
func TestFleetPublishesEvents(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan []endpoints, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-n", "2", "-base-port", "0", "-speedup", "1000", "-kv-events", "-kv-events-base-port", "0", "-kv-events-encoding", "map"},
			func(a []endpoints) { got <- a })
	}()
	var eps []endpoints
	select {
	case eps = <-got:
	case err := <-done:
		t.Fatal(err)
	}
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	prompt := make([]string, 40)
	for i := range prompt {
		prompt[i] = strconv.Itoa(2000 + i)
	}
	body := `{"prompt":[` + strings.Join(prompt, ",") + `],"max_tokens":1}`
	resp, err := http.Post("http://"+eps[1].HTTP+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	defer rcancel()
	d := zmq4.NewDealer(rctx)
	defer d.Close()
	if err := d.Dial(eps[1].Replay); err != nil {
		t.Fatal(err)
	}
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, make([]byte, 8))); err != nil {
		t.Fatal(err)
	}
	var stored []uint32
	for {
		msg, err := d.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			t.Fatalf("reply %q", msg.Frames)
		}
		if binary.BigEndian.Uint64(msg.Frames[1]) == ^uint64(0) {
			break
		}
		_, evs, _, err := kv.DecodeVLLM(msg.Frames[2])
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range evs {
			if e.Kind == kv.BlockStored {
				stored = append(stored, e.Tokens...)
			}
		}
	}
	// 40 tokens: two full blocks of 16 were stored, with their token ids.
	if len(stored) != 32 || stored[0] != 2000 || stored[31] != 2031 {
		t.Fatalf("stored tokens %v", stored)
	}
}

// TestMain lets a test run the real main in a child process.
func TestMain(m *testing.M) {
	if os.Getenv("KVMOCK_RUN_MAIN") == "1" {
		os.Args = append([]string{"kvmock"}, strings.Fields(os.Getenv("KVMOCK_ARGS"))...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// The real process logs one line per engine and exits 0 on SIGTERM.
func TestSignalExit(t *testing.T) {
	for _, sig := range []os.Signal{syscall.SIGTERM, os.Interrupt} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "KVMOCK_RUN_MAIN=1", "KVMOCK_ARGS=-n 2 -base-port 0")
		stderr, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(stderr)
		var addrs []string
		for len(addrs) < 2 && sc.Scan() {
			line := sc.Text()
			if i := strings.Index(line, "http://"); i >= 0 && strings.Contains(line, "engine mock-") {
				addrs = append(addrs, strings.Fields(line[i:])[0])
			}
		}
		if len(addrs) != 2 {
			cmd.Process.Kill()
			t.Fatalf("want one line per engine, got %v", addrs)
		}
		resp, err := http.Get(addrs[1] + "/health")
		if err != nil || resp.StatusCode != 200 {
			cmd.Process.Kill()
			t.Fatal("engine 1 not serving", err)
		}
		resp.Body.Close()
		cmd.Process.Signal(sig)
		io.Copy(io.Discard, stderr)
		if err := cmd.Wait(); err != nil {
			t.Fatalf("%v: exit %v", sig, err)
		}
	}
}

func TestParseSpeeds(t *testing.T) {
	s, err := parseSpeeds("1, 0.5,2", 3)
	if err != nil || s[0] != 1 || s[1] != 0.5 || s[2] != 2 {
		t.Fatalf("%v %v", s, err)
	}
	if s, err := parseSpeeds("", 2); err != nil || s[0] != 1 || s[1] != 1 {
		t.Fatalf("default speeds %v %v", s, err)
	}
}
