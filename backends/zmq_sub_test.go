package backends

import (
	"context"
	"encoding/binary"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvproxy/kvproxy/internal/testutil"
	"github.com/kvproxy/kvproxy/kv"
)

// testEngine is a vLLM-style publisher on 127.0.0.1: a PUB socket sending
// [topic, seq, payload] and a ROUTER socket answering replay requests from a
// bounded buffer, exactly as vLLM's ZmqEventPublisher does.
type testEngine struct {
	t        testing.TB
	ctx      context.Context
	pubAddr  string
	pub      zmq4.Socket
	router   zmq4.Socket
	mu       sync.Mutex
	next     uint64
	buf      [][2][]byte // [seq, payload]
	bufMax   int
	topic    string
	dropLive bool   // buffer but do not publish (a lost message)
	stop     func() // closes its sockets: the engine is gone
	// replayGap is the time between the replies of a replay; replaying,
	// when set, counts the replays it serves at once (with other engines).
	replayGap time.Duration
	replaying *concurrency
}

// slowReplay buffers n batches the engine does not publish (only a replay
// brings them), and makes its replays reply every gap, counted in count
// (nil: not counted).
func (e *testEngine) slowReplay(n int, gap time.Duration, count *concurrency) {
	e.dropLive = true
	for i := range n {
		e.publish(0, removed(uint64(i)))
	}
	e.dropLive = false
	e.mu.Lock()
	e.replayGap, e.replaying = gap, count
	e.mu.Unlock()
}

// concurrency counts what runs at once, and the most that did.
type concurrency struct {
	mu        sync.Mutex
	now, most int
}

func (c *concurrency) add(d int) {
	c.mu.Lock()
	c.now += d
	c.most = max(c.most, c.now)
	c.mu.Unlock()
}

func newTestEngine(t testing.TB, bufMax int) *testEngine {
	return newTestEngineAt(t, bufMax, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
}

func newTestEngineAt(t testing.TB, bufMax int, pubEP, replayEP string) *testEngine {
	ctx, cancel := context.WithCancel(context.Background())
	e := &testEngine{t: t, ctx: ctx, bufMax: bufMax, topic: "kv@test"}
	e.listenPub(pubEP)
	e.router = zmq4.NewRouter(ctx)
	if err := e.router.Listen(replayEP); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go e.serveReplay(done)
	var once sync.Once
	e.stop = func() {
		once.Do(func() {
			cancel()
			e.pub.Close()
			e.router.Close()
			<-done
		})
	}
	t.Cleanup(e.stop)
	return e
}

func (e *testEngine) listenPub(ep string) {
	e.pub = zmq4.NewPub(e.ctx)
	if err := e.pub.Listen(ep); err != nil {
		e.t.Fatal(err)
	}
	e.pubAddr = "tcp://" + e.pub.Addr().String()
}

func (e *testEngine) replayAddr() string { return "tcp://" + e.router.Addr().String() }

func (e *testEngine) serveReplay(done chan struct{}) {
	defer close(done)
	for {
		msg, err := e.router.Recv()
		if err != nil {
			return
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue
		}
		id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		e.mu.Lock()
		items := append([][2][]byte(nil), e.buf...)
		gap, count := e.replayGap, e.replaying
		e.mu.Unlock()
		if count != nil {
			count.add(1)
		}
		for _, it := range items {
			if binary.BigEndian.Uint64(it[0]) >= start {
				time.Sleep(gap)
				e.router.Send(zmq4.NewMsgFrom(id, []byte{}, it[0], it[1]))
			}
		}
		time.Sleep(gap)
		if count != nil {
			count.add(-1)
		}
		e.router.Send(zmq4.NewMsgFrom(id, []byte{}, binary.BigEndian.AppendUint64(nil, endSeq), []byte{}))
	}
}

// publish sends one batch and returns its seq.
func (e *testEngine) publish(rank int, events ...kv.Event) uint64 {
	return e.publishRaw(kv.AppendVLLMBatch(nil, float64(time.Now().Unix()), events, rank, kv.VLLMArrays))
}

func (e *testEngine) publishRaw(payload []byte) uint64 {
	e.mu.Lock()
	seq := e.next
	e.next++
	sb := binary.BigEndian.AppendUint64(nil, seq)
	e.buf = append(e.buf, [2][]byte{sb, payload})
	if len(e.buf) > e.bufMax {
		e.buf = e.buf[1:]
	}
	drop := e.dropLive
	e.mu.Unlock()
	if !drop {
		if err := e.pub.Send(zmq4.NewMsgFrom([]byte(e.topic), sb, payload)); err != nil {
			e.t.Fatal(err)
		}
	}
	return seq
}

// restart forgets everything, like a restarted engine whose seq starts at 0.
func (e *testEngine) restart() {
	e.mu.Lock()
	e.next, e.buf = 0, nil
	e.mu.Unlock()
}

type sinkCall struct {
	rank   int
	hashes []uint64 // first engine hash of each event
	clear  bool
	ranks  []int // ranks cleared
}

type recordSink struct {
	mu    sync.Mutex
	calls []sinkCall
}

func (r *recordSink) ApplyEvents(rank int, evs []kv.Event) {
	c := sinkCall{rank: rank}
	for _, e := range evs {
		if len(e.EngineHashes) > 0 {
			c.hashes = append(c.hashes, e.EngineHashes[0])
		}
	}
	r.mu.Lock()
	r.calls = append(r.calls, c)
	r.mu.Unlock()
}

func (r *recordSink) ClearRanks(ranks []int) {
	r.mu.Lock()
	r.calls = append(r.calls, sinkCall{clear: true, ranks: append([]int(nil), ranks...)})
	r.mu.Unlock()
}

// applied lists the first hash of every event applied since the last clear.
func (r *recordSink) sinceClear() []uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []uint64
	for _, c := range r.calls {
		if c.clear {
			out = out[:0]
			continue
		}
		out = append(out, c.hashes...)
	}
	return out
}

func removed(h uint64) kv.Event {
	return kv.Event{Kind: kv.BlockRemoved, EngineHashes: []uint64{h}}
}

type subFixture struct {
	t    *testing.T
	eng  *testEngine
	sink *recordSink
	sub  *ZMQSubscriber
	rank int // data-parallel rank of the warm-up batches
}

func startSub(t *testing.T, eng *testEngine, cfg ZMQConfig) *subFixture {
	rs := &recordSink{}
	f := startSubSink(t, eng, cfg, rs)
	f.sink = rs
	return f
}

func startSubSink(t *testing.T, eng *testEngine, cfg ZMQConfig, sink EventSink) *subFixture {
	if cfg.Endpoint == "" {
		cfg.Endpoint = eng.pubAddr
	}
	cfg.BackoffMin, cfg.BackoffMax = 5*time.Millisecond, 50*time.Millisecond
	f := &subFixture{t: t, eng: eng}
	f.sub = NewZMQSubscriber(cfg, sink)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { f.sub.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return f
}

func (f *subFixture) wait(what string, cond func(ZMQStats) bool) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.sub.Wait(ctx, cond); err != nil {
		f.t.Fatalf("%s: %v", what, err)
	}
}

// warmUp publishes removal batches (hash 1000+i) until the subscriber has
// applied one: a SUB only receives once its subscription reached the PUB
// ("slow joiner"). The initial replay from seq 0 fills in the early ones.
func (f *subFixture) warmUp() {
	f.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for i := uint64(0); ; i++ {
		f.eng.publish(f.rank, removed(1000+i))
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		// Received live, not only replayed: the subscription is in place
		// (the subscriber replays the engine's buffer when it connects).
		err := f.sub.Wait(ctx, func(s ZMQStats) bool { return s.LastSeq >= int64(i) && s.Batches > s.Replayed })
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatal("subscriber never received a batch")
		}
	}
}

func seqs(from, to uint64) []uint64 {
	var out []uint64
	for i := from; i <= to; i++ {
		out = append(out, i)
	}
	return out
}

func equalU64(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// The warm-up batches arrive complete (the first-message replay fills the
// ones sent before the subscription took), then live batches in order, with
// their data-parallel rank.
func TestZMQSubscriberAppliesInOrder(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr(), Topic: "kv@"})
	f.warmUp()
	warm := eng.next
	for i := uint64(0); i < 20; i++ {
		eng.publish(int(i%2), removed(i))
	}
	last := int64(eng.next - 1)
	f.wait("live batches", func(s ZMQStats) bool { return s.LastSeq == last })
	got := f.sink.sinceClear()
	if uint64(len(got)) != warm+20 || !equalU64(got[warm:], seqs(0, 19)) {
		t.Fatalf("applied %v", got)
	}
	for i := uint64(0); i < warm; i++ {
		if got[i] != 1000+i {
			t.Fatalf("warm-up batch %d missing: %v", i, got[:warm])
		}
	}
	f.sink.mu.Lock()
	lastCall := f.sink.calls[len(f.sink.calls)-1]
	f.sink.mu.Unlock()
	if lastCall.rank != 1 {
		t.Fatalf("rank of batch 19: %d", lastCall.rank)
	}
	if st := f.sub.Stats(); st.Clears != 0 || !st.Connected || st.Batches != uint64(last+1) {
		t.Fatalf("stats %+v", st)
	}
}

// Batches lost on the live stream are fetched from the replay endpoint.
func TestZMQSubscriberGapIsReplayed(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()})
	f.warmUp()
	before := f.sub.Stats()
	eng.dropLive = true
	for i := uint64(0); i < 5; i++ {
		eng.publish(0, removed(i))
	}
	eng.dropLive = false
	eng.publish(0, removed(5))
	last := int64(eng.next - 1)
	f.wait("gap replay", func(s ZMQStats) bool { return s.LastSeq == last })
	got := f.sink.sinceClear()
	if !equalU64(got[len(got)-6:], seqs(0, 5)) {
		t.Fatalf("applied %v", got)
	}
	st := f.sub.Stats()
	// The 5 lost batches came from a replay (the sixth, live, may have come
	// either way under load).
	if st.Clears != 0 || st.Replays != before.Replays+1 || st.Replayed < before.Replayed+5 {
		t.Fatalf("stats %+v (before %+v)", st, before)
	}
}

// A gap the replay buffer no longer covers clears the backend.
func TestZMQSubscriberUncoverableGapClears(t *testing.T) {
	eng := newTestEngine(t, 3)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()})
	f.warmUp()
	eng.dropLive = true
	for i := uint64(0); i < 10; i++ {
		eng.publish(0, removed(i))
	}
	eng.dropLive = false
	eng.publish(0, removed(10))
	last := int64(eng.next - 1)
	f.wait("clear and resume", func(s ZMQStats) bool { return s.LastSeq == last && s.Clears == 1 })
	// After the clear, only what the buffer still held is applied.
	if got := f.sink.sinceClear(); !equalU64(got, seqs(8, 10)) {
		t.Fatalf("after clear: %v", got)
	}
}

// Without a replay endpoint any gap clears.
func TestZMQSubscriberGapWithoutReplayClears(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{})
	f.warmUp()
	eng.dropLive = true
	eng.publish(0, removed(1))
	eng.dropLive = false
	eng.publish(0, removed(2))
	last := int64(eng.next - 1)
	f.wait("clear", func(s ZMQStats) bool { return s.LastSeq == last && s.Clears == 1 })
	if got := f.sink.sinceClear(); !equalU64(got, []uint64{2}) {
		t.Fatalf("after clear: %v", got)
	}
}

// seq going backwards is an engine restart: clear, then follow the new run
// from its seq 0 (replayed).
func TestZMQSubscriberRestartClears(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()})
	f.warmUp()
	for i := uint64(0); i < 3; i++ {
		eng.publish(0, removed(i))
	}
	last := int64(eng.next - 1)
	f.wait("first run", func(s ZMQStats) bool { return s.LastSeq == last })
	eng.restart()
	eng.dropLive = true
	eng.publish(0, removed(100)) // seq 0 of the new run, lost live
	eng.dropLive = false
	eng.publish(0, removed(101)) // seq 1
	f.wait("restart", func(s ZMQStats) bool { return s.Clears == 1 && s.LastSeq == 1 })
	if got := f.sink.sinceClear(); !equalU64(got, []uint64{100, 101}) {
		t.Fatalf("after restart: %v", got)
	}
	// Only the ranks this feed carried (rank 0 here) are cleared.
	f.sink.mu.Lock()
	defer f.sink.mu.Unlock()
	for _, c := range f.sink.calls {
		if c.clear && (len(c.ranks) != 1 || c.ranks[0] != 0) {
			t.Fatalf("cleared ranks %v", c.ranks)
		}
	}
}

// A lost connection is re-established with backoff, and what was published
// meanwhile is replayed at once, without clearing.
func TestZMQSubscriberReconnectReplays(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()})
	f.warmUp()
	addr := eng.pubAddr
	eng.pub.Close()
	f.wait("disconnect", func(s ZMQStats) bool { return !s.Connected })
	eng.dropLive = true
	for i := uint64(0); i < 4; i++ {
		eng.publish(0, removed(i))
	}
	eng.dropLive = false
	last := int64(eng.next - 1)
	eng.listenPub(addr)
	f.wait("reconnect and replay", func(s ZMQStats) bool { return s.Reconnects == 1 && s.LastSeq == last })
	got := f.sink.sinceClear()
	if !equalU64(got[len(got)-4:], seqs(0, 3)) {
		t.Fatalf("applied %v", got)
	}
	if st := f.sub.Stats(); st.Clears != 0 || !st.Connected {
		t.Fatalf("stats %+v", st)
	}
}

// A payload that does not decode clears (its effect is unknown) and the feed
// goes on.
func TestZMQSubscriberBadPayloadClears(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()})
	f.warmUp()
	eng.publishRaw([]byte{0xc1})
	eng.publish(0, removed(7))
	last := int64(eng.next - 1)
	f.wait("resume", func(s ZMQStats) bool { return s.LastSeq == last })
	st := f.sub.Stats()
	if st.DecodeErrors != 1 || st.Clears != 1 || st.LastError == "" {
		t.Fatalf("stats %+v", st)
	}
	if got := f.sink.sinceClear(); !equalU64(got, []uint64{7}) {
		t.Fatalf("after clear: %v", got)
	}
}

// Messages on other topics are not ours.
func TestZMQSubscriberTopicFilter(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr(), Topic: "kv@test"})
	f.warmUp()
	payload := kv.AppendVLLMBatch(nil, 0, []kv.Event{removed(99)}, 0, kv.VLLMArrays)
	if err := eng.pub.Send(zmq4.NewMsgFrom([]byte("other"), binary.BigEndian.AppendUint64(nil, 1<<40), payload)); err != nil {
		t.Fatal(err)
	}
	eng.publish(0, removed(5))
	last := int64(eng.next - 1)
	f.wait("next batch", func(s ZMQStats) bool { return s.LastSeq == last })
	got := f.sink.sinceClear()
	if got[len(got)-1] != 5 || f.sub.Stats().Clears != 0 {
		t.Fatalf("applied %v stats %+v", got, f.sub.Stats())
	}
}

// An engine that restarts while we are disconnected, and publishes more
// batches than we had seen before we reconnect, is caught by the replay of
// the last applied batch (gone or different): clear, then follow the new run
// from its seq 0.
func TestZMQSubscriberRestartWhileDisconnectedClears(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()})
	f.warmUp()
	eng.publish(0, removed(1))
	seen := int64(eng.next - 1)
	f.wait("first run", func(s ZMQStats) bool { return s.LastSeq == seen })
	addr := eng.pubAddr
	eng.pub.Close()
	f.wait("disconnect", func(s ZMQStats) bool { return !s.Connected })
	eng.restart()
	eng.dropLive = true
	for i := uint64(0); i < uint64(seen)+5; i++ {
		eng.publish(0, removed(500+i))
	}
	eng.dropLive = false
	last := int64(eng.next - 1)
	eng.listenPub(addr)
	f.wait("reconnect", func(s ZMQStats) bool { return s.Reconnects == 1 && s.Clears == 1 && s.LastSeq == last })
	got := f.sink.sinceClear()
	if len(got) != int(last+1) || got[0] != 500 || got[last] != 500+uint64(last) {
		t.Fatalf("after restart: %v", got)
	}
}

// Without a replay endpoint a reconnection cannot prove nothing was missed.
func TestZMQSubscriberReconnectWithoutReplayClears(t *testing.T) {
	eng := newTestEngine(t, 100)
	f := startSub(t, eng, ZMQConfig{})
	f.warmUp()
	addr := eng.pubAddr
	eng.pub.Close()
	f.wait("disconnect", func(s ZMQStats) bool { return !s.Connected })
	eng.listenPub(addr)
	f.wait("reconnect", func(s ZMQStats) bool { return s.Reconnects == 1 && s.Clears == 1 })
	// The feed goes on from the next batch.
	for i := 0; ; i++ {
		seq := eng.publish(0, removed(77))
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		err := f.sub.Wait(ctx, func(s ZMQStats) bool { return s.LastSeq == int64(seq) })
		cancel()
		if err == nil {
			break
		}
		if i == 500 {
			t.Fatal("feed did not resume")
		}
	}
	if st := f.sub.Stats(); st.Clears != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// vLLM reports a request's cache_salt in extra_keys of its first block; the
// subscriber hands it to a SaltedSink, so the blocks land in the tenant's
// namespace.
func TestZMQSubscriberCacheSalt(t *testing.T) {
	eng := newTestEngine(t, 100)
	r := newRouter(t)
	a := NewKVApplier(KVApplierConfig{Backend: "s"}, r)
	f := startSubSink(t, eng, ZMQConfig{ReplayEndpoint: eng.replayAddr()}, a)
	f.warmUp()
	toks := tokens(16, 40)
	eng.publishRaw(encodeBatch(t, 0, encodeValues("BlockStored", []uint64{77}, nil, toks, 16, nil, "GPU", nil, [][]string{{"salt-of-acme"}})))
	last := int64(eng.next - 1)
	f.wait("salted batch", func(s ZMQStats) bool { return s.LastSeq == last })
	if d, _ := depth(t, r, "s", toks, kv.NewNamespace("salt-of-acme")); d != 1 {
		t.Fatalf("salted depth %d (stats %+v)", d, f.sub.Stats())
	}
}

// BenchmarkZMQFeed is the whole path over a real loopback socket: publish
// vLLM batches (4 removals + 4 stores of 4 blocks: 32 block events each),
// subscribe, decode, re-hash and index. It reports block events applied per
// second.
func BenchmarkZMQFeed(b *testing.B) {
	eng := newTestEngine(b, 1<<20)
	r := newRouter(b)
	a := NewKVApplier(KVApplierConfig{Backend: "bench"}, r)
	sub := NewZMQSubscriber(ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: eng.replayAddr(), BackoffMin: time.Millisecond}, a)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	const ring = 64
	payloads := make([][]byte, ring)
	var first []kv.Event
	for i := range payloads {
		var evs []kv.Event
		for e := 0; e < 4; e++ {
			base := uint64(i*1000 + e*10)
			hs := []uint64{base, base + 1, base + 2, base + 3}
			evs = append(evs, kv.Event{Kind: kv.BlockRemoved, EngineHashes: hs})
			first = append(first, kv.Event{Kind: kv.BlockStored, EngineHashes: hs, Tokens: tokens(64, uint32(base)), BlockSize: 16})
		}
		evs = append(evs, first[len(first)-4:]...)
		payloads[i] = kv.AppendVLLMBatch(nil, 1, evs, 0, kv.VLLMArrays)
	}
	// Warm up until subscribed.
	for {
		seq := eng.publishRaw(kv.AppendVLLMBatch(nil, 1, first, 0, kv.VLLMArrays))
		wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		err := sub.Wait(wctx, func(s ZMQStats) bool { return s.LastSeq >= int64(seq) })
		wcancel()
		if err == nil {
			break
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	var last uint64
	for i := 0; i < b.N; i++ {
		last = eng.publishRaw(payloads[i%ring])
	}
	wctx, wcancel := context.WithTimeout(context.Background(), time.Minute)
	defer wcancel()
	if err := sub.Wait(wctx, func(s ZMQStats) bool { return s.LastSeq >= int64(last) }); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	if st := sub.Stats(); st.Clears != 0 {
		b.Fatalf("feed lost batches it could not replay: %+v", st)
	}
	b.ReportMetric(float64(b.N)*32/b.Elapsed().Seconds(), "blockevents/s")
	// CPU of publisher and subscriber together, both in this process.
	b.ReportMetric(float64(b.N)*32/(cpuTime()-cpu0).Seconds(), "blockevents/cpu-s")
}

// A feed stopped while it replays (a reload replacing its backend) reports
// no problem: the replay ended because it was asked to (the reload chaos
// trial's "replay from 0: context canceled" warning).
func TestZMQSubscriberStoppedDuringReplayReportsNothing(t *testing.T) {
	eng := newTestEngine(t, 100)
	silent, err := net.Listen("tcp", "127.0.0.1:0") // accepts, never greets
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	go func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	var mu sync.Mutex
	var reports []string
	cfg := ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: "tcp://" + silent.Addr().String(), ReplayTimeout: time.Minute,
		BackoffMin: 5 * time.Millisecond, BackoffMax: 50 * time.Millisecond,
		OnChange: func(p string) { mu.Lock(); reports = append(reports, p); mu.Unlock() }}
	sub := NewZMQSubscriber(cfg, &recordSink{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	deadline := time.Now().Add(10 * time.Second)
	for sub.Stats().Replays == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no replay began")
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // in the replay's exchange
	cancel()
	<-done
	mu.Lock()
	defer mu.Unlock()
	for _, r := range reports {
		if strings.Contains(r, "replay") {
			t.Fatalf("reported %q", reports)
		}
	}
}

// The same for the replay after a reconnection: a feed stopped in it
// reports nothing and clears nothing, nor says it is connected (the last
// review).
func TestZMQSubscriberStoppedDuringResumeReportsNothing(t *testing.T) {
	eng := newTestEngine(t, 100)
	relay := testutil.NewRelay(t, eng.router.Addr().String())
	var mu sync.Mutex
	var reports []string
	rs := &recordSink{}
	cfg := ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: "tcp://" + relay.Addr(), ReplayTimeout: time.Minute,
		BackoffMin: 5 * time.Millisecond, BackoffMax: 50 * time.Millisecond,
		OnChange: func(p string) { mu.Lock(); reports = append(reports, p); mu.Unlock() }}
	sub := NewZMQSubscriber(cfg, rs)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	f := &subFixture{t: t, eng: eng, sink: rs, sub: sub}
	f.warmUp()
	addr := eng.pubAddr
	eng.pub.Close()
	f.wait("disconnect", func(s ZMQStats) bool { return !s.Connected })
	relay.Freeze()
	replays := sub.Stats().Replays
	eng.listenPub(addr)
	deadline := time.Now().Add(10 * time.Second)
	for sub.Stats().Reconnects == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no reconnection")
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // in the resume's replay, which the relay holds
	mu.Lock()
	seen := len(reports)
	mu.Unlock()
	cancel()
	<-done
	mu.Lock()
	defer mu.Unlock()
	for _, r := range reports[seen:] {
		if r != "" {
			t.Fatalf("reported %q after the stop (all: %q)", r, reports)
		}
	}
	if st := sub.Stats(); st.Clears != 0 || st.Replays != replays+1 { // the resume's replay began, and was stopped
		t.Fatalf("stats %+v (replays before %d)", st, replays)
	}
}

// ReplayTimeout bounds the wait for each reply, not the whole replay: an
// engine whose buffer takes longer than that to send, a reply at a time,
// is replayed whole (the scale trial: every replay of a busy fleet ran out
// of a fixed 3 s and cleared its index).
func TestZMQReplayTimeoutIsPerReply(t *testing.T) {
	eng := newTestEngine(t, 100)
	eng.slowReplay(12, 50*time.Millisecond, nil) // 13 replies: 650 ms in all
	rs := &recordSink{}
	sub := NewZMQSubscriber(ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: eng.replayAddr(), ReplayTimeout: 300 * time.Millisecond}, rs)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sub.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	f := &subFixture{t: t, eng: eng, sink: rs, sub: sub}
	f.wait("the replay", func(s ZMQStats) bool { return s.Replayed >= 12 })
	if st := sub.Stats(); st.Clears != 0 || st.LastError != "" {
		t.Fatalf("stats %+v", st)
	}
}

// At most 8 feeds replay at once, whatever the fleet: each still replays
// whole.
func TestZMQReplaysTakeTurns(t *testing.T) {
	count := &concurrency{}
	var subs []*ZMQSubscriber
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for range 12 {
		eng := newTestEngine(t, 100)
		eng.slowReplay(3, 40*time.Millisecond, count)
		sub := NewZMQSubscriber(ZMQConfig{Endpoint: eng.pubAddr, ReplayEndpoint: eng.replayAddr()}, &recordSink{})
		subs = append(subs, sub)
		wg.Add(1)
		go func() { defer wg.Done(); sub.Run(ctx) }()
	}
	for i, sub := range subs {
		wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := sub.Wait(wctx, func(s ZMQStats) bool { return s.Replayed >= 3 })
		wcancel()
		if err != nil {
			t.Fatalf("feed %d: %v (stats %+v)", i, err, sub.Stats())
		}
	}
	count.mu.Lock()
	defer count.mu.Unlock()
	if count.most > 8 || count.most < 2 {
		t.Fatalf("%d replays at once, want 2 to 8", count.most)
	}
}
