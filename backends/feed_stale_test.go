package backends

import (
	"context"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

func waitFeed(t *testing.T, feed *KVFeed, what string, cond func(ZMQStats) bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := feed.Subscriber().Wait(ctx, cond); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func approximate(t *testing.T, rt *router.Router, name string) bool {
	t.Helper()
	id, ok := rt.WorkerByName(name)
	if !ok {
		t.Fatalf("no worker %s", name)
	}
	return rt.Workers()[id].Approximate
}

// A proxy that starts (or re-adds a backend) after its engine stored its
// blocks learns them from the engine's replay buffer at once, whether or
// not the engine stores anything new: an engine answering from its cache
// publishes nothing, and waiting for its next batch left it looking cold
// and starved of requests (found by the twelfth session's operator trial).
func TestZMQFeedReplaysTheBufferWhenItConnects(t *testing.T) {
	eng := newTestEngine(t, 100)
	last := eng.publish(0, stored([]uint64{10, 11, 12}, nil, tokens(48, 1), kv.TierDevice))
	feed, err := StartKVFeed(KVFeedConfig{Backend: "e0", Mode: FeedZMQ, ZMQ: ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: eng.replayAddr()}}, newRouter(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(feed.Close)
	// Replayed is counted just after the batch is applied (and LastSeq
	// set): waited for too.
	waitFeed(t, feed, "the engine's buffer", func(s ZMQStats) bool { return s.LastSeq == int64(last) && s.Replayed == 1 })
	if st := feed.Stats(); st.Apply.Blocks[kv.TierDevice] != 3 || st.ZMQ.Replayed != 1 {
		t.Fatalf("apply %+v, zmq %+v", st.Apply, *st.ZMQ)
	}
}

// A feed down for longer than StaleAfter no longer vouches for the index
// (the engine may have restarted without events, or evicted): the rank's
// entries go and it is routed on the router's own records; when the feed
// is back, the rank is in event mode again and the replay rebuilds it.
// Before, the index kept the blocks of a gone feed for good, and requests
// went to an engine that no longer had them (found by the operator trial).
func TestZMQFeedDownTooLongIsRoutedApproximately(t *testing.T) {
	eng := newTestEngine(t, 100)
	pubEP, replayEP := eng.pubAddr, eng.replayAddr()
	rt := newRouter(t)
	feed, err := StartKVFeed(KVFeedConfig{Backend: "e0", Mode: FeedZMQ,
		ZMQ: ZMQConfig{Endpoint: pubEP, ReplayEndpoint: replayEP, BackoffMin: 5 * time.Millisecond, BackoffMax: 20 * time.Millisecond, StaleAfter: 200 * time.Millisecond}}, rt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(feed.Close)
	last := eng.publish(0, stored([]uint64{10, 11, 12}, nil, tokens(48, 1), kv.TierDevice))
	waitFeed(t, feed, "the first blocks", func(s ZMQStats) bool { return s.LastSeq == int64(last) })
	if approximate(t, rt, "e0") || feed.Stats().Apply.Blocks[kv.TierDevice] != 3 {
		t.Fatalf("before: approximate %v, apply %+v", approximate(t, rt, "e0"), feed.Stats().Apply)
	}

	eng.stop()
	waitFeed(t, feed, "the feed going stale", func(s ZMQStats) bool { return s.Stale })
	if st := feed.Stats(); !approximate(t, rt, "e0") || st.Apply.Blocks[kv.TierDevice] != 0 || st.ZMQ.Connected {
		t.Fatalf("stale: approximate %v, apply %+v, zmq %+v", approximate(t, rt, "e0"), st.Apply, *st.ZMQ)
	}

	// The engine is back (restarted: its sequence starts again) with blocks
	// of its own.
	back := newTestEngineAt(t, 100, pubEP, replayEP)
	seq := back.publish(0, stored([]uint64{20, 21}, nil, tokens(32, 7), kv.TierDevice))
	waitFeed(t, feed, "the feed back", func(s ZMQStats) bool { return s.Connected && !s.Stale && s.LastSeq == int64(seq) })
	if st := feed.Stats(); approximate(t, rt, "e0") || st.Apply.Blocks[kv.TierDevice] != 2 || st.ZMQ.LastError != "" {
		t.Fatalf("back: approximate %v, apply %+v, zmq %+v", approximate(t, rt, "e0"), st.Apply, *st.ZMQ)
	}
}
