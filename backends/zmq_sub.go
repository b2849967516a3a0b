package backends

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/zeebo/xxh3"

	"github.com/kvproxy/kvproxy/kv"
)

// EventSink receives the decoded KV events of one backend, in publication
// order, from one goroutine. Events (and their slices) are valid only during
// the call. ClearRanks means the cache picture of those data-parallel ranks
// can no longer be trusted (engine restart, a gap replay could not fill, an
// undecodable batch): every block they hold must be dropped.
//
// vLLM publishes each data-parallel rank on its own endpoint (port + rank),
// so one subscriber per endpoint may share a sink: a subscriber clears only
// the ranks it has seen on its own feed.
type EventSink interface {
	ApplyEvents(dpRank int, events []kv.Event)
	ClearRanks(ranks []int)
}

// StaleSink is an EventSink that can route a rank without its events. A
// subscriber whose feed has been down for longer than ZMQConfig.StaleAfter
// calls FeedDown: what the index holds of the rank is dropped (the engine
// may have restarted or evicted meanwhile, and nothing says so) and the rank
// is routed on the router's own records until FeedUp, when the feed is
// back and its replay rebuilds what the engine still buffers.
type StaleSink interface {
	EventSink
	FeedDown(dpRank int)
	FeedUp(dpRank int)
}

// SaltedSink is an EventSink that also takes each event's cache salt
// (salt(i) for events[i], valid during the call), which vLLM reports in
// extra_keys: the subscriber uses ApplySalted when its sink has it.
type SaltedSink interface {
	EventSink
	ApplySalted(dpRank int, events []kv.Event, salt func(i int) string)
}

// ZMQConfig configures one backend's vLLM/SGLang ZMQ event feed.
// Zero durations take the defaults noted.
type ZMQConfig struct {
	Endpoint       string        // PUB endpoint, e.g. tcp://10.0.0.5:5557
	ReplayEndpoint string        // ROUTER endpoint for replay; "" means gaps cannot be filled
	Topic          string        // subscription prefix; "" receives every topic
	DialTimeout    time.Duration // one connection attempt, default 2s
	BackoffMin     time.Duration // first retry delay after a failed dial or a lost connection, default 100ms
	BackoffMax     time.Duration // retry delay cap, default 5s
	ReplayTimeout  time.Duration // the wait for each reply of a replay, default 3s
	// StaleAfter is how long the feed may be down before its rank's index
	// entries are dropped and the rank is routed approximately (StaleSink),
	// default 30s: longer than an engine restart takes to reconnect.
	StaleAfter time.Duration
	// DPRank is the data-parallel rank this endpoint publishes (StartKVFeed
	// sets it): the one a StaleSink routes approximately while it is down.
	DPRank int
	// OnChange, when set, hears of the feed's connections (problem "") and
	// of its problems (a failed dial, a lost connection, a malformed
	// message, a failed replay, an index cleared), from the goroutine of
	// each feed this config starts (one per data-parallel rank, at the
	// same time); not of every batch. Through StartKVFeed, in either mode,
	// it also hears of the applier's problems (a block size mismatch, from
	// whichever goroutine delivered the events).
	OnChange func(problem string)
}

func (c ZMQConfig) withDefaults() ZMQConfig {
	if c.DialTimeout <= 0 {
		c.DialTimeout = 2 * time.Second
	}
	if c.BackoffMin <= 0 {
		c.BackoffMin = 100 * time.Millisecond
	}
	if c.BackoffMax < c.BackoffMin {
		c.BackoffMax = max(5*time.Second, c.BackoffMin)
	}
	if c.ReplayTimeout <= 0 {
		c.ReplayTimeout = 3 * time.Second
	}
	if c.StaleAfter <= 0 {
		c.StaleAfter = 30 * time.Second
	}
	return c
}

// ZMQStats is a snapshot of a subscriber's counters, for /admin/backends.
type ZMQStats struct {
	Connected    bool
	Batches      uint64 // batches applied (live and replayed)
	Events       uint64 // events applied
	LastSeq      int64  // last applied sequence number, -1 before the first
	Replays      uint64 // replay exchanges attempted
	Replayed     uint64 // batches applied from replays
	Clears       uint64 // times the backend's blocks were dropped
	Reconnects   uint64 // connections re-established after a loss
	DecodeErrors uint64 // payloads that failed to decode (each clears)
	// MalformedEvents counts events that could not be read in a batch that
	// was otherwise applied: skipped, or in place of one that may have
	// removed blocks, its rank's blocks dropped (kv.VLLMDecoder.Skipped).
	MalformedEvents uint64
	UnknownMedia    uint64 // events with an unrecognised medium (indexed as disk)
	// Stale: the feed has been down for longer than StaleAfter, its rank
	// routed approximately (with a StaleSink).
	Stale     bool
	LastError string // the last dial, replay or decode problem since the feed last connected
}

// ZMQSubscriber follows one engine's KV event feed: a SUB socket reading
// [topic, seq (u64 big-endian), msgpack payload], sequence tracking, replay of
// missed batches over a DEALER socket, and reconnection with backoff.
//
// Sequence rules: the next expected batch is last+1. A higher seq replays the
// missing range from the replay endpoint; if the replay cannot supply exactly
// the missing batches (no endpoint, error, timeout, buffer already moved on),
// the sink is cleared and the feed restarts from what it has. A seq not above
// the last one seen on the live stream means the engine restarted: the sink
// is cleared. Duplicates of replayed batches are dropped. After a lost
// connection the subscriber redials with backoff and replays from the last
// applied batch at once, which must come back byte-identical (see resume):
// otherwise the engine restarted meanwhile and the sink is cleared.
//
// Once connected with nothing applied (at start, after a clear), and on its
// first message after an engine restart, the subscriber asks the replay
// endpoint for everything from seq 0, so a proxy that starts after its
// engines rebuilds as much of their history as the engines still buffer,
// whether or not they are storing new blocks (an engine answering from its
// cache publishes nothing).
//
// A feed down for longer than StaleAfter can no longer vouch for the index:
// a StaleSink drops the rank's entries and routes it approximately until the
// feed is back.
type ZMQSubscriber struct {
	cfg  ZMQConfig
	sink EventSink
	dec  kv.VLLMDecoder

	// feed state, owned by the Run goroutine
	have    bool   // a batch has been applied since the last clear
	applied uint64 // last applied seq (valid when have)
	// appliedSum is the xxh3 of the last applied payload: after a
	// reconnection, the engine's replay of that seq must be the same bytes,
	// or the engine restarted while we were away.
	appliedSum uint64
	subHave    bool   // a live message has been seen in this engine incarnation
	subLast    uint64 // last seq seen on the live stream
	ranks      []int  // data-parallel ranks seen on this feed
	saltOf     func(int) string

	stale                              atomic.Bool // FeedDown was called (Run goroutine writes)
	connected                          atomic.Bool
	batches, events, replays, replayed atomic.Uint64
	clears, reconnects, decodeErrors   atomic.Uint64
	lastSeq                            atomic.Int64
	unknownMedia, malformed            atomic.Uint64
	mu                                 sync.Mutex
	lastErr                            string
	changed                            chan struct{} // made by Wait, closed on the next state change
}

// NewZMQSubscriber returns a subscriber feeding sink. Call Run to start it.
func NewZMQSubscriber(cfg ZMQConfig, sink EventSink) *ZMQSubscriber {
	s := &ZMQSubscriber{cfg: cfg.withDefaults(), sink: sink}
	s.saltOf = s.dec.CacheSalt
	s.lastSeq.Store(-1)
	return s
}

// Stats returns the current counters. Safe for concurrent use.
func (s *ZMQSubscriber) Stats() ZMQStats {
	s.mu.Lock()
	lastErr := s.lastErr
	s.mu.Unlock()
	return ZMQStats{
		Connected: s.connected.Load(), Batches: s.batches.Load(), Events: s.events.Load(),
		LastSeq: s.lastSeq.Load(), Replays: s.replays.Load(), Replayed: s.replayed.Load(),
		Clears: s.clears.Load(), Reconnects: s.reconnects.Load(), DecodeErrors: s.decodeErrors.Load(), UnknownMedia: s.unknownMedia.Load(),
		MalformedEvents: s.malformed.Load(), Stale: s.stale.Load(), LastError: lastErr,
	}
}

// Wait blocks until cond holds for the subscriber's stats or ctx ends. It is
// how tests (and callers) wait for the feed to catch up without sleeping:
// cond is re-checked after every change.
func (s *ZMQSubscriber) Wait(ctx context.Context, cond func(ZMQStats) bool) error {
	for {
		s.mu.Lock()
		if s.changed == nil {
			s.changed = make(chan struct{})
		}
		ch := s.changed
		s.mu.Unlock()
		if cond(s.Stats()) {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("waiting for the event feed of %s: %w (stats %+v)", s.cfg.Endpoint, ctx.Err(), s.Stats())
		}
	}
}

// report tells OnChange of a connection (problem "") or a problem, and
// wakes Wait.
func (s *ZMQSubscriber) report(problem string) {
	if s.cfg.OnChange != nil {
		s.cfg.OnChange(problem)
	}
	s.notify(problem)
}

func (s *ZMQSubscriber) notify(errMsg string) {
	s.mu.Lock()
	if errMsg != "" {
		s.lastErr = errMsg
	}
	if s.changed != nil { // someone waits
		close(s.changed)
		s.changed = nil
	}
	s.mu.Unlock()
}

// Run follows the feed until ctx ends. It returns ctx's error.
func (s *ZMQSubscriber) Run(ctx context.Context) error {
	backoff := s.cfg.BackoffMin
	everConnected := false
	downSince := time.Now()
	for {
		sub, err := s.dial(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			s.report("dial " + s.cfg.Endpoint + ": " + err.Error())
			s.checkStale(downSince)
			if !sleepCtx(ctx, backoff) {
				return ctx.Err()
			}
			backoff = min(2*backoff, s.cfg.BackoffMax)
			continue
		}
		backoff = s.cfg.BackoffMin
		s.connected.Store(true)
		s.mu.Lock()
		s.lastErr = "" // the dial errors that led here are over
		s.mu.Unlock()
		if s.stale.Swap(false) {
			if ss, ok := s.sink.(StaleSink); ok {
				ss.FeedUp(s.cfg.DPRank)
			}
		}
		if everConnected {
			s.reconnects.Add(1)
		}
		everConnected = true
		switch {
		case s.have:
			s.resume(ctx)
		case s.cfg.ReplayEndpoint != "":
			s.catchUp(ctx, 0)
		}
		if ctx.Err() == nil { // stopped during the replay: not "connected"
			s.report("")
		}
		err = s.readLoop(ctx, sub)
		sub.shut()
		s.connected.Store(false)
		downSince = time.Now()
		if ctx.Err() != nil {
			s.notify("")
			return ctx.Err()
		}
		s.report("connection to " + s.cfg.Endpoint + " lost: " + err.Error())
		if !sleepCtx(ctx, backoff) {
			return ctx.Err()
		}
	}
}

// checkStale gives up on the index of a feed down since downSince for
// longer than StaleAfter: the sink drops its rank's entries and routes it
// approximately (StaleSink), or just drops them. Once per outage.
func (s *ZMQSubscriber) checkStale(downSince time.Time) {
	if s.stale.Load() || time.Since(downSince) < s.cfg.StaleAfter {
		return
	}
	if ss, ok := s.sink.(StaleSink); ok {
		ss.FeedDown(s.cfg.DPRank)
	} else {
		s.sink.ClearRanks([]int{s.cfg.DPRank})
	}
	s.have, s.subHave = false, false
	s.clears.Add(1)
	s.stale.Store(true) // after the entries went: Stats says stale once it is so
	s.report(fmt.Sprintf("stale: down for more than %v, the index entries of rank %d dropped; it is routed on kvproxy's own records until the feed is back", s.cfg.StaleAfter, s.cfg.DPRank))
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func (s *ZMQSubscriber) dial(ctx context.Context) (*socket, error) {
	sub := newSocket(ctx, s.cfg.Endpoint, zmq4.NewSub, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(s.cfg.DialTimeout))
	if err := sub.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		sub.shut()
		return nil, err
	}
	if err := sub.Dial(s.cfg.Endpoint); err != nil {
		sub.shut()
		return nil, err
	}
	return sub, nil
}

// readLoop applies what the socket receives until it fails; once ctx has
// ended, it only drains the socket (see socket).
func (s *ZMQSubscriber) readLoop(ctx context.Context, sub *socket) error {
	for {
		msg, err := sub.Recv()
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			continue
		}
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			s.report(fmt.Sprintf("malformed message: %d frames", len(msg.Frames)))
			continue
		}
		if !strings.HasPrefix(string(msg.Frames[0]), s.cfg.Topic) {
			continue
		}
		s.onLive(ctx, binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2])
	}
}

// onLive handles one batch from the live stream.
func (s *ZMQSubscriber) onLive(ctx context.Context, seq uint64, payload []byte) {
	if s.subHave && seq <= s.subLast {
		s.clear("sequence went back from " + fmt.Sprint(s.subLast) + " to " + fmt.Sprint(seq) + ": engine restarted")
		s.subHave = false
	}
	firstOfIncarnation := !s.subHave
	s.subHave, s.subLast = true, seq
	switch {
	case s.have && seq > s.applied+1:
		s.catchUp(ctx, s.applied+1)
	case !s.have && firstOfIncarnation && seq > 0 && s.cfg.ReplayEndpoint != "":
		s.catchUp(ctx, 0)
	}
	s.deliver(seq, payload)
}

// deliver applies one batch in sequence order: duplicates are dropped, and a
// batch that does not follow the last applied one clears the sink first (the
// missing batches are lost for good).
func (s *ZMQSubscriber) deliver(seq uint64, payload []byte) bool {
	if s.have {
		if seq <= s.applied {
			return false
		}
		if seq != s.applied+1 {
			s.clear(fmt.Sprintf("batches %d..%d lost", s.applied+1, seq-1))
		}
	}
	_, events, rank, err := s.dec.Decode(payload)
	if err != nil {
		s.decodeErrors.Add(1)
		s.clear(fmt.Sprintf("batch %d: %v", seq, err))
		// The batch is consumed: its effect is unknown, the sink is empty,
		// and the feed continues from here.
		s.have, s.applied, s.appliedSum = true, seq, xxh3.Hash(payload)
		s.lastSeq.Store(int64(seq))
		s.notify("") // a waiter for seq woke at the clear, before it was applied
		return true
	}
	if !slices.Contains(s.ranks, rank) {
		s.ranks = append(s.ranks, rank)
	}
	s.unknownMedia.Store(s.dec.UnknownMedia)
	s.malformed.Store(s.dec.Malformed)
	if ss, ok := s.sink.(SaltedSink); ok {
		ss.ApplySalted(rank, events, s.saltOf)
	} else {
		s.sink.ApplyEvents(rank, events)
	}
	s.have, s.applied, s.appliedSum = true, seq, xxh3.Hash(payload)
	s.batches.Add(1)
	s.events.Add(uint64(len(events)))
	// The problem is on record before the batch shows as applied: a waiter
	// for seq may wake at any notify and read both.
	problem := ""
	if sk := s.dec.Skipped(); sk != nil {
		if sk.Cleared {
			s.clears.Add(1)
		}
		problem = fmt.Sprintf("malformed event in batch %d: %v", seq, sk)
		s.mu.Lock()
		s.lastErr = problem
		s.mu.Unlock()
	}
	s.lastSeq.Store(int64(seq))
	if problem != "" {
		s.report(problem)
		return true
	}
	s.notify("")
	return true
}

func (s *ZMQSubscriber) clear(reason string) {
	if len(s.ranks) > 0 {
		s.sink.ClearRanks(s.ranks)
	}
	s.have = false
	s.dec.ForgetGroup() // nothing indexed: the events that come choose it
	s.clears.Add(1)
	s.report("cleared: " + reason)
}

// catchUp replays every buffered batch from seq start and applies them. If
// the replay is impossible or does not begin at start while the sink holds
// state, the sink is cleared (the feed then continues from what it gets).
func (s *ZMQSubscriber) catchUp(ctx context.Context, start uint64) {
	if s.cfg.ReplayEndpoint == "" {
		if s.have {
			s.clear(fmt.Sprintf("gap from batch %d and no replay endpoint", start))
		}
		return
	}
	s.replays.Add(1)
	err := s.replay(ctx, start, func(seq uint64, payload []byte) {
		if s.deliver(seq, payload) {
			s.replayed.Add(1)
		}
	})
	if err != nil && ctx.Err() != nil {
		return // the feed was stopped (a reload replaced its backend): no problem to report
	}
	if err != nil && s.have && s.applied+1 == start {
		// Nothing of the gap arrived: the state is stale.
		s.clear(fmt.Sprintf("replay from %d: %v", start, err))
	} else if err != nil {
		s.report(fmt.Sprintf("replay from %d: %v", start, err))
	}
}

// resume checks, after a reconnection, that the engine is the one we were
// following and replays what we missed. The replay starts at the last
// applied batch: the same seq with the same bytes proves continuity; a
// different or missing batch means the engine restarted (or its buffer moved
// past us), so its blocks are cleared and the new run is followed from the
// oldest batch still buffered. Without a replay endpoint nothing can be
// proven: clear.
func (s *ZMQSubscriber) resume(ctx context.Context) {
	if s.cfg.ReplayEndpoint == "" {
		s.clear("reconnected without a replay endpoint: what was missed is unknown")
		s.subHave = false
		return
	}
	s.replays.Add(1)
	const (
		awaitFirst = iota
		verified
		broken
	)
	state := awaitFirst
	err := s.replay(ctx, s.applied, func(seq uint64, payload []byte) {
		switch state {
		case awaitFirst:
			if seq == s.applied && xxh3.Hash(payload) == s.appliedSum {
				state = verified
			} else {
				state = broken
			}
		case verified:
			if s.deliver(seq, payload) {
				s.replayed.Add(1)
			}
		}
	})
	switch {
	case err != nil && ctx.Err() != nil:
		// The feed was stopped (a reload replaced its backend): nothing to
		// report, and its state goes with it.
	case err != nil:
		s.clear(fmt.Sprintf("replay after reconnecting: %v", err))
	case state != verified:
		s.clear(fmt.Sprintf("after reconnecting, batch %d is gone or different: engine restarted", s.applied))
		s.subHave = false
		s.catchUp(ctx, 0)
	}
}

// replayTurns bounds the replays of every feed of the process at once.
var replayTurns = make(chan struct{}, 8)

// endSeq marks the end of a replay (-1 as a signed 64-bit integer).
const endSeq = ^uint64(0)

// replay asks the ROUTER endpoint for every batch from start: request
// frames ["", seq u64 BE], reply frames ["", seq, payload] ending with
// seq == -1. (vLLM's ROUTER expects the empty delimiter a REQ socket would
// send; replies are accepted with or without it.)
func (s *ZMQSubscriber) replay(ctx context.Context, start uint64, fn func(seq uint64, payload []byte)) error {
	// A fleet's feeds all replay at once at a start or a reload: 256 of
	// them together ran every one out of its time, and under traffic the
	// index was cleared more than rebuilt (the scale trial). The wait for
	// a turn is not the replay's.
	select {
	case replayTurns <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-replayTurns }()
	// ReplayTimeout bounds the wait for each reply, not the exchange: an
	// engine with a deep buffer may take longer to send it all.
	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	silent := fmt.Errorf("no replay reply within %v", s.cfg.ReplayTimeout)
	idle := time.AfterFunc(s.cfg.ReplayTimeout, func() { cancel(silent) })
	defer idle.Stop()
	dealer := newSocket(rctx, s.cfg.ReplayEndpoint, zmq4.NewDealer, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(s.cfg.DialTimeout))
	defer dealer.shut()
	if err := dealer.Dial(s.cfg.ReplayEndpoint); err != nil {
		if rctx.Err() != nil {
			return context.Cause(rctx)
		}
		return err
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], start)
	if err := dealer.Send(zmq4.NewMsgFrom([]byte{}, req[:])); err != nil {
		return err
	}
	for {
		msg, err := dealer.Recv()
		if rctx.Err() != nil {
			return context.Cause(rctx)
		}
		if err != nil {
			return err
		}
		idle.Reset(s.cfg.ReplayTimeout)
		frames := msg.Frames
		if len(frames) > 0 && len(frames[0]) == 0 {
			frames = frames[1:]
		}
		if len(frames) < 1 || len(frames[0]) != 8 {
			return errors.New("malformed replay reply")
		}
		seq := binary.BigEndian.Uint64(frames[0])
		if seq == endSeq {
			return nil
		}
		if len(frames) != 2 {
			return errors.New("malformed replay reply")
		}
		fn(seq, frames[1])
	}
}
