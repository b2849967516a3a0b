package kv

import (
	"bytes"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// fixture builds msgpack bytes field by field with the library's encoder, so
// the decoder is checked against an independent writer of vLLM's layout.
type fixture struct {
	t   testing.TB
	buf bytes.Buffer
	enc *msgpack.Encoder
}

func newFixture(t testing.TB) *fixture {
	f := &fixture{t: t}
	f.enc = msgpack.NewEncoder(&f.buf)
	return f
}

func (f *fixture) must(err error) {
	if err != nil {
		f.t.Fatal(err)
	}
}
func (f *fixture) arr(n int) *fixture    { f.must(f.enc.EncodeArrayLen(n)); return f }
func (f *fixture) mp(n int) *fixture     { f.must(f.enc.EncodeMapLen(n)); return f }
func (f *fixture) str(s string) *fixture { f.must(f.enc.EncodeString(s)); return f }
func (f *fixture) bin(b []byte) *fixture { f.must(f.enc.EncodeBytes(b)); return f }
func (f *fixture) nil_() *fixture        { f.must(f.enc.EncodeNil()); return f }
func (f *fixture) i(v int64) *fixture    { f.must(f.enc.EncodeInt(v)); return f }
func (f *fixture) u(v uint64) *fixture   { f.must(f.enc.EncodeUint(v)); return f }
func (f *fixture) fl(v float64) *fixture { f.must(f.enc.EncodeFloat64(v)); return f }
func (f *fixture) ints(vs ...int64) *fixture {
	f.arr(len(vs))
	for _, v := range vs {
		f.i(v)
	}
	return f
}
func (f *fixture) bytes() []byte { return append([]byte(nil), f.buf.Bytes()...) }

func toks(n int, base int64) []int64 {
	t := make([]int64, n)
	for i := range t {
		t[i] = base + int64(i)
	}
	return t
}

func toks32(n int, base uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = base + uint32(i)
	}
	return t
}

// Array encoding as in vLLM with array_like=True: every BlockStored field,
// int hashes (one above int64 range), a nil parent, then a removal and a clear.
func TestDecodeVLLMArrayEncoding(t *testing.T) {
	f := newFixture(t)
	f.arr(3).fl(1700000000.5).arr(4)
	// BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
	f.arr(8).str("BlockStored").arr(2).u(1 << 63).i(-5).nil_().ints(toks(8, 100)...).i(4).nil_().str("GPU").nil_()
	// the same with a parent and the deprecated lora_id only
	f.arr(8).str("BlockStored").arr(1).i(7).u(1 << 63).ints(toks(4, 200)...).i(4).i(3).str("CPU").nil_()
	f.arr(3).str("BlockRemoved").arr(2).u(1 << 63).i(-5).str("GPU")
	f.arr(1).str("AllBlocksCleared")
	f.i(2)

	ts, evs, rank, err := DecodeVLLM(f.bytes())
	if err != nil {
		t.Fatal(err)
	}
	if ts != 1700000000.5 || rank != 2 || len(evs) != 4 {
		t.Fatalf("ts %v rank %d events %d", ts, rank, len(evs))
	}
	want := []Event{
		{Kind: BlockStored, EngineHashes: []uint64{1 << 63, 1<<64 - 5}, Tokens: toks32(8, 100), BlockSize: 4, Tier: TierDevice},
		{Kind: BlockStored, EngineHashes: []uint64{7}, HasParent: true, EngineParent: 1 << 63, Tokens: toks32(4, 200), BlockSize: 4, Tier: TierHost, LoRAName: "lora_id:3"},
		{Kind: BlockRemoved, EngineHashes: []uint64{1 << 63, 1<<64 - 5}, Tier: TierDevice},
		{Kind: AllBlocksCleared},
	}
	if !reflect.DeepEqual(evs, want) {
		t.Fatalf("got  %+v\nwant %+v", evs, want)
	}
}

// Map encoding (newer vLLM): batch and events are maps, keys in any order,
// bytes hashes, unknown keys (extra_keys, group_idx, kv_cache_spec_kind).
func TestDecodeVLLMMapEncoding(t *testing.T) {
	h1, h2, parent := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32), bytes.Repeat([]byte{3}, 32)
	f := newFixture(t)
	f.mp(3).str("events").arr(4)
	f.mp(11).str("type").str("BlockStored").
		str("block_hashes").arr(2).bin(h1).bin(h2).
		str("parent_block_hash").bin(parent).
		str("token_ids").ints(toks(32, 0)...).
		str("block_size").i(16).
		str("lora_id").nil_().
		str("medium").str("GPU").
		str("lora_name").str("sql-adapter").
		str("extra_keys").arr(2).nil_().arr(1).str("salt").
		str("group_idx").i(0).
		str("kv_cache_spec_kind").str("full_attention")
	// type named last
	f.mp(4).str("block_hashes").arr(1).bin(h2).str("medium").str("DISK").str("group_idx").i(0).str("type").str("BlockRemoved")
	// another KV cache group of a hybrid model: skipped
	f.mp(3).str("type").str("BlockRemoved").str("block_hashes").arr(1).bin(h1).str("group_idx").i(1)
	f.mp(1).str("type").str("AllBlocksCleared")
	f.str("data_parallel_rank").i(1).str("ts").fl(12.25)

	ts, evs, rank, err := DecodeVLLM(f.bytes())
	if err != nil {
		t.Fatal(err)
	}
	if ts != 12.25 || rank != 1 || len(evs) != 3 {
		t.Fatalf("ts %v rank %d events %d", ts, rank, len(evs))
	}
	e := evs[0]
	if e.Kind != BlockStored || !reflect.DeepEqual(e.EngineHashes, []uint64{EngineHashFromBytes(h1), EngineHashFromBytes(h2)}) ||
		!e.HasParent || e.EngineParent != EngineHashFromBytes(parent) || e.BlockSize != 16 ||
		!reflect.DeepEqual(e.Tokens, toks32(32, 0)) || e.LoRAName != "sql-adapter" || e.Tier != TierDevice {
		t.Fatalf("stored: %+v", e)
	}
	if EngineHashFromBytes(h1) == EngineHashFromBytes(h2) {
		t.Fatal("distinct byte hashes must fold to distinct values")
	}
	if e := evs[1]; e.Kind != BlockRemoved || e.Tier != TierDisk || !reflect.DeepEqual(e.EngineHashes, []uint64{EngineHashFromBytes(h2)}) || e.Tokens != nil {
		t.Fatalf("removed: %+v", e)
	}
	if evs[2].Kind != AllBlocksCleared {
		t.Fatalf("cleared: %+v", evs[2])
	}
}

// Oldest layout: [ts, events] without a rank, BlockStored with five fields
// and BlockRemoved with only block_hashes (no medium).
func TestDecodeVLLMOldestLayout(t *testing.T) {
	f := newFixture(t)
	f.arr(2).fl(1).arr(2)
	f.arr(6).str("BlockStored").ints(11, 12).nil_().ints(toks(4, 0)...).i(2).nil_()
	f.arr(2).str("BlockRemoved").ints(11)
	_, evs, rank, err := DecodeVLLM(f.bytes())
	if err != nil {
		t.Fatal(err)
	}
	if rank != 0 || len(evs) != 2 || evs[0].Tier != TierDevice || evs[1].Tier != TierDevice || len(evs[0].Tokens) != 4 {
		t.Fatalf("%+v", evs)
	}
}

// Fields after the ones we know (a future vLLM), nil dp rank, unknown event
// types, and trailing batch elements are skipped.
func TestDecodeVLLMIgnoresUnknown(t *testing.T) {
	f := newFixture(t)
	f.arr(4).fl(1).arr(4)
	f.arr(10).str("BlockStored").ints(5).nil_().ints(toks(2, 0)...).i(2).nil_().str("GPU").nil_().nil_().i(2) // group 2: skipped
	f.arr(13).str("BlockStored").ints(1).nil_().ints(toks(2, 0)...).i(2).nil_().str("GPU").nil_().
		arr(1).nil_().i(0).str("full_attention").nil_().mp(1).str("future").ints(1, 2, 3)
	f.arr(3).str("BlockPromoted").ints(1).str("GPU")
	f.arr(5).str("BlockRemoved").ints(1).str("CPU").i(0).str("future")
	f.nil_().str("trailing")
	_, evs, rank, err := DecodeVLLM(f.bytes())
	if err != nil {
		t.Fatal(err)
	}
	if rank != 0 || len(evs) != 2 || evs[0].Kind != BlockStored || evs[1].Kind != BlockRemoved || evs[1].Tier != TierHost {
		t.Fatalf("rank %d %+v", rank, evs)
	}
}

func TestDecodeVLLMRejectsGarbage(t *testing.T) {
	bad := map[string][]byte{
		"empty":          nil,
		"not an array":   newFixture(t).i(5).bytes(),
		"short batch":    newFixture(t).arr(1).fl(1).bytes(),
		"truncated":      newFixture(t).arr(3).fl(1).arr(2).arr(1).str("AllBlocksCleared").bytes(),
		"forged length":  {0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff},
		"event cut":      newFixture(t).arr(2).fl(1).arr(1).arr(5).str("BlockStored").ints(1).nil_().arr(3).i(1).bytes(),
		"invalid code":   append(newFixture(t).arr(2).fl(1).arr(1).arr(2).str("BlockRemoved").bytes(), 0xc1),
		"neg rank":       newFixture(t).arr(3).fl(1).arr(0).i(-1).bytes(),
		"trailing bytes": append(newFixture(t).arr(2).fl(1).arr(0).bytes(), 0),
		"string ts":      newFixture(t).arr(2).str("x").arr(0).bytes(),
	}
	for name, b := range bad {
		if _, _, _, err := DecodeVLLM(b); err == nil {
			t.Errorf("%s: decoded without error", name)
		} else if !strings.HasPrefix(err.Error(), "vllm kv events: ") {
			t.Errorf("%s: error %q lacks context", name, err)
		}
	}
}

// One event that cannot be read in a sound payload does not fail its batch:
// a BlockStored is left out, anything that may have removed blocks becomes
// AllBlocksCleared (and the events before it go), an unknown type is
// skipped; the others are decoded.
func TestDecodeVLLMSkipsMalformedEvents(t *testing.T) {
	good := func(f *fixture) *fixture { // a BlockStored of hash 7
		return f.arr(8).str("BlockStored").ints(7).nil_().ints(toks(2, 0)...).i(2).nil_().str("GPU").nil_()
	}
	cases := []struct {
		name    string
		bad     func(f *fixture) *fixture
		kind    EventKind // what stands in its place (0: nothing)
		errKind EventKind
	}{
		{"tokens/blocks", func(f *fixture) *fixture {
			return f.arr(8).str("BlockStored").ints(1, 2).nil_().ints(toks(3, 0)...).i(2).nil_().str("GPU").nil_()
		}, 0, BlockStored},
		{"neg token", func(f *fixture) *fixture { return f.arr(5).str("BlockStored").ints(1).nil_().ints(-1).i(1) }, 0, BlockStored},
		{"big token", func(f *fixture) *fixture { return f.arr(5).str("BlockStored").ints(1).nil_().ints(1 << 32).i(1) }, 0, BlockStored},
		{"big blocksize", func(f *fixture) *fixture { return f.arr(5).str("BlockStored").ints(1).nil_().ints(1).i(1 << 30) }, 0, BlockStored},
		{"stored map, type last", func(f *fixture) *fixture {
			return f.mp(2).str("block_hashes").str("not a list").str("type").str("BlockStored")
		}, 0, BlockStored},
		{"nil hash", func(f *fixture) *fixture { return f.arr(3).str("BlockRemoved").arr(1).nil_().str("GPU") }, AllBlocksCleared, BlockRemoved},
		{"no hashes", func(f *fixture) *fixture { return f.arr(1).str("BlockRemoved") }, AllBlocksCleared, BlockRemoved},
		{"map no type", func(f *fixture) *fixture { return f.mp(1).str("block_hashes").ints(1) }, AllBlocksCleared, 0},
		{"tag not a string", func(f *fixture) *fixture { return f.arr(2).i(3).ints(1) }, AllBlocksCleared, 0},
		{"cleared map, bad field", func(f *fixture) *fixture {
			return f.mp(2).str("type").str("AllBlocksCleared").str("medium").i(3)
		}, AllBlocksCleared, AllBlocksCleared},
	}
	var d VLLMDecoder
	for i, c := range cases {
		f := newFixture(t)
		f.arr(3).fl(1).arr(3)
		good(f)
		c.bad(f)
		f.arr(3).str("BlockRemoved").ints(7).str("GPU")
		f.i(2)
		_, evs, rank, err := d.Decode(f.bytes())
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		// An AllBlocksCleared standing in drops the events before it.
		want := []EventKind{BlockStored, BlockRemoved}
		if c.kind != 0 {
			want = []EventKind{c.kind, BlockRemoved}
		}
		var got []EventKind
		for _, ev := range evs {
			got = append(got, ev.Kind)
		}
		if rank != 2 || !reflect.DeepEqual(got, want) || !reflect.DeepEqual(evs[len(evs)-1].EngineHashes, []uint64{7}) ||
			c.kind == 0 && (!reflect.DeepEqual(evs[0].EngineHashes, []uint64{7}) || !reflect.DeepEqual(evs[0].Tokens, []uint32{0, 1})) {
			t.Errorf("%s: rank %d events %+v, want kinds %v", c.name, rank, evs, want)
		}
		sk := d.Skipped()
		if sk == nil || sk.Index != 1 || sk.Kind != c.errKind || sk.Cleared != (c.kind != 0) || d.Malformed != uint64(i+1) {
			t.Errorf("%s: skipped %+v, malformed %d", c.name, sk, d.Malformed)
		}
	}
	if _, _, _, err := d.Decode(newFixture(t).arr(2).fl(1).arr(0).bytes()); err != nil || d.Skipped() != nil {
		t.Fatalf("a clean batch after a skip: %v, skipped %v", err, d.Skipped())
	}
}

// vLLM's OffloadingConnector reports each block it copies to CPU memory as
// a BlockStored with no token ids and block_size 0 (the self-describing
// tracker's placeholder) or the block size (older versions): a copy.
func TestDecodeVLLMOffloadCopy(t *testing.T) {
	for _, bs := range []int64{0, 16} {
		f := newFixture(t)
		f.arr(3).fl(1).arr(2)
		f.arr(8).str("BlockStored").ints(11).nil_().ints().i(bs).nil_().str("CPU").nil_()
		f.mp(8).str("type").str("BlockStored").str("block_hashes").ints(12, 13).str("parent_block_hash").nil_().
			str("token_ids").ints().str("block_size").i(bs).str("lora_id").nil_().str("medium").str("CPU").str("lora_name").nil_()
		f.i(0)
		var d VLLMDecoder
		_, evs, _, err := d.Decode(f.bytes())
		if err != nil || d.Skipped() != nil {
			t.Fatalf("block_size %d: %v (skipped %v)", bs, err, d.Skipped())
		}
		want := []Event{
			{Kind: BlockStored, EngineHashes: []uint64{11}, Tier: TierHost},
			{Kind: BlockStored, EngineHashes: []uint64{12, 13}, Tier: TierHost},
		}
		if !reflect.DeepEqual(evs, want) {
			t.Fatalf("block_size %d: %+v, want %+v", bs, evs, want)
		}
	}
}

// The encoder used by the simulated engine must produce what the decoder
// (and vLLM's layout) expects, in both encodings.
func TestAppendVLLMBatchRoundTrip(t *testing.T) {
	in := []Event{
		{Kind: BlockStored, EngineHashes: []uint64{1, 1 << 40, 1<<64 - 1}, Tokens: toks32(48, 7), BlockSize: 16, Tier: TierDevice},
		{Kind: BlockStored, EngineHashes: []uint64{9}, HasParent: true, EngineParent: 1<<64 - 1, Tokens: toks32(16, 70000), BlockSize: 16, Tier: TierHost, LoRAName: strings.Repeat("a", 40)},
		{Kind: BlockRemoved, EngineHashes: []uint64{1, 9}, Tier: TierHost},
		{Kind: AllBlocksCleared},
	}
	for _, enc := range []VLLMEncoding{VLLMArrays, VLLMMaps} {
		b := AppendVLLMBatch(nil, 3.5, in, 3, enc)
		// The library's generic decoder must read it too.
		var generic any
		if err := msgpack.Unmarshal(b, &generic); err != nil {
			t.Fatalf("enc %d: not valid msgpack: %v", enc, err)
		}
		ts, out, rank, err := DecodeVLLM(b)
		if err != nil {
			t.Fatalf("enc %d: %v", enc, err)
		}
		if ts != 3.5 || rank != 3 || !reflect.DeepEqual(out, in) {
			t.Fatalf("enc %d: got %+v", enc, out)
		}
	}
}

// A reused decoder returns correct slices even when its arenas grow.
func TestVLLMDecoderReuse(t *testing.T) {
	var d VLLMDecoder
	for n := 1; n < 200; n += 37 {
		var in []Event
		for i := 0; i < n; i++ {
			in = append(in, Event{Kind: BlockStored, EngineHashes: []uint64{uint64(i), uint64(i + 1)}, Tokens: toks32(8, uint32(i)), BlockSize: 4})
		}
		_, out, _, err := d.Decode(AppendVLLMBatch(nil, 0, in, 0, VLLMArrays))
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(out, in) {
			t.Fatalf("n=%d: mismatch", n)
		}
	}
}

func vllmBenchBatch(events, blocksPer int) []byte {
	in := make([]Event, events)
	for i := range in {
		hs := make([]uint64, blocksPer)
		for j := range hs {
			hs[j] = uint64(i*blocksPer+j) * 0x9e3779b97f4a7c15
		}
		in[i] = Event{Kind: BlockStored, EngineHashes: hs, HasParent: i > 0, EngineParent: uint64(i), Tokens: toks32(blocksPer*16, uint32(i*1000)), BlockSize: 16}
	}
	return AppendVLLMBatch(nil, 1, in, 0, VLLMArrays)
}

// BenchmarkDecodeVLLM: 8 BlockStored events of 4 blocks (16 tokens each).
func BenchmarkDecodeVLLM(b *testing.B) {
	payload := vllmBenchBatch(8, 4)
	var d VLLMDecoder
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	cpu0 := cpuTime()
	for b.Loop() {
		if _, _, _, err := d.Decode(payload); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*32), "ns/block")
	b.ReportMetric(float64((cpuTime()-cpu0).Nanoseconds())/float64(b.N*32), "cpu-ns/block")
}

func FuzzDecodeVLLM(f *testing.F) {
	// Seed corpus: testdata/fuzz/FuzzDecodeVLLM (both encodings, bytes
	// hashes, the oldest layout, a forged length).
	f.Add(vllmBenchBatch(2, 2))
	var d VLLMDecoder
	f.Fuzz(func(t *testing.T, b []byte) {
		_, evs, rank, err := d.Decode(b)
		if err != nil {
			return
		}
		if rank < 0 {
			t.Fatal("negative rank accepted")
		}
		for _, e := range evs {
			switch e.Kind {
			case BlockStored:
				copied := len(e.Tokens) == 0 && !e.HasParent && e.BlockSize == 0 // an offloaded copy (Event)
				if !copied && (e.BlockSize <= 0 || len(e.Tokens) != len(e.EngineHashes)*e.BlockSize) {
					t.Fatalf("inconsistent stored event %+v", e)
				}
			case BlockRemoved, AllBlocksCleared:
			default:
				t.Fatalf("kind %d", e.Kind)
			}
			if e.Tier >= NumTiers {
				t.Fatal("bad tier")
			}
		}
		// Whatever decodes must survive a round trip through the encoder.
		again := AppendVLLMBatch(nil, 0, evs, rank, VLLMMaps)
		var d2 VLLMDecoder
		_, evs2, rank2, err := d2.Decode(again)
		if err != nil || rank2 != rank || len(evs2) != len(evs) {
			t.Fatalf("round trip: %v", err)
		}
	})
}

// The integer fast paths agree with the library on every width and sign.
func TestMsgpackIntFastPaths(t *testing.T) {
	vals := []int64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1<<63 - 1, -1, -32, -33, -128, -129, -32768, -32769, -1 << 31, -1<<31 - 1, -1 << 63}
	for _, v := range vals {
		for _, signed := range []bool{false, true} {
			f := newFixture(t)
			if signed || v < 0 {
				f.i(v)
			} else {
				f.u(uint64(v))
			}
			b := f.bytes()
			got, w := mpIntBitsAt(b)
			if w != len(b) || got != uint64(v) {
				t.Fatalf("mpIntBitsAt(%d) = %d width %d, encoded %x", v, got, w, b)
			}
			u, uw := mpUintAt(b)
			if v < 0 && uw != 0 {
				t.Fatalf("mpUintAt accepted negative %d", v)
			}
			if v >= 0 && (uw != len(b) || u != uint64(v)) {
				t.Fatalf("mpUintAt(%d) = %d width %d", v, u, uw)
			}
			if _, w := mpIntBitsAt(b[:len(b)-1]); w != 0 && len(b) > 1 {
				t.Fatalf("truncated %x accepted", b)
			}
		}
	}
}

// SGLang with bigram keys (EAGLE) sends each position as a pair
// (token[j], token[j+1]); the position's token is the first of the pair.
func TestDecodeVLLMBigramTokens(t *testing.T) {
	f := newFixture(t)
	f.arr(3).fl(1).arr(1)
	f.arr(7).str("BlockStored").ints(9).nil_().arr(4).ints(10, 11).ints(11, 12).i(12).ints(13, 14).i(4).nil_().str("GPU")
	f.i(0)
	_, evs, _, err := DecodeVLLM(f.bytes())
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 1 || !reflect.DeepEqual(evs[0].Tokens, []uint32{10, 11, 12, 13}) {
		t.Fatalf("%+v", evs)
	}
	for name, b := range map[string][]byte{
		"empty pair":  newFixture(t).arr(2).fl(1).arr(1).arr(5).str("BlockStored").ints(9).nil_().arr(1).arr(0).i(1).bytes(),
		"neg in pair": newFixture(t).arr(2).fl(1).arr(1).arr(5).str("BlockStored").ints(9).nil_().arr(1).ints(-1, 2).i(1).bytes(),
	} {
		var d VLLMDecoder
		if _, evs, _, err := d.Decode(b); err != nil || len(evs) != 0 || d.Skipped() == nil {
			t.Errorf("%s: %+v %v, want the event skipped", name, evs, err)
		}
	}
}

// An unknown medium does not fail the batch: the slowest local tier, counted.
func TestDecodeVLLMUnknownMedium(t *testing.T) {
	var d VLLMDecoder
	_, evs, _, err := d.Decode(newFixture(t).arr(2).fl(1).arr(1).arr(3).str("BlockRemoved").ints(1).str("TAPE").bytes())
	if err != nil || len(evs) != 1 || evs[0].Tier != TierDisk || d.UnknownMedia != 1 {
		t.Fatalf("%+v %v unknown=%d", evs, err, d.UnknownMedia)
	}
}

// vLLM hashes a request's cache_salt into the first block only, via
// extra_keys[0] = (lora_name?, multimodal keys..., cache_salt?, ...).
func TestDecodeVLLMCacheSalt(t *testing.T) {
	f := newFixture(t)
	f.arr(3).fl(1).arr(5)
	// salt only
	f.arr(9).str("BlockStored").ints(1, 2).nil_().ints(toks(4, 0)...).i(2).nil_().str("GPU").nil_().arr(2).arr(1).str("tenant-salt").nil_()
	// LoRA, an image (as older vLLM's tuple, and as current vLLM's plain
	// string, five of them), a salt: the salt comes last
	f.arr(9).str("BlockStored").ints(3).nil_().ints(toks(2, 0)...).i(2).nil_().str("GPU").str("ad").
		arr(1).arr(8).str("ad").arr(2).str("img-1").i(0).str("mm-1").str("mm-2").str("mm-3").str("mm-4").str("mm-5").str("salt-b")
	// LoRA only
	f.arr(9).str("BlockStored").ints(4).nil_().ints(toks(2, 0)...).i(2).nil_().str("GPU").str("ad").arr(1).arr(1).str("ad")
	// not the first block of a sequence: no salt
	f.arr(9).str("BlockStored").ints(5).i(4).ints(toks(2, 0)...).i(2).nil_().str("GPU").nil_().arr(1).arr(1).str("x")
	// map form, extra_keys before lora_name
	f.mp(7).str("type").str("BlockStored").str("block_hashes").ints(6).str("parent_block_hash").nil_().
		str("token_ids").ints(toks(2, 0)...).str("block_size").i(2).str("extra_keys").arr(1).arr(2).str("ad").str("salt-m").str("lora_name").str("ad")
	f.i(0)
	var d VLLMDecoder
	_, evs, _, err := d.Decode(f.bytes())
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"tenant-salt", "salt-b", "", "", "salt-m"}
	for i, w := range want {
		if got := d.CacheSalt(i); got != w {
			t.Errorf("event %d (%+v): salt %q, want %q", i, evs[i], got, w)
		}
	}
	if d.CacheSalt(-1) != "" || d.CacheSalt(99) != "" {
		t.Error("out of range must be empty")
	}
}

// mpSize measures every kind of msgpack value exactly as encoded by the
// library, and rejects lengths that run past the input.
func TestMsgpackSize(t *testing.T) {
	vals := []any{
		nil, true, false, 0, 1, -1, 127, 128, -33, 300, -300, 70000, -70000, 1 << 40, -(1 << 40), uint64(1 << 63),
		float32(1.5), 2.5, "", "x", strings.Repeat("s", 31), strings.Repeat("s", 32), strings.Repeat("s", 300), strings.Repeat("s", 70000),
		[]byte{}, []byte{1, 2}, bytes.Repeat([]byte{3}, 300), bytes.Repeat([]byte{3}, 70000),
		[]any{}, []any{1, "a", []any{nil}}, make([]int, 20), make([]int, 70000),
		map[string]any{}, map[string]any{"a": 1, "b": []any{map[string]any{"c": "d"}}}, map[string]int{"0": 0, "1": 1, "2": 2, "3": 3, "4": 4, "5": 5, "6": 6, "7": 7, "8": 8, "9": 9, "10": 10, "11": 11, "12": 12, "13": 13, "14": 14, "15": 15, "16": 16},
	}
	for _, v := range vals {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		n, err := mpSize(b, 0)
		if err != nil || n != len(b) {
			t.Fatalf("%T %.20v: size %d err %v, encoded %d bytes", v, v, n, err, len(b))
		}
		if len(b) > 1 {
			if _, err := mpSize(b[:len(b)-1], 0); err == nil {
				t.Fatalf("%T %.20v: truncated encoding accepted", v, v)
			}
		}
	}
	// ext types, fixed and variable
	for _, ext := range [][]byte{{0xd4, 1, 9}, {0xd5, 1, 9, 9}, {0xd6, 1, 0, 0, 0, 0}, {0xd7, 1, 0, 0, 0, 0, 0, 0, 0, 0}, {0xc7, 2, 5, 7, 7}, {0xc8, 0, 1, 5, 7}, {0xc9, 0, 0, 0, 0, 5}} {
		if n, err := mpSize(ext, 0); err != nil || n != len(ext) {
			t.Fatalf("ext %x: %d %v", ext, n, err)
		}
	}
	// a huge claimed length, deep nesting, the never-used code
	for _, bad := range [][]byte{{0xc9, 0x08, 0xbe, 0x01, 0x4a, 0x89}, bytes.Repeat([]byte{0x91}, 200), {0xc1}} {
		if _, err := mpSize(bad, 0); err == nil {
			t.Fatalf("%x accepted", bad)
		}
	}
}

func TestCacheSaltRoundTrip(t *testing.T) {
	for _, enc := range []VLLMEncoding{VLLMArrays, VLLMMaps} {
		evs := []Event{
			{Kind: BlockStored, EngineHashes: []uint64{1, 2}, Tokens: make([]uint32, 32), BlockSize: 16, CacheSalt: "tenant-salt"},
			{Kind: BlockStored, EngineHashes: []uint64{3}, HasParent: true, EngineParent: 2, Tokens: make([]uint32, 16), BlockSize: 16, CacheSalt: "ignored-with-parent"},
		}
		var d VLLMDecoder
		_, got, _, err := d.Decode(AppendVLLMBatch(nil, 1, evs, 0, enc))
		if err != nil || len(got) != 2 {
			t.Fatalf("encoding %d: %v %d", enc, err, len(got))
		}
		if d.CacheSalt(0) != "tenant-salt" || d.CacheSalt(1) != "" {
			t.Fatalf("encoding %d: salts %q %q", enc, d.CacheSalt(0), d.CacheSalt(1))
		}
	}
}

// A batch's size bounds what decoding it holds (the twenty-ninth session's
// review): malformed events stand as one AllBlocksCleared, which drops the
// events before it, not as one 168-byte event per byte of payload (4 MiB of
// one-byte nils took 500 MiB); arenas a large batch grew are let go at the
// next, and no payload is kept after its Decode, read or failed.
func TestDecodeVLLMBoundsWhatABatchHolds(t *testing.T) {
	stored := func(f *fixture, h int64) *fixture {
		return f.arr(5).str("BlockStored").ints(h).nil_().ints(toks(2, 0)...).i(2)
	}
	f := newFixture(t).arr(3).fl(1).arr(1003)
	stored(f, 7)
	for range 1000 {
		f.nil_()
	}
	f.arr(1).str("AllBlocksCleared")
	stored(f, 8).i(0)
	var d VLLMDecoder
	_, evs, _, err := d.Decode(f.bytes())
	var kinds []EventKind
	for _, ev := range evs {
		kinds = append(kinds, ev.Kind)
	}
	if want := []EventKind{AllBlocksCleared, BlockStored}; err != nil || !reflect.DeepEqual(kinds, want) || d.Malformed != 1000 {
		t.Fatalf("%v: %d events, kinds %v (want %v), malformed %d", err, len(kinds), kinds[:min(len(kinds), 5)], want, d.Malformed)
	}
	if sk := d.Skipped(); sk == nil || sk.Index != 1 || !sk.Cleared {
		t.Fatalf("skipped %+v", sk)
	}

	if evs[1].EngineHashes[0] != 8 || d.payload != nil || d.rd.Size() != 0 || d.kindRd.Size() != 0 {
		t.Fatalf("events %+v; payload held after Decode: %v %d %d", evs, d.payload != nil, d.rd.Size(), d.kindRd.Size())
	}
	if _, _, _, err := d.Decode([]byte{0x93, 0xcb}); err == nil || d.payload != nil {
		t.Fatalf("a truncated batch: %v; payload held after Decode: %v", err, d.payload != nil)
	}

	n := keptHashes + 1
	f = newFixture(t).arr(3).fl(1).arr(2)
	f.arr(5).str("BlockStored").arr(n)
	for i := range n {
		f.i(int64(i))
	}
	f.nil_().arr(n)
	for i := range n {
		f.i(int64(i % 100))
	}
	f.i(1)
	f.arr(5).str("BlockStored").ints(1).nil_().ints(toks(keptEvents, 0)...).i(keptEvents)
	if _, evs, _, err := d.Decode(f.i(0).bytes()); err != nil || len(evs) != 2 || len(evs[0].EngineHashes) != n {
		t.Fatalf("a large batch: %v, %d events", err, len(evs))
	}
	if _, _, _, err := d.Decode(newFixture(t).arr(2).fl(1).arr(0).bytes()); err != nil {
		t.Fatal(err)
	}
	if cap(d.hashes) > keptHashes || cap(d.tokens) > keptTokens || cap(d.events) > keptEvents || d.payload != nil {
		t.Fatalf("after a small batch the decoder holds %d hashes, %d tokens, %d events of arenas, payload %v",
			cap(d.hashes), cap(d.tokens), cap(d.events), d.payload != nil)
	}
}

// A hybrid model's events are followed for the lowest group of full
// attention once a BlockStored names its kind; until then, and for a model
// whose groups all have windows, the lowest group named. gpt-oss's and
// Gemma 3's group 0 is a sliding window's, which frees blocks as the
// window passes: it was the one followed (the twenty-ninth session's
// review). The group followed until a change may be indexed: an
// AllBlocksCleared comes first.
func TestDecodeVLLMFollowsTheFullAttentionGroup(t *testing.T) {
	stored := func(f *fixture, h int64, group int64, kind string) *fixture {
		f.arr(11).str("BlockStored").ints(h).nil_().ints(toks(2, 0)...).i(2).nil_().str("GPU").nil_().nil_().i(group)
		if kind == "" {
			return f.nil_()
		}
		return f.str(kind)
	}
	removed := func(f *fixture, h int64, group int64) *fixture {
		return f.arr(4).str("BlockRemoved").ints(h).str("GPU").i(group)
	}
	type ev struct {
		kind EventKind
		hash uint64
	}
	decode := func(d *VLLMDecoder, build func(f *fixture)) []ev {
		f := newFixture(t).arr(3).fl(1)
		build(f)
		_, evs, _, err := d.Decode(f.i(0).bytes())
		if err != nil {
			t.Fatal(err)
		}
		var out []ev
		for _, e := range evs {
			var h uint64
			if len(e.EngineHashes) > 0 {
				h = e.EngineHashes[0]
			}
			out = append(out, ev{e.Kind, h})
		}
		return out
	}

	// Each case decodes its batches in turn with one decoder; forget calls
	// ForgetGroup before the last (its feed cleared).
	type batch struct {
		events []func(f *fixture) *fixture
		want   []ev
	}
	st := func(h, group int64, kind string) func(f *fixture) *fixture {
		return func(f *fixture) *fixture { return stored(f, h, group, kind) }
	}
	rm := func(h, group int64) func(f *fixture) *fixture {
		return func(f *fixture) *fixture { return removed(f, h, group) }
	}
	clr := func(f *fixture) *fixture { return f.arr(1).str("AllBlocksCleared") }
	for _, c := range []struct {
		name    string
		batches []batch
		forget  bool
	}{
		{"gpt-oss: group 0 a sliding window's, group 1 full; the choice holds", []batch{
			{[]func(*fixture) *fixture{st(1, 0, "sliding_window"), st(2, 1, "full_attention"), st(3, 0, "sliding_window"), rm(1, 0), rm(2, 1)},
				[]ev{{BlockStored, 1}, {AllBlocksCleared, 0}, {BlockStored, 2}, {BlockRemoved, 2}}},
			{[]func(*fixture) *fixture{st(4, 0, "sliding_window"), st(5, 1, "full_attention"), rm(4, 0)}, []ev{{BlockStored, 5}}},
		}, false},
		// The engine restarts behind the feed with another layout (hybrid
		// allocation turned on): the group followed changes kind, and the
		// choice is made anew (the review).
		{"a restart with another layout", []batch{
			{[]func(*fixture) *fixture{st(9, 0, "full_attention")}, []ev{{BlockStored, 9}}},
			{[]func(*fixture) *fixture{st(10, 0, "sliding_window"), st(11, 1, "full_attention"), rm(10, 0)},
				[]ev{{BlockStored, 10}, {AllBlocksCleared, 0}, {BlockStored, 11}}},
		}, false},
		// vLLM's "unknown" (a group of mixed kinds) ranks under full
		// attention; once its feed is cleared, the choice is made again,
		// with no clear.
		{"unknown, then full; forgotten", []batch{
			{[]func(*fixture) *fixture{st(12, 0, "unknown"), st(13, 1, "mla_attention")}, []ev{{BlockStored, 12}, {AllBlocksCleared, 0}, {BlockStored, 13}}},
			{[]func(*fixture) *fixture{st(14, 0, ""), st(15, 1, "")}, []ev{{BlockStored, 14}}},
		}, true},
		// The engine's own clear (reset_prefix_cache, or a restart the
		// feed did not see) makes the choice again: a model whose only
		// group is a sliding window's is followed after one that had full
		// attention in group 1.
		{"the engine clears its cache", []batch{
			{[]func(*fixture) *fixture{st(30, 1, "full_attention")}, []ev{{AllBlocksCleared, 0}, {BlockStored, 30}}},
			{[]func(*fixture) *fixture{clr, st(31, 0, "sliding_window"), rm(31, 0)}, []ev{{AllBlocksCleared, 0}, {BlockStored, 31}, {BlockRemoved, 31}}},
		}, false},
		{"one group, of a sliding window (Mistral 7B v0.1)", []batch{
			{[]func(*fixture) *fixture{st(6, 0, "sliding_window"), rm(6, 0)}, []ev{{BlockStored, 6}, {BlockRemoved, 6}}},
		}, false},
		{"no kinds (older vLLM): group 0, as before", []batch{
			{[]func(*fixture) *fixture{st(7, 1, ""), st(8, 0, ""), rm(7, 1)}, []ev{{BlockStored, 8}}},
		}, false},
	} {
		var d VLLMDecoder
		for i, b := range c.batches {
			if c.forget && i == len(c.batches)-1 {
				d.ForgetGroup()
			}
			got := decode(&d, func(f *fixture) {
				f.arr(len(b.events))
				for _, e := range b.events {
					e(f)
				}
			})
			if !reflect.DeepEqual(got, b.want) {
				t.Fatalf("%s, batch %d: %v, want %v", c.name, i, got, b.want)
			}
		}
	}
}
