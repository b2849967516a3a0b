package mockengine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvproxy/kvproxy/kv"
)

// PublisherConfig configures a vLLM-compatible KV event publisher.
type PublisherConfig struct {
	// Endpoint is where the PUB socket listens, e.g. "tcp://127.0.0.1:5557"
	// (port 0 picks a free port; see Publisher.Endpoint).
	Endpoint string
	// ReplayEndpoint is where the replay ROUTER socket listens; "" disables
	// replay.
	ReplayEndpoint string
	Topic          string
	// Encoding is kv.VLLMArrays (default, msgspec array_like) or kv.VLLMMaps.
	Encoding kv.VLLMEncoding
	// BufferSteps is how many past batches replay can serve, default 10000
	// (vLLM's buffer_steps).
	BufferSteps int
	// DPRank is the data_parallel_rank written in every batch.
	DPRank int
	// Interval is how often an attached Engine's events are drained and
	// published as one batch, default 5ms (vLLM publishes once per scheduler
	// step; a simulated step is usually shorter).
	Interval time.Duration
}

// Publisher publishes KV event batches the way vLLM's ZmqEventPublisher does:
// PUB frames [topic, seq (u64 big-endian), msgpack payload], seq counting
// from 0, and a ROUTER socket that answers a request [empty, start seq u64
// BE] with [empty, seq, payload] for every buffered batch from start, then
// [empty, -1 (8 bytes 0xff), empty].
type Publisher struct {
	cfg    PublisherConfig
	ctx    context.Context
	cancel context.CancelFunc
	pub    zmq4.Socket
	router zmq4.Socket
	done   chan struct{}

	mu     sync.Mutex // guards everything below, and sends on pub
	next   uint64
	ring   []pubBatch // bounded replay buffer, oldest at head
	head   int
	closed bool
	errors atomic.Uint64
}

type pubBatch struct {
	seq     uint64
	payload []byte
}

// NewPublisher binds the PUB (and replay ROUTER) sockets.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.Endpoint == "" {
		return nil, errors.New("mockengine: publisher needs an endpoint")
	}
	if cfg.BufferSteps <= 0 {
		cfg.BufferSteps = 10000
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 5 * time.Millisecond
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{cfg: cfg, ctx: ctx, cancel: cancel, done: make(chan struct{})}
	p.pub = zmq4.NewPub(ctx)
	if err := p.pub.Listen(cfg.Endpoint); err != nil {
		cancel()
		p.pub.Close()
		return nil, fmt.Errorf("mockengine: publisher %s: %w", cfg.Endpoint, err)
	}
	if cfg.ReplayEndpoint == "" {
		close(p.done)
		return p, nil
	}
	p.router = zmq4.NewRouter(ctx)
	if err := p.router.Listen(cfg.ReplayEndpoint); err != nil {
		cancel()
		p.pub.Close()
		p.router.Close()
		return nil, fmt.Errorf("mockengine: replay %s: %w", cfg.ReplayEndpoint, err)
	}
	go p.serveReplay()
	return p, nil
}

// Endpoint is the PUB address to dial (with the real port).
func (p *Publisher) Endpoint() string { return listenAddr(p.cfg.Endpoint, p.pub) }

// ReplayEndpoint is the replay ROUTER address to dial, or "".
func (p *Publisher) ReplayEndpoint() string {
	if p.router == nil {
		return ""
	}
	return listenAddr(p.cfg.ReplayEndpoint, p.router)
}

func listenAddr(ep string, s zmq4.Socket) string {
	if a := s.Addr(); a != nil {
		if i := strings.Index(ep, "://"); i >= 0 {
			return ep[:i+3] + a.String()
		}
	}
	return ep
}

// Publish encodes events as one batch, publishes it and keeps it for
// replay. It returns the batch's seq. Publishing after Close is a no-op.
func (p *Publisher) Publish(events []kv.Event) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, errors.New("mockengine: publisher closed")
	}
	ts := float64(time.Now().UnixNano()) / 1e9
	payload := kv.AppendVLLMBatch(nil, ts, events, p.cfg.DPRank, p.cfg.Encoding)
	seq := p.next
	p.next++
	if len(p.ring) < p.cfg.BufferSteps {
		p.ring = append(p.ring, pubBatch{seq, payload})
	} else {
		p.ring[p.head] = pubBatch{seq, payload}
		p.head = (p.head + 1) % len(p.ring)
	}
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], seq)
	// PUB never blocks on slow subscribers: zmq4 drops for them, and they
	// recover through replay.
	return seq, p.pub.Send(zmq4.NewMsgFrom([]byte(p.cfg.Topic), sb[:], payload))
}

// OnEvents publishes events as one batch; it has the signature of
// Config.OnEvents, so an Engine can publish each scheduler step's events as
// vLLM does. A failed send is counted (Errors); the batch stays replayable.
func (p *Publisher) OnEvents(events []kv.Event) {
	if _, err := p.Publish(events); err != nil {
		p.errors.Add(1)
	}
}

// Errors is the number of batches OnEvents failed to send.
func (p *Publisher) Errors() uint64 { return p.errors.Load() }

// Published is the number of batches published so far (the next seq).
func (p *Publisher) Published() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next
}

// since copies the buffered batches with seq >= start, oldest first.
func (p *Publisher) since(start uint64) []pubBatch {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []pubBatch
	for i := range p.ring {
		b := p.ring[(p.head+i)%len(p.ring)]
		if b.seq >= start {
			out = append(out, b)
		}
	}
	return out
}

var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

func (p *Publisher) serveReplay() {
	defer close(p.done)
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if p.ctx.Err() != nil {
				return
			}
			continue
		}
		// [identity, empty, start] from a REQ or a DEALER that sends the
		// delimiter (vLLM's contract); [identity, start] is accepted too.
		f := msg.Frames
		if len(f) == 3 && len(f[1]) == 0 {
			f = [][]byte{f[0], f[2]}
		}
		if len(f) != 2 || len(f[1]) != 8 {
			continue
		}
		id, start := f[0], binary.BigEndian.Uint64(f[1])
		for _, b := range p.since(start) {
			var sb [8]byte
			binary.BigEndian.PutUint64(sb[:], b.seq)
			if p.router.Send(zmq4.NewMsgFrom(id, []byte{}, sb[:], b.payload)) != nil {
				break
			}
		}
		p.router.Send(zmq4.NewMsgFrom(id, []byte{}, endSeq, []byte{}))
	}
}

// Close stops publishing and closes the sockets.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	err := p.pub.Close()
	if p.router != nil {
		p.router.Close()
	}
	<-p.done
	return err
}

// EventFeed publishes one Engine's cache events through a Publisher.
type EventFeed struct {
	e    *Engine
	p    *Publisher
	mu   sync.Mutex // one drain+publish at a time, so batches keep their order
	buf  []kv.Event
	stop chan struct{}
	once sync.Once
	done chan struct{}
}

// PublishEvents makes the engine record its cache events (BlockStored with
// token ids and parent, BlockRemoved on eviction, medium per tier) and
// publishes them through p: every p's Interval, the events recorded since
// the last drain become one batch (nothing is sent when nothing changed).
// Stop the feed before closing p.
func (e *Engine) PublishEvents(p *Publisher) *EventFeed {
	e.mu.Lock()
	e.model.events.on = true
	e.mu.Unlock()
	f := &EventFeed{e: e, p: p, stop: make(chan struct{}), done: make(chan struct{})}
	go f.loop()
	return f
}

func (f *EventFeed) loop() {
	defer close(f.done)
	t := time.NewTicker(f.p.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			f.Flush()
		case <-f.stop:
			f.Flush()
			return
		}
	}
}

// Flush publishes the events recorded so far as one batch, now. Tests call
// it after a request completes instead of waiting for the ticker.
func (f *EventFeed) Flush() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.e.mu.Lock()
	f.buf = f.e.model.DrainEvents(f.buf[:0])
	f.e.mu.Unlock()
	if len(f.buf) == 0 {
		return nil
	}
	_, err := f.p.Publish(f.buf)
	clear(f.buf) // drop references to the model's event storage
	return err
}

// Stop publishes what is pending, ends the feed and stops the engine
// recording events (so they do not pile up unread).
func (f *EventFeed) Stop() {
	f.once.Do(func() { close(f.stop) })
	<-f.done
	f.e.mu.Lock()
	f.e.model.events.on = false
	f.e.mu.Unlock()
}
