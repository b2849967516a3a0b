package mockengine

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvproxy/kvproxy/kv"
)

func newTestPublisher(t *testing.T, cfg PublisherConfig) *Publisher {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://127.0.0.1:0"
	}
	p, err := NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

type replayed struct {
	seq     uint64
	payload []byte
}

// replayFrom asks the publisher's ROUTER for everything from start, as the
// proxy's subscriber does (DEALER, ["", start]).
func replayFrom(t *testing.T, p *Publisher, start uint64) []replayed {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial(p.ReplayEndpoint()); err != nil {
		t.Fatal(err)
	}
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, start))); err != nil {
		t.Fatal(err)
	}
	var out []replayed
	for {
		msg, err := d.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(msg.Frames) != 3 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 {
			t.Fatalf("reply frames %q", msg.Frames)
		}
		seq := binary.BigEndian.Uint64(msg.Frames[1])
		if seq == ^uint64(0) {
			if len(msg.Frames[2]) != 0 {
				t.Fatal("end marker carries a payload")
			}
			return out
		}
		out = append(out, replayed{seq, msg.Frames[2]})
	}
}

func cleared() []kv.Event { return []kv.Event{{Kind: kv.AllBlocksCleared}} }

func TestPublisherReplayIsBounded(t *testing.T) {
	p := newTestPublisher(t, PublisherConfig{ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 3, DPRank: 2})
	for i := 0; i < 5; i++ {
		if seq, err := p.Publish(cleared()); err != nil || seq != uint64(i) {
			t.Fatalf("publish %d: seq %d err %v", i, seq, err)
		}
	}
	got := replayFrom(t, p, 3)
	if len(got) != 2 || got[0].seq != 3 || got[1].seq != 4 {
		t.Fatalf("replay from 3: %+v", got)
	}
	got = replayFrom(t, p, 0) // the buffer holds only the last three
	if len(got) != 3 || got[0].seq != 2 {
		t.Fatalf("replay from 0: %+v", got)
	}
	_, evs, rank, err := kv.DecodeVLLM(got[0].payload)
	if err != nil || rank != 2 || len(evs) != 1 || evs[0].Kind != kv.AllBlocksCleared {
		t.Fatalf("payload: %+v rank %d err %v", evs, rank, err)
	}
	if got := replayFrom(t, p, 99); len(got) != 0 {
		t.Fatalf("replay past the end: %+v", got)
	}
}

// Live frames are [topic, seq BE, payload] in either encoding.
func TestPublisherLiveFrames(t *testing.T) {
	for _, enc := range []kv.VLLMEncoding{kv.VLLMArrays, kv.VLLMMaps} {
		p := newTestPublisher(t, PublisherConfig{Topic: "kv@mock", Encoding: enc})
		ctx, cancel := context.WithCancel(context.Background())
		sub := zmq4.NewSub(ctx)
		if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
			t.Fatal(err)
		}
		if err := sub.Dial(p.Endpoint()); err != nil {
			t.Fatal(err)
		}
		msgs := make(chan zmq4.Msg, 100)
		go func() {
			for {
				m, err := sub.Recv()
				if err != nil {
					close(msgs)
					return
				}
				msgs <- m
			}
		}()
		stored := kv.Event{Kind: kv.BlockStored, EngineHashes: []uint64{7}, Tokens: make([]uint32, 16), BlockSize: 16, Tier: kv.TierHost}
		// A SUB receives only once its subscription reached the PUB: publish
		// until one batch arrives.
		var m zmq4.Msg
	wait:
		for i := 0; ; i++ {
			if i == 500 {
				t.Fatal("no message received")
			}
			p.Publish([]kv.Event{stored})
			select {
			case m = <-msgs:
				break wait
			case <-time.After(20 * time.Millisecond):
			}
		}
		if len(m.Frames) != 3 || string(m.Frames[0]) != "kv@mock" || len(m.Frames[1]) != 8 {
			t.Fatalf("frames %q", m.Frames)
		}
		_, evs, _, err := kv.DecodeVLLM(m.Frames[2])
		if err != nil || len(evs) != 1 || evs[0].Tier != kv.TierHost || evs[0].EngineHashes[0] != 7 {
			t.Fatalf("enc %d: %+v %v", enc, evs, err)
		}
		cancel()
		sub.Close()
	}
}

// The published events, replayed from seq 0 and applied in order, give
// exactly the engine's resident blocks after a churn with evictions — both
// its engine hashes and, re-hashed from the events' token ids and parents,
// the router-scheme hashes /debug/cache reports.
func TestEngineEventsTrackCache(t *testing.T) {
	for _, enc := range []kv.VLLMEncoding{kv.VLLMArrays, kv.VLLMMaps} {
		for _, hook := range []bool{false, true} {
			engineEventsTrackCache(t, enc, hook)
		}
	}
}

// engineEventsTrackCache publishes through PublishEvents (drained by Flush)
// or, with hook, through Config.OnEvents after every step.
func engineEventsTrackCache(t *testing.T, enc kv.VLLMEncoding, hook bool) {
	p := newTestPublisher(t, PublisherConfig{ReplayEndpoint: "tcp://127.0.0.1:0", Encoding: enc, Interval: time.Hour})
	cfg := Config{CacheBlocks: 24}
	if hook {
		cfg.OnEvents = p.OnEvents
	}
	e, url := startEngine(t, cfg)
	var feed *EventFeed
	if !hook {
		feed = e.PublishEvents(p)
		defer feed.Stop()
	}
	flush := func() error {
		if hook {
			return nil // published at the end of each step
		}
		return feed.Flush()
	}
	prompt := func(k, shared int) []int {
		pr := make([]int, 80) // 5 blocks; the first `shared` tokens common to all
		for i := range pr {
			pr[i] = 1000 + k*1000 + i
			if i < shared {
				pr[i] = 7 + i
			}
		}
		return pr
	}
	for k := 0; k < 12; k++ {
		if code, r := post(t, url+"/v1/completions", map[string]any{"prompt": prompt(k%7, 16*(k%3)), "max_tokens": 3}); code != 200 {
			t.Fatalf("status %d %+v", code, r)
		}
		if k%4 == 3 {
			if err := flush(); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitIdle(t, e)
	if err := flush(); err != nil {
		t.Fatal(err)
	}

	own := map[uint64]kv.BlockHash{} // engine hash → re-hashed router hash
	removals := 0
	for i, b := range replayFrom(t, p, 0) {
		if b.seq != uint64(i) {
			t.Fatalf("replay seq %d at %d", b.seq, i)
		}
		_, evs, _, err := kv.DecodeVLLM(b.payload)
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range evs {
			switch ev.Kind {
			case kv.BlockStored:
				var parent kv.BlockHash
				if ev.HasParent {
					ph, ok := own[ev.EngineParent]
					if !ok {
						t.Fatalf("stored block's parent %x was never stored", ev.EngineParent)
					}
					parent = ph
				}
				hs := kv.ContinueHashes(nil, parent, !ev.HasParent, ev.Tokens, ev.BlockSize, 0)
				for j, h := range ev.EngineHashes {
					own[h] = hs[j]
				}
			case kv.BlockRemoved:
				removals += len(ev.EngineHashes)
				for _, h := range ev.EngineHashes {
					if _, ok := own[h]; !ok {
						t.Fatalf("removal of unknown block %x", h)
					}
					delete(own, h)
				}
			case kv.AllBlocksCleared:
				clear(own)
			}
		}
	}
	if removals == 0 {
		t.Fatal("the churn evicted nothing; the test proves little")
	}
	resident := e.appendResident(nil)
	if len(resident) != len(own) {
		t.Fatalf("events say %d blocks, engine holds %d", len(own), len(resident))
	}
	for _, rb := range resident {
		h, ok := own[uint64(rb.EngineHash)]
		if !ok {
			t.Fatalf("resident block %x missing from the events", rb.EngineHash)
		}
		if h != rb.Hash {
			t.Fatalf("block %x: re-hashed %x, engine reports %x", rb.EngineHash, h, rb.Hash)
		}
	}
}
