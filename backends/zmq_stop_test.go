package backends

import (
	"context"
	"encoding/binary"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvproxy/kvproxy/kv"
)

// zmqReaders counts zmq4's per-connection reader goroutines.
func zmqReaders() int {
	buf := make([]byte, 8<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "zmq4.(*qreader).listen")
}

// settleReaders waits until no more than want readers run, and fails with
// their stacks if some never end.
func settleReaders(t *testing.T, want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for zmqReaders() > want {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
				if strings.Contains(g, "qreader).listen") {
					t.Logf("still running:\n%s", g)
				}
			}
			t.Fatalf("%d zmq4 reader goroutines left running, want %d", zmqReaders(), want)
		}
		time.Sleep(10 * time.Millisecond) // goroutine exit has no hook to wait on
	}
}

// blockingSink holds the first batch until released: the subscriber stops
// reading while the engine keeps publishing.
type blockingSink struct {
	entered, release chan struct{}
}

func (b *blockingSink) ApplyEvents(int, []kv.Event) {
	select {
	case b.entered <- struct{}{}:
		<-b.release
	default:
	}
}
func (b *blockingSink) ClearRanks([]int) {}

// A subscriber stopped while zmq4's queue of received messages is full
// used to leave that socket's reader goroutine blocked on the queue for
// good (one per stop: every reload of a busy backend).
func TestZMQSubscriberStopWhileBusyEndsItsReader(t *testing.T) {
	eng := newTestEngine(t, 1000)
	base := zmqReaders()
	// Before the fix, each round leaked with a probability of one half or
	// more (zmq4's Recv picks between its queue and its cancelled context
	// at random).
	for round := 0; round < 4; round++ {
		sink := &blockingSink{entered: make(chan struct{}), release: make(chan struct{})}
		sub := NewZMQSubscriber(ZMQConfig{Endpoint: eng.pubAddr}, sink)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { sub.Run(ctx); close(done) }()
		deadline := time.Now().Add(10 * time.Second)
	warm:
		for {
			eng.publish(0, removed(1))
			select {
			case <-sink.entered:
				break warm
			case <-time.After(20 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatal("the subscriber never received a batch")
			}
		}
		for i := 0; i < 40; i++ {
			eng.publish(0, removed(uint64(i)))
		}
		time.Sleep(200 * time.Millisecond) // the reader fills its queue and blocks
		cancel()
		close(sink.release)
		<-done
		settleReaders(t, base)
	}
}

// serveFloodingReplay answers every replay request on a ROUTER with n
// batches and the end marker, after a malformed reply if bad.
func serveFloodingReplay(t *testing.T, bad bool, n int) string {
	ctx, cancel := context.WithCancel(context.Background())
	router := zmq4.NewRouter(ctx)
	if err := router.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := router.Recv()
			if err != nil {
				return
			}
			if len(msg.Frames) < 1 {
				continue
			}
			id := msg.Frames[0]
			if bad {
				router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte("bad")))
			}
			for i := 0; i < n; i++ {
				router.Send(zmq4.NewMsgFrom(id, []byte{}, binary.BigEndian.AppendUint64(nil, uint64(i)), []byte{0x90}))
			}
			router.Send(zmq4.NewMsgFrom(id, []byte{}, binary.BigEndian.AppendUint64(nil, endSeq), []byte{}))
		}
	}()
	t.Cleanup(func() { cancel(); router.Close(); <-done })
	return "tcp://" + router.Addr().String()
}

// A replay abandoned while the ROUTER still sends (a malformed reply, a
// timeout, the subscriber stopped) used to leave the DEALER's reader
// goroutine blocked on its full queue.
func TestZMQReplayAbandonedEndsItsReader(t *testing.T) {
	bad, flood := serveFloodingReplay(t, true, 40), serveFloodingReplay(t, false, 40)
	base := zmqReaders()
	sub := NewZMQSubscriber(ZMQConfig{Endpoint: "tcp://127.0.0.1:1", ReplayEndpoint: bad}, &recordSink{})
	for round := 0; round < 2; round++ {
		if err := sub.replay(context.Background(), 0, func(uint64, []byte) {}); err == nil || !strings.Contains(err.Error(), "malformed") {
			t.Fatalf("replay: %v, want a malformed reply", err)
		}
	}
	settleReaders(t, base)
	// The subscriber stops in the middle of a replay.
	sub = NewZMQSubscriber(ZMQConfig{Endpoint: "tcp://127.0.0.1:1", ReplayEndpoint: flood}, &recordSink{})
	ctx, cancel := context.WithCancel(context.Background())
	got := 0
	err := sub.replay(ctx, 0, func(uint64, []byte) {
		if got++; got == 1 {
			time.Sleep(200 * time.Millisecond) // the reader fills its queue and blocks
			cancel()
		}
	})
	if err != context.Canceled || got != 1 {
		t.Fatalf("replay stopped after %d batches: %v", got, err)
	}
	settleReaders(t, base)
}
