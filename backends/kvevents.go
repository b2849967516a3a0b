package backends

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvproxy/kvproxy/kv"
)

// KV event feed modes, as in configuration.
const (
	FeedZMQ  = "zmq"  // subscribe to the engine's ZMQ publisher
	FeedHTTP = "http" // the engine (or cache layer) pushes to POST /v1/kv_events
)

// KVFeedConfig configures one backend's KV event feed.
type KVFeedConfig struct {
	Backend   string    // backend id (the worker name of data-parallel rank 0)
	Mode      string    // FeedZMQ or FeedHTTP
	ZMQ       ZMQConfig // FeedZMQ: endpoints and topic
	BlockSize int       // the router's block size (0: kv.DefaultBlockSize)
	Shared    bool      // a pool-wide cache layer: blocks go to tier shared
}

// KVFeed is one backend's KV event feed: its applier and, in zmq mode, the
// subscriber that feeds it. It puts the backend's workers in event mode.
type KVFeed struct {
	cfg     KVFeedConfig
	applier *KVApplier
	sub     *ZMQSubscriber
	cancel  context.CancelFunc
	done    chan struct{}
}

// KVFeedStats is what /admin/backends shows of a feed.
type KVFeedStats struct {
	Mode  string
	ZMQ   *ZMQStats // nil in http mode
	Apply KVApplyStats
}

// StartKVFeed starts a backend's feed (in zmq mode, a subscriber goroutine
// that runs until Close).
func StartKVFeed(cfg KVFeedConfig, workers Workers) (*KVFeed, error) {
	if cfg.Backend == "" {
		return nil, errors.New("kv feed: backend id required")
	}
	f := &KVFeed{cfg: cfg, done: make(chan struct{})}
	switch cfg.Mode {
	case FeedZMQ:
		if cfg.ZMQ.Endpoint == "" {
			return nil, fmt.Errorf("kv feed %s: zmq mode needs an endpoint", cfg.Backend)
		}
	case FeedHTTP:
	default:
		return nil, fmt.Errorf("kv feed %s: mode %q, want %s or %s", cfg.Backend, cfg.Mode, FeedZMQ, FeedHTTP)
	}
	f.applier = NewKVApplier(KVApplierConfig{Backend: cfg.Backend, BlockSize: cfg.BlockSize, Shared: cfg.Shared}, workers)
	if cfg.Mode != FeedZMQ {
		close(f.done)
		return f, nil
	}
	f.sub = NewZMQSubscriber(cfg.ZMQ, f.applier)
	ctx, cancel := context.WithCancel(context.Background())
	f.cancel = cancel
	go func() {
		defer close(f.done)
		f.sub.Run(ctx)
	}()
	return f, nil
}

// Applier is the feed's applier (for HTTP pushes, inspection).
func (f *KVFeed) Applier() *KVApplier { return f.applier }

// Subscriber is the feed's ZMQ subscriber, nil in http mode.
func (f *KVFeed) Subscriber() *ZMQSubscriber { return f.sub }

// Push applies a batch pushed over HTTP (already validated by
// kv.ParseHTTPBatch). A zmq-mode feed accepts pushes too.
func (f *KVFeed) Push(b kv.HTTPBatch) {
	f.applier.ApplyEvents(b.DPRank, b.Events)
}

// PushSalted is Push for a batch whose sequences were cached under a cache
// salt (the salt the proxy gives b.Tenant): stored sequences are seeded in
// that tenant's namespace.
func (f *KVFeed) PushSalted(b kv.HTTPBatch, salt string) {
	if salt == "" {
		f.Push(b)
		return
	}
	f.applier.ApplySalted(b.DPRank, b.Events, func(int) string { return salt })
}

// Stats snapshots the feed's counters.
func (f *KVFeed) Stats() KVFeedStats {
	s := KVFeedStats{Mode: f.cfg.Mode, Apply: f.applier.Stats()}
	if f.sub != nil {
		z := f.sub.Stats()
		s.ZMQ = &z
	}
	return s
}

// Close stops the subscriber, drops every block the backend's workers hold
// and ignores later pushes (backend removed from configuration). Removing
// the workers from the router (Applier().WorkerIDs()) is the caller's part.
func (f *KVFeed) Close() {
	if f.cancel != nil {
		f.cancel()
	}
	<-f.done
	f.applier.Close()
}
