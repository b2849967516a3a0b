package backends

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"

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
	ZMQ       ZMQConfig // FeedZMQ: endpoints and topic (of rank 0); either mode: OnChange also hears of the applier's problems
	BlockSize int       // the router's block size (0: kv.DefaultBlockSize)
	Shared    bool      // a pool-wide cache layer: blocks go to tier shared
	// DPSize is the number of data-parallel ranks of the engine. In zmq
	// mode vLLM publishes rank r on the endpoints' port + r (OffsetEndpoint);
	// one subscriber follows each. 0 or 1: one rank.
	DPSize int
	// Namespace is KVApplierConfig.Namespace (nil: its default).
	Namespace func(lora, salt string) kv.Namespace
	// MaxBlocks is KVApplierConfig.MaxBlocks (0: its default).
	MaxBlocks int
}

// KVFeed is one backend's KV event feed: its applier and, in zmq mode, the
// subscriber that feeds it. It puts the backend's workers in event mode.
type KVFeed struct {
	cfg     KVFeedConfig
	applier *KVApplier
	subs    []*ZMQSubscriber // one per data-parallel rank (zmq mode)
	cancel  context.CancelFunc
	done    chan struct{}

	// pushMu orders pushed batches, so that each rank's KV cache group
	// (pushGroups) is chosen in the order its events are applied.
	pushMu     sync.Mutex
	pushGroups map[int]*kv.GroupFollower
}

// KVFeedStats is what /admin/backends shows of a feed.
type KVFeedStats struct {
	Mode string
	// ZMQ sums the subscribers' counters (nil in http mode): Connected
	// when every rank is, LastSeq of rank 0, the first LastError.
	ZMQ      *ZMQStats
	ZMQRanks []ZMQStats // per data-parallel rank
	Apply    KVApplyStats
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
	var zcfgs []ZMQConfig
	if cfg.Mode == FeedZMQ {
		for r := 0; r < max(1, cfg.DPSize); r++ {
			z := cfg.ZMQ
			z.DPRank = r
			var err error
			if z.Endpoint, err = OffsetEndpoint(z.Endpoint, r); err != nil {
				return nil, fmt.Errorf("kv feed %s: %w", cfg.Backend, err)
			}
			if z.ReplayEndpoint != "" {
				if z.ReplayEndpoint, err = OffsetEndpoint(z.ReplayEndpoint, r); err != nil {
					return nil, fmt.Errorf("kv feed %s: %w", cfg.Backend, err)
				}
			}
			zcfgs = append(zcfgs, z)
		}
	}
	f.applier = NewKVApplier(KVApplierConfig{Backend: cfg.Backend, BlockSize: cfg.BlockSize, Shared: cfg.Shared, Namespace: cfg.Namespace,
		MaxBlocks: cfg.MaxBlocks, OnProblem: cfg.ZMQ.OnChange}, workers)
	// The ranks it has are routed from the start (requests for rank 0
	// name it, so the others would get none before their events).
	f.applier.AddRanks(max(len(zcfgs), cfg.DPSize))
	if len(zcfgs) == 0 {
		close(f.done)
		return f, nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	f.cancel = cancel
	running := make(chan struct{}, len(zcfgs))
	for _, z := range zcfgs {
		sub := NewZMQSubscriber(z, f.applier)
		f.subs = append(f.subs, sub)
		go func() {
			defer func() { running <- struct{}{} }()
			sub.Run(ctx)
		}()
	}
	go func() {
		for range zcfgs {
			<-running
		}
		close(f.done)
	}()
	return f, nil
}

// OffsetEndpoint is the endpoint of data-parallel rank r, as vLLM derives
// it from rank 0's: tcp ports are offset by r (tcp://host:5557 →
// tcp://host:5558 for rank 1), inproc names get the suffix "_dp<r>".
func OffsetEndpoint(ep string, r int) (string, error) {
	if r == 0 {
		return ep, nil
	}
	switch {
	case strings.HasPrefix(ep, "inproc://"):
		return ep + "_dp" + strconv.Itoa(r), nil
	case strings.HasPrefix(ep, "tcp://"):
		host, port, err := net.SplitHostPort(ep[len("tcp://"):])
		if err != nil {
			return "", fmt.Errorf("endpoint %q: %w", ep, err)
		}
		p, err := strconv.Atoi(port)
		if err != nil || p+r > 65535 {
			return "", fmt.Errorf("endpoint %q: cannot offset port %q by rank %d", ep, port, r)
		}
		return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+r)), nil
	}
	return "", fmt.Errorf("endpoint %q: data-parallel ranks need a tcp:// or inproc:// endpoint", ep)
}

// Applier is the feed's applier (for HTTP pushes, inspection).
func (f *KVFeed) Applier() *KVApplier { return f.applier }

// Subscriber is the ZMQ subscriber of rank 0, nil in http mode.
func (f *KVFeed) Subscriber() *ZMQSubscriber {
	if len(f.subs) == 0 {
		return nil
	}
	return f.subs[0]
}

// Subscribers are the ZMQ subscribers, one per data-parallel rank.
func (f *KVFeed) Subscribers() []*ZMQSubscriber { return f.subs }

// Push applies a batch pushed over HTTP (already validated by
// kv.ParseHTTPBatch), and says how many of its events were applied: not
// those of another KV cache group than its rank follows, nor any of a
// rank past MaxDPRank. A zmq-mode feed accepts pushes too.
func (f *KVFeed) Push(b kv.HTTPBatch) int {
	return f.PushSalted(b, "")
}

// PushSalted is Push for a batch whose sequences were cached under a cache
// salt (the salt the proxy gives b.Tenant): stored sequences are seeded in
// that tenant's namespace.
func (f *KVFeed) PushSalted(b kv.HTTPBatch, salt string) int {
	if b.DPRank < 0 || b.DPRank > MaxDPRank {
		f.applier.ApplyEvents(b.DPRank, nil) // counted as a bad rank
		return 0
	}
	f.pushMu.Lock()
	defer f.pushMu.Unlock()
	events, applied := f.followed(b)
	if salt == "" {
		f.applier.ApplyEvents(b.DPRank, events)
	} else {
		f.applier.ApplySalted(b.DPRank, events, func(int) string { return salt })
	}
	return applied
}

// Clear drops every block of every rank (a backend away too long), and
// the KV cache groups pushes chose: what comes next chooses again.
func (f *KVFeed) Clear() {
	f.pushMu.Lock() // a push between the two would keep a choice whose blocks went
	defer f.pushMu.Unlock()
	clear(f.pushGroups)
	f.applier.Clear()
}

// followed is the batch's events of the KV cache group its rank follows,
// with a clear where the group followed changes, as the ZMQ decoder does
// (kv.GroupFollower), and how many of the batch's events they hold.
// Without groups named, and group 0 followed, they are the batch's own. A
// pushed all_blocks_cleared makes the choice again (an HTTP feed has no
// other sign of an engine restarted, perhaps with another layout).
func (f *KVFeed) followed(b kv.HTTPBatch) ([]kv.Event, int) {
	g := f.pushGroups[b.DPRank]
	if g == nil {
		if b.Groups == nil {
			return b.Events, len(b.Events) // group 0, followed until an event names a kind
		}
		if f.pushGroups == nil {
			f.pushGroups = map[int]*kv.GroupFollower{}
		}
		g = new(kv.GroupFollower)
		f.pushGroups[b.DPRank] = g
	}
	var out []kv.Event // nil while the batch's events pass unchanged
	applied := 0
	for i, ev := range b.Events {
		var group kv.EventGroup
		if b.Groups != nil {
			group = b.Groups[i]
		}
		follow, changed := g.Follow(ev.Kind, group.Index, group.Kind)
		if out == nil && (changed || !follow) {
			out = append(make([]kv.Event, 0, len(b.Events)+1), b.Events[:i]...)
		}
		if changed {
			out = append(out, kv.Event{Kind: kv.AllBlocksCleared})
		}
		if follow {
			applied++
			if out != nil {
				out = append(out, ev)
			}
		}
	}
	if out == nil {
		return b.Events, applied
	}
	return out, applied
}

// Stats snapshots the feed's counters.
func (f *KVFeed) Stats() KVFeedStats {
	s := KVFeedStats{Mode: f.cfg.Mode, Apply: f.applier.Stats()}
	if len(f.subs) == 0 {
		return s
	}
	sum := ZMQStats{Connected: true}
	for i, sub := range f.subs {
		z := sub.Stats()
		s.ZMQRanks = append(s.ZMQRanks, z)
		if i == 0 {
			sum.LastSeq = z.LastSeq
		}
		if sum.LastError == "" {
			sum.LastError = z.LastError
		}
		sum.Stale = sum.Stale || z.Stale
		sum.Connected = sum.Connected && z.Connected
		sum.Batches += z.Batches
		sum.Events += z.Events
		sum.Replays += z.Replays
		sum.Replayed += z.Replayed
		sum.Clears += z.Clears
		sum.Reconnects += z.Reconnects
		sum.DecodeErrors += z.DecodeErrors
		sum.UnknownMedia += z.UnknownMedia
		sum.MalformedEvents += z.MalformedEvents
	}
	s.ZMQ = &sum
	return s
}

// Close stops the subscriber, drops every block the backend's workers hold
// and ignores later pushes (backend removed from configuration). Removing
// the workers from the router (Applier().WorkerIDs()) is the caller's part.
// Calling it again does nothing.
func (f *KVFeed) Close() {
	if f.cancel != nil {
		f.cancel()
	}
	<-f.done
	f.applier.Close()
}
