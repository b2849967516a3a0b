package kv

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
	"github.com/zeebo/xxh3"
)

// vLLM's KV event payload (vllm/distributed/kv_events.py), as msgspec encodes it.
//
// The batch is either an array [ts, events] / [ts, events, data_parallel_rank]
// (array_like=True, older vLLM) or a map {"ts", "events", "data_parallel_rank"}
// (newer vLLM). Each event is either a tagged array whose first element is the
// type name, or a map with a "type" key:
//
//	["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//	  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]
//	["BlockRemoved", block_hashes, medium, group_idx, ...]
//	["AllBlocksCleared"]
//
// omit_defaults drops trailing fields that hold their default, so every field
// after block_size (BlockStored) or block_hashes (BlockRemoved) may be absent.
// Fields beyond the ones listed, and unknown map keys, are skipped. Unknown
// event types are skipped too, so a newer engine does not break the feed.
//
// Block hashes are integers (signed or unsigned 64-bit; their bits are kept)
// or byte strings (newer vLLM: a SHA-256 digest). A byte-string hash is folded
// to 64 bits with xxh3-64 (seed 0) over its bytes. Engine hashes are opaque
// keys that only have to match between BlockStored and BlockRemoved of one
// engine, so any deterministic fold works; xxh3 keeps collisions negligible.
//
// A BlockStored with only the deprecated lora_id (no lora_name) gets the
// LoRAName "lora_id:<n>", so its blocks never mix with the base model's.
// Hybrid models (several KV cache groups) tag events with group_idx; one
// group's events are decoded, the others' skipped, so one group's cache
// picture is followed rather than a mix of several. It is group 0 (or no
// group_idx) until a BlockStored names its group's kind
// (kv_cache_spec_kind): then the lowest group of full attention, the one
// that holds a prompt's whole prefix, or if none has been seen the lowest
// group of any kind ("unknown" before a window's). A sliding window's
// group (group 0 of gpt-oss and Gemma 3, whose first layer is local) frees
// blocks as the window passes them, so its picture of a long prefix is
// short. On a change of group an AllBlocksCleared is put before the event,
// as the group followed until then may have been indexed; the group
// followed changing kind (the engine restarted with another layout) makes
// the choice anew.
//
// medium maps to a Tier (TierFromMedium; absent or nil is the device); an
// unknown medium gives TierDisk and is counted in VLLMDecoder.UnknownMedia
// rather than failing the batch. SGLang's bigram token ids (a pair per
// position, EAGLE) are read as the first token of each pair. Token ids must
// fit in uint32 and a BlockStored must carry block_size token ids per block.
//
// A BlockStored without token ids is a copy (see Event): vLLM's
// OffloadingConnector reports the blocks it offloads as
// BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[],
// block_size=0 (older versions: the block size), medium="CPU"). It decodes
// with no Tokens, no parent and BlockSize 0, whatever block_size says.
//
// One event that cannot be read does not fail its batch, as long as the
// payload's structure (where each event ends) is sound: a BlockStored is
// left out (its blocks are not indexed, which under-reports only), an
// event of a type this decoder does not know is skipped as such events
// are, and any other (a BlockRemoved, an AllBlocksCleared, an event whose
// type cannot be read) becomes AllBlocksCleared: what it removed is
// unknown, so nothing of that rank can be vouched for any more, and the
// batch's events before it are dropped. Such events are counted in
// VLLMDecoder.Malformed and described by Skipped.

// EngineHashFromBytes folds a byte-string engine block hash to 64 bits.
func EngineHashFromBytes(b []byte) uint64 { return xxh3.Hash(b) }

// VLLMDecoder decodes vLLM KV event payloads. It reuses its buffers: the
// events returned by Decode, and the slices inside them, are valid until the
// next call to Decode. A VLLMDecoder is not safe for concurrent use; the zero
// value is ready to use.
type VLLMDecoder struct {
	rd      bytes.Reader
	payload []byte
	dec     *msgpack.Decoder
	scratch []byte
	events  []Event
	spans   []span
	hashes  []uint64
	tokens  []uint32
	names   map[string]string
	salts   []string // cache salt per event ("" if none)
	// lastExtra: the last string of a BlockStored's extra keys so far.
	lastExtra []byte
	// kindRd and kindDec read a malformed event's type.
	kindRd  bytes.Reader
	kindDec *msgpack.Decoder

	// UnknownMedia counts events whose medium was not recognised; they
	// were given TierDisk.
	UnknownMedia uint64
	// groups chooses the KV cache group followed.
	groups GroupFollower

	// Malformed counts events that could not be read in a sound payload:
	// left out, or turned into AllBlocksCleared (see Skipped).
	Malformed uint64
	skipped   *MalformedEventError // the first of the last Decode
}

// MalformedEventError describes an event of a batch that could not be read:
// Index is its position in the batch's event list, Kind its type when that
// could be read (0 otherwise), Cleared whether it became AllBlocksCleared.
type MalformedEventError struct {
	Index   int
	Kind    EventKind
	Cleared bool
	Err     error
}

func (e *MalformedEventError) Error() string {
	what := "skipped"
	if e.Cleared {
		what = "its rank's blocks dropped"
	}
	kind := "type unreadable"
	switch e.Kind {
	case BlockStored:
		kind = "BlockStored"
	case BlockRemoved:
		kind = "BlockRemoved"
	case AllBlocksCleared:
		kind = "AllBlocksCleared"
	}
	return fmt.Sprintf("events[%d] (%s): %v; %s", e.Index, kind, e.Err, what)
}

func (e *MalformedEventError) Unwrap() error { return e.Err }

// Skipped describes the first event the last Decode could not read, nil if
// it read them all.
func (d *VLLMDecoder) Skipped() *MalformedEventError { return d.skipped }

// span records where an event's hashes and tokens sit in the shared arenas
// while they may still grow; slices are cut only once decoding is done.
type span struct{ h0, h1, t0, t1 int }

// maxInterned bounds the decoder's string table (medium and LoRA names).
const maxInterned = 1024

// DecodeVLLM decodes one payload with a fresh decoder. The result owns its
// memory. Use a VLLMDecoder on hot paths.
func DecodeVLLM(payload []byte) (ts float64, events []Event, dpRank int, err error) {
	var d VLLMDecoder
	return d.Decode(payload)
}

// Arenas grown past these capacities by a batch far larger than usual go to
// the garbage collector at the next Decode rather than staying for good.
// SGLang publishes an event per page, of one token by default, so a
// prefill's batch holds thousands of events: they stay. About 5 MiB of
// arenas at most stay for each feed.
const (
	keptEvents = 1 << 14
	keptHashes = 1 << 17
	keptTokens = 1 << 19
)

// Decode decodes one msgpack payload of a vLLM KVEventBatch.
func (d *VLLMDecoder) Decode(payload []byte) (ts float64, events []Event, dpRank int, err error) {
	if cap(d.events) > keptEvents {
		d.events, d.salts, d.spans = nil, nil, nil
	}
	if cap(d.hashes) > keptHashes {
		d.hashes = nil
	}
	if cap(d.tokens) > keptTokens {
		d.tokens = nil
	}
	d.payload = payload
	defer func() {
		// Nothing holds the payload once Decode returns: a large batch
		// stayed until the next one, which an idle engine may never send.
		d.payload = nil
		d.rd.Reset(nil)
		d.kindRd.Reset(nil)
	}()
	d.rd.Reset(payload)
	if d.dec == nil {
		d.dec = msgpack.NewDecoder(&d.rd)
	} else {
		d.dec.ResetReader(&d.rd)
	}
	d.events = d.events[:0]
	d.salts = d.salts[:0]
	d.spans = d.spans[:0]
	d.hashes = d.hashes[:0]
	d.tokens = d.tokens[:0]
	d.skipped = nil

	ts, dpRank, err = d.batch()
	if err == nil && d.rd.Len() != 0 {
		err = fmt.Errorf("%d trailing bytes after the batch", d.rd.Len())
	}
	if err != nil {
		return 0, nil, 0, fmt.Errorf("vllm kv events: %w", err)
	}
	for i := range d.events {
		s := d.spans[i]
		if s.h1 > s.h0 {
			d.events[i].EngineHashes = d.hashes[s.h0:s.h1:s.h1]
		}
		if s.t1 > s.t0 {
			d.events[i].Tokens = d.tokens[s.t0:s.t1:s.t1]
		}
	}
	return ts, d.events, dpRank, nil
}

func (d *VLLMDecoder) batch() (ts float64, dpRank int, err error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, 0, err
	}
	if msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32 {
		n, err := d.dec.DecodeMapLen()
		if err != nil {
			return 0, 0, err
		}
		if err := d.checkLen(n, 2); err != nil {
			return 0, 0, err
		}
		for i := 0; i < n; i++ {
			key, err := d.str()
			if err != nil {
				return 0, 0, fmt.Errorf("batch key: %w", err)
			}
			switch string(key) {
			case "ts":
				ts, err = d.dec.DecodeFloat64()
			case "events":
				err = d.eventList()
			case "data_parallel_rank":
				dpRank, err = d.rank()
			default:
				err = d.skip()
			}
			if err != nil {
				return 0, 0, err
			}
		}
		return ts, dpRank, nil
	}
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return 0, 0, fmt.Errorf("batch: %w", err)
	}
	if n < 2 {
		return 0, 0, fmt.Errorf("batch: array of %d elements, want [ts, events, dp_rank?]", n)
	}
	if err := d.checkLen(n, 1); err != nil {
		return 0, 0, err
	}
	if ts, err = d.dec.DecodeFloat64(); err != nil {
		return 0, 0, fmt.Errorf("batch ts: %w", err)
	}
	if err = d.eventList(); err != nil {
		return 0, 0, err
	}
	if n > 2 {
		if dpRank, err = d.rank(); err != nil {
			return 0, 0, err
		}
	}
	for i := 3; i < n; i++ {
		if err := d.skip(); err != nil {
			return 0, 0, err
		}
	}
	return ts, dpRank, nil
}

func (d *VLLMDecoder) rank() (int, error) {
	v, err := d.dec.DecodeInt64() // nil decodes as 0
	if err != nil {
		return 0, fmt.Errorf("data_parallel_rank: %w", err)
	}
	if v < 0 || v > math.MaxInt32 {
		return 0, fmt.Errorf("data_parallel_rank %d out of range", v)
	}
	return int(v), nil
}

// checkLen rejects a container length that cannot fit in the bytes left
// (every element takes at least min bytes), so a forged length never
// drives a large allocation.
func (d *VLLMDecoder) checkLen(n, min int) error {
	if n < 0 {
		return errors.New("unexpected nil")
	}
	if n > d.rd.Len()/min {
		return fmt.Errorf("length %d exceeds the %d bytes left", n, d.rd.Len())
	}
	return nil
}

func (d *VLLMDecoder) eventList() error {
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return fmt.Errorf("events: %w", err)
	}
	if err := d.checkLen(n, 1); err != nil {
		return fmt.Errorf("events: %w", err)
	}
	for i := 0; i < n; i++ {
		start, h0, t0 := len(d.payload)-d.rd.Len(), len(d.hashes), len(d.tokens)
		if err := d.event(); err != nil {
			d.hashes, d.tokens = d.hashes[:h0], d.tokens[:t0]
			if serr := d.skipEvent(i, start, err); serr != nil {
				return fmt.Errorf("events[%d]: %w", i, serr)
			}
		}
	}
	return nil
}

// skipEvent passes over event i, which starts at payload offset start and
// could not be read (err), if the payload says where it ends: see the
// package comment for what stands in its place. Otherwise the batch cannot
// be read past it, and skipEvent returns err.
func (d *VLLMDecoder) skipEvent(i, start int, err error) error {
	raw := d.payload[start:]
	size, serr := mpSize(raw, 0)
	if serr != nil {
		return err
	}
	if _, serr := d.rd.Seek(int64(start+size), io.SeekStart); serr != nil {
		return err
	}
	kind, known := d.kindAt(raw[:size])
	cleared := !known || (kind != BlockStored && kind != 0)
	if cleared {
		// What the batch's events before it did is undone: they are
		// dropped. A batch of one-byte malformed events (nil), each
		// standing for an AllBlocksCleared, decoded to 168 bytes of events
		// per byte of payload (the twenty-ninth session's review: 4 MiB
		// held 500 MiB); now no more than its valid events. A count of
		// events may not cut a batch short: SGLang publishes one per page,
		// of a single token by default.
		d.events, d.salts, d.spans = d.events[:0], d.salts[:0], d.spans[:0]
		d.hashes, d.tokens = d.hashes[:0], d.tokens[:0]
		d.add(Event{Kind: AllBlocksCleared}, "", span{})
	}
	d.Malformed++
	if d.skipped == nil {
		d.skipped = &MalformedEventError{Index: i, Kind: kind, Cleared: cleared, Err: err}
	}
	return nil
}

// kindAt reads the type of the event encoded in raw (a tagged array, or a
// map with a "type" key). known is false if the type cannot be read; an
// unrecognised type gives kind 0, known true.
func (d *VLLMDecoder) kindAt(raw []byte) (kind EventKind, known bool) {
	d.kindRd.Reset(raw)
	if d.kindDec == nil {
		d.kindDec = msgpack.NewDecoder(&d.kindRd)
	} else {
		d.kindDec.ResetReader(&d.kindRd)
	}
	dec := d.kindDec
	c, err := dec.PeekCode()
	if err != nil {
		return 0, false
	}
	if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
		if n, err := dec.DecodeArrayLen(); err != nil || n < 1 {
			return 0, false
		}
		return tagKind(dec)
	}
	n, err := dec.DecodeMapLen()
	if err != nil {
		return 0, false
	}
	for i := 0; i < n; i++ {
		key, err := dec.DecodeString()
		if err != nil {
			return 0, false
		}
		if key == "type" {
			return tagKind(dec)
		}
		if err := dec.Skip(); err != nil {
			return 0, false
		}
	}
	return 0, false
}

func tagKind(dec *msgpack.Decoder) (EventKind, bool) {
	tag, err := dec.DecodeString()
	if err != nil {
		return 0, false
	}
	kind, _ := kindOf([]byte(tag))
	return kind, true
}

// pending collects one event's fields in whatever order they arrive.
type pending struct {
	kind       EventKind
	unknown    bool
	sp         span
	hasParent  bool
	parent     uint64
	blockSize  int64
	loraID     int64
	hasLoraID  bool
	medium     string
	loraName   string
	sawHashes  bool
	sawBlockSz bool
	groupIdx   int64
	specKind   string // kv_cache_spec_kind ("" when absent)
	// extra_keys[0]'s string elements: how many, the first and the last
	nExtra                int
	firstExtra, lastExtra string
}

func (d *VLLMDecoder) event() error {
	c, err := d.dec.PeekCode()
	if err != nil {
		return err
	}
	var p pending
	p.sp.h0, p.sp.h1 = len(d.hashes), len(d.hashes)
	p.sp.t0, p.sp.t1 = len(d.tokens), len(d.tokens)
	if msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32 {
		err = d.mapEvent(&p)
	} else {
		err = d.arrayEvent(&p)
	}
	if err != nil {
		return err
	}
	if p.unknown || !d.follows(&p) {
		d.hashes = d.hashes[:p.sp.h0]
		d.tokens = d.tokens[:p.sp.t0]
		return nil
	}
	return d.finish(&p)
}

// follows reports whether p is of the KV cache group followed, changing
// group first if p's BlockStored names a better one (see the package
// comment).
func (d *VLLMDecoder) follows(p *pending) bool {
	follow, changed := d.groups.Follow(p.kind, p.groupIdx, p.specKind)
	if changed {
		// What was followed until now (group 0 by default) may be
		// indexed: it goes.
		d.add(Event{Kind: AllBlocksCleared}, "", span{h0: p.sp.h0, h1: p.sp.h0, t0: p.sp.t0, t1: p.sp.t0})
	}
	return follow
}

// ForgetGroup makes the decoder choose its KV cache group again from the
// events that come (group 0 until one names its kind), without a clear:
// for a feed whose ranks were just cleared.
func (d *VLLMDecoder) ForgetGroup() { d.groups.Forget() }

func (d *VLLMDecoder) arrayEvent(p *pending) error {
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 1 {
		return errors.New("empty event array")
	}
	if err := d.checkLen(n, 1); err != nil {
		return err
	}
	tag, err := d.str()
	if err != nil {
		return fmt.Errorf("event tag: %w", err)
	}
	p.kind, p.unknown = kindOf(tag)
	var order []fieldID
	switch p.kind {
	case BlockStored:
		order = storedOrder[:]
	case BlockRemoved:
		order = removedOrder[:]
	}
	for i := 1; i < n; i++ {
		f := fUnknown
		if !p.unknown && i-1 < len(order) {
			f = order[i-1]
		}
		if err := d.field(p, f); err != nil {
			return err
		}
	}
	return nil
}

// fieldID names the event fields the decoder reads.
type fieldID uint8

const (
	fUnknown fieldID = iota
	fBlockHashes
	fParent
	fTokenIDs
	fBlockSize
	fLoraID
	fMedium
	fLoraName
	fGroupIdx
	fExtraKeys
	fSpecKind
)

var fieldNames = [...]string{"unknown field", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "group_idx", "extra_keys", "kv_cache_spec_kind"}

// Positional field order of the array encoding, after the tag.
var (
	storedOrder  = [...]fieldID{fBlockHashes, fParent, fTokenIDs, fBlockSize, fLoraID, fMedium, fLoraName, fExtraKeys, fGroupIdx, fSpecKind}
	removedOrder = [...]fieldID{fBlockHashes, fMedium, fGroupIdx}
)

func fieldOf(key []byte) fieldID {
	switch string(key) {
	case "block_hashes":
		return fBlockHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokenIDs
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoraID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoraName
	case "group_idx":
		return fGroupIdx
	case "extra_keys":
		return fExtraKeys
	case "kv_cache_spec_kind":
		return fSpecKind
	}
	return fUnknown
}

func kindOf(tag []byte) (EventKind, bool) {
	switch string(tag) {
	case "BlockStored":
		return BlockStored, false
	case "BlockRemoved":
		return BlockRemoved, false
	case "AllBlocksCleared":
		return AllBlocksCleared, false
	}
	return 0, true
}

func (d *VLLMDecoder) mapEvent(p *pending) error {
	n, err := d.dec.DecodeMapLen()
	if err != nil {
		return err
	}
	if err := d.checkLen(n, 2); err != nil {
		return err
	}
	sawType := false
	for i := 0; i < n; i++ {
		key, err := d.str()
		if err != nil {
			return fmt.Errorf("event key: %w", err)
		}
		if string(key) == "type" {
			tag, err := d.str()
			if err != nil {
				return fmt.Errorf("type: %w", err)
			}
			p.kind, p.unknown = kindOf(tag)
			sawType = true
			continue
		}
		if err := d.field(p, fieldOf(key)); err != nil {
			return err
		}
	}
	if !sawType {
		return errors.New(`event map without "type"`)
	}
	return nil
}

// field decodes one named field into p; unknown names are skipped. Fields are
// decoded whatever the event type (a map may name its type last) and the
// type decides in finish which of them count.
func (d *VLLMDecoder) field(p *pending, f fieldID) error {
	var err error
	switch f {
	case fBlockHashes:
		p.sawHashes = true
		d.hashes = d.hashes[:p.sp.h0]
		err = d.hashList()
		p.sp.h1 = len(d.hashes)
	case fParent:
		p.hasParent, p.parent, err = d.optHash()
	case fTokenIDs:
		d.tokens = d.tokens[:p.sp.t0]
		err = d.tokenList()
		p.sp.t1 = len(d.tokens)
	case fBlockSize:
		p.sawBlockSz = true
		p.blockSize, err = d.dec.DecodeInt64()
	case fLoraID:
		var c byte
		if c, err = d.dec.PeekCode(); err == nil {
			p.hasLoraID = c != msgpcode.Nil
			p.loraID, err = d.dec.DecodeInt64()
		}
	case fMedium:
		p.medium, err = d.optStr()
	case fExtraKeys:
		err = d.extraKeys(p)
	case fGroupIdx:
		p.groupIdx, err = d.dec.DecodeInt64() // nil decodes as 0
	case fLoraName:
		p.loraName, err = d.optStr()
	case fSpecKind:
		p.specKind, err = d.optStr()
	default:
		err = d.skip()
	}
	if err != nil {
		return fmt.Errorf("%s: %w", fieldNames[f], err)
	}
	return nil
}

func (d *VLLMDecoder) finish(p *pending) error {
	ev := Event{Kind: p.kind}
	salt := ""
	sp := span{h0: p.sp.h0, h1: p.sp.h0, t0: p.sp.t0, t1: p.sp.t0}
	switch p.kind {
	case BlockStored:
		if p.sawHashes && p.sp.t1 == p.sp.t0 {
			// A copy: no parent, tokens or block size (which vLLM's
			// offloading connector gives as 0 or the block size).
			sp.h1 = p.sp.h1
			break
		}
		if !p.sawHashes || !p.sawBlockSz {
			return errors.New("BlockStored without block_hashes or block_size")
		}
		if p.blockSize <= 0 || p.blockSize > 1<<20 {
			return fmt.Errorf("block_size %d out of range", p.blockSize)
		}
		nh, nt := p.sp.h1-p.sp.h0, p.sp.t1-p.sp.t0
		if int64(nt) != int64(nh)*p.blockSize {
			return fmt.Errorf("%d token_ids for %d blocks of %d", nt, nh, p.blockSize)
		}
		ev.BlockSize = int(p.blockSize)
		ev.HasParent, ev.EngineParent = p.hasParent, p.parent
		if !p.hasParent {
			salt = p.cacheSalt()
		}
		ev.LoRAName = p.loraName
		if ev.LoRAName == "" && p.hasLoraID {
			d.scratch = strconv.AppendInt(append(d.scratch[:0], "lora_id:"...), p.loraID, 10)
			ev.LoRAName = d.intern(d.scratch)
		}
		sp = p.sp
	case BlockRemoved:
		if !p.sawHashes {
			return errors.New("BlockRemoved without block_hashes")
		}
		sp.h1 = p.sp.h1
	}
	if p.kind != AllBlocksCleared {
		t, err := TierFromMedium(p.medium)
		if err != nil {
			// A medium this version does not know must not fail the batch
			// (the feed would be cleared over and over): assume the
			// slowest local tier, and count it.
			t = TierDisk
			d.UnknownMedia++
		}
		ev.Tier = t
	}
	d.hashes = d.hashes[:sp.h1]
	d.tokens = d.tokens[:sp.t1]
	d.add(ev, salt, sp)
	return nil
}

// add appends a decoded event. An AllBlocksCleared right after another
// adds nothing and is left out.
func (d *VLLMDecoder) add(ev Event, salt string, sp span) {
	if ev.Kind == AllBlocksCleared && len(d.events) > 0 && d.events[len(d.events)-1].Kind == AllBlocksCleared {
		return
	}
	d.events = append(d.events, ev)
	d.salts = append(d.salts, salt)
	d.spans = append(d.spans, sp)
}

// extraKeys reads extra_keys (one entry per block, each nil or a tuple) and
// keeps the string elements of the first block's tuple: vLLM builds it as
// lora_name?, multimodal keys (tuples), cache_salt?, prompt-embedding keys.
func (d *VLLMDecoder) extraKeys(p *pending) error {
	n, err := d.dec.DecodeArrayLen()
	if err != nil || n <= 0 {
		return err // nil (n == -1) or empty
	}
	if err := d.checkLen(n, 1); err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		if i > 0 {
			if err := d.skip(); err != nil {
				return err
			}
			continue
		}
		m, err := d.dec.DecodeArrayLen()
		if err != nil {
			return err
		}
		if m <= 0 { // nil: no extra keys for block 0
			continue
		}
		if err := d.checkLen(m, 1); err != nil {
			return err
		}
		for j := 0; j < m; j++ {
			c, err := d.dec.PeekCode()
			if err != nil {
				return err
			}
			if !msgpcode.IsString(c) {
				if err := d.skip(); err != nil {
					return err
				}
				continue
			}
			b, err := d.str()
			if err != nil {
				return err
			}
			if p.nExtra == 0 {
				p.firstExtra = d.intern(b)
			} else {
				d.lastExtra = append(d.lastExtra[:0], b...) // not interned: multimodal hashes
			}
			p.nExtra++
		}
		p.lastExtra = p.firstExtra
		if p.nExtra > 1 {
			p.lastExtra = d.intern(d.lastExtra)
		}
	}
	return nil
}

// cacheSalt picks the cache_salt out of the first block's extra keys: the
// last string, unless it is the LoRA name leading the tuple. vLLM puts the
// salt after the LoRA name and the multimodal hashes (plain strings in
// current versions), and the first string after the name was an image's
// hash (the twenty-ninth session's review).
func (p *pending) cacheSalt() string {
	if p.nExtra == 0 || p.nExtra == 1 && p.loraName != "" && p.firstExtra == p.loraName {
		return ""
	}
	return p.lastExtra
}

// CacheSalt is the cache_salt vLLM hashed into event i of the last Decode
// (a BlockStored starting a sequence, from its extra_keys), or "".
func (d *VLLMDecoder) CacheSalt(i int) string {
	if i < 0 || i >= len(d.salts) {
		return ""
	}
	return d.salts[i]
}

func (d *VLLMDecoder) hashList() error {
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if err := d.checkLen(n, 1); err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		// Fast path: an integer hash read from the payload bytes directly.
		if h, w := mpIntBitsAt(d.payload[len(d.payload)-d.rd.Len():]); w > 0 {
			d.hashes = append(d.hashes, h)
			if _, err := d.rd.Seek(int64(w), io.SeekCurrent); err != nil {
				return err
			}
			continue
		}
		ok, h, err := d.optHash()
		if err != nil {
			return fmt.Errorf("[%d]: %w", i, err)
		}
		if !ok {
			return fmt.Errorf("[%d]: nil hash", i)
		}
		d.hashes = append(d.hashes, h)
	}
	return nil
}

// optHash decodes an integer or byte-string hash, or nil (ok false).
func (d *VLLMDecoder) optHash() (ok bool, h uint64, err error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return false, 0, err
	}
	switch {
	case c == msgpcode.Nil:
		return false, 0, d.skip()
	case msgpcode.IsBin(c) || msgpcode.IsString(c):
		b, err := d.str()
		if err != nil {
			return false, 0, err
		}
		return true, EngineHashFromBytes(b), nil
	}
	h, err = d.dec.DecodeUint64()
	return true, h, err
}

// tokenList reads an array of token ids. Token arrays are most of a payload,
// so their integers are read straight from the payload bytes rather than
// through the generic decoder, and the reader is then advanced past them.
func (d *VLLMDecoder) tokenList() error {
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if err := d.checkLen(n, 1); err != nil {
		return err
	}
	buf := d.payload[len(d.payload)-d.rd.Len():]
	off := 0
	for i := 0; i < n; i++ {
		v, w := mpUintAt(buf[off:])
		if w == 0 && off < len(buf) && isArrayCode(buf[off]) {
			// SGLang's bigram keys (EAGLE) publish each position as a pair
			// (token[j], token[j+1]): the position's token is the first.
			if _, err := d.rd.Seek(int64(off), io.SeekCurrent); err != nil {
				return err
			}
			if v, err = d.firstOfTuple(); err != nil {
				return fmt.Errorf("[%d]: %w", i, err)
			}
			buf, off, w = d.payload[len(d.payload)-d.rd.Len():], 0, 0
		} else if w == 0 {
			return fmt.Errorf("[%d]: not a token id (an integer 0..2^32-1)", i)
		}
		if v > math.MaxUint32 {
			return fmt.Errorf("[%d]: token id %d out of range", i, v)
		}
		d.tokens = append(d.tokens, uint32(v))
		off += w
	}
	_, err = d.rd.Seek(int64(off), io.SeekCurrent)
	return err
}

func isArrayCode(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

// firstOfTuple reads a non-empty array of token ids and returns the first.
func (d *VLLMDecoder) firstOfTuple() (uint64, error) {
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return 0, err
	}
	if n < 1 {
		return 0, errors.New("empty token tuple")
	}
	if err := d.checkLen(n, 1); err != nil {
		return 0, err
	}
	v, err := d.dec.DecodeInt64()
	if err != nil {
		return 0, err
	}
	if v < 0 || v > math.MaxUint32 {
		return 0, fmt.Errorf("token id %d out of range", v)
	}
	for j := 1; j < n; j++ {
		if err := d.skip(); err != nil {
			return 0, err
		}
	}
	return uint64(v), nil
}

// maxSkipDepth bounds the nesting of a value skipped without decoding.
const maxSkipDepth = 64

// skip passes over one value of any type (unknown fields, extra keys). It
// measures the value in the payload bytes and seeks past it: nothing is
// allocated or copied, and a length that claims more bytes than are left is
// an error at once.
func (d *VLLMDecoder) skip() error {
	buf := d.payload[len(d.payload)-d.rd.Len():]
	n, err := mpSize(buf, 0)
	if err != nil {
		return err
	}
	_, err = d.rd.Seek(int64(n), io.SeekCurrent)
	return err
}

var errTruncated = errors.New("value runs past the end of the payload")

// mpSize is the encoded size of the msgpack value at the start of b.
func mpSize(b []byte, depth int) (int, error) {
	if len(b) == 0 {
		return 0, errTruncated
	}
	if depth > maxSkipDepth {
		return 0, errors.New("values nested too deeply")
	}
	c := b[0]
	length := func(w int) (int, error) { // a big-endian length of w bytes after the code
		if len(b) < 1+w {
			return 0, errTruncated
		}
		switch w {
		case 1:
			return int(b[1]), nil
		case 2:
			return int(binary.BigEndian.Uint16(b[1:])), nil
		}
		return int(binary.BigEndian.Uint32(b[1:])), nil
	}
	blob := func(w, extra int) (int, error) { // length-prefixed bytes
		n, err := length(w)
		if err != nil {
			return 0, err
		}
		if size := 1 + w + extra + n; size <= len(b) {
			return size, nil
		}
		return 0, errTruncated
	}
	items := func(head, n int) (int, error) { // n values after a head of head bytes
		if n > len(b)-head {
			return 0, errTruncated
		}
		off := head
		for i := 0; i < n; i++ {
			m, err := mpSize(b[off:], depth+1)
			if err != nil {
				return 0, err
			}
			off += m
		}
		return off, nil
	}
	fixed := func(size int) (int, error) {
		if size > len(b) {
			return 0, errTruncated
		}
		return size, nil
	}
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return 1, nil
	case c <= 0x8f: // fixmap
		return items(1, 2*int(c&0x0f))
	case c <= 0x9f: // fixarray
		return items(1, int(c&0x0f))
	case c <= 0xbf: // fixstr
		return fixed(1 + int(c&0x1f))
	}
	switch c {
	case 0xc4, 0xd9: // bin8, str8
		return blob(1, 0)
	case 0xc5, 0xda:
		return blob(2, 0)
	case 0xc6, 0xdb:
		return blob(4, 0)
	case 0xc7: // ext8: len, type, data
		return blob(1, 1)
	case 0xc8:
		return blob(2, 1)
	case 0xc9:
		return blob(4, 1)
	case 0xca: // float32
		return fixed(5)
	case 0xcb:
		return fixed(9)
	case 0xcc, 0xd0:
		return fixed(2)
	case 0xcd, 0xd1:
		return fixed(3)
	case 0xce, 0xd2:
		return fixed(5)
	case 0xcf, 0xd3:
		return fixed(9)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16: type, data
		return fixed(2 + 1<<(c-0xd4))
	case 0xdc, 0xde: // array16, map16
		n, err := length(2)
		if err != nil {
			return 0, err
		}
		if c == 0xde {
			n *= 2
		}
		return items(3, n)
	case 0xdd, 0xdf:
		n, err := length(4)
		if err != nil {
			return 0, err
		}
		if c == 0xdf {
			n *= 2
		}
		return items(5, n)
	}
	return 0, fmt.Errorf("invalid msgpack code 0x%x", c)
}

// mpIntBitsAt decodes any msgpack integer at the start of b, keeping the
// bits of negative values; width 0 means b does not start with one.
func mpIntBitsAt(b []byte) (uint64, int) {
	if len(b) == 0 {
		return 0, 0
	}
	switch c := b[0]; {
	case c >= 0xe0:
		return uint64(int64(int8(c))), 1
	case c == 0xd0 && len(b) >= 2:
		return uint64(int64(int8(b[1]))), 2
	case c == 0xd1 && len(b) >= 3:
		return uint64(int64(int16(binary.BigEndian.Uint16(b[1:])))), 3
	case c == 0xd2 && len(b) >= 5:
		return uint64(int64(int32(binary.BigEndian.Uint32(b[1:])))), 5
	case c == 0xd3 && len(b) >= 9:
		return binary.BigEndian.Uint64(b[1:]), 9
	}
	return mpUintAt(b)
}

// mpUintAt decodes a non-negative msgpack integer at the start of b and
// returns it with its encoded width; width 0 means b does not start with
// one (negative, another type, or truncated).
func mpUintAt(b []byte) (uint64, int) {
	if len(b) == 0 {
		return 0, 0
	}
	c := b[0]
	switch {
	case c <= 0x7f:
		return uint64(c), 1
	case c == 0xcc || c == 0xd0:
		if len(b) < 2 || (c == 0xd0 && b[1]&0x80 != 0) {
			return 0, 0
		}
		return uint64(b[1]), 2
	case c == 0xcd || c == 0xd1:
		if len(b) < 3 || (c == 0xd1 && b[1]&0x80 != 0) {
			return 0, 0
		}
		return uint64(binary.BigEndian.Uint16(b[1:])), 3
	case c == 0xce || c == 0xd2:
		if len(b) < 5 || (c == 0xd2 && b[1]&0x80 != 0) {
			return 0, 0
		}
		return uint64(binary.BigEndian.Uint32(b[1:])), 5
	case c == 0xcf || c == 0xd3:
		if len(b) < 9 || (c == 0xd3 && b[1]&0x80 != 0) {
			return 0, 0
		}
		return binary.BigEndian.Uint64(b[1:]), 9
	}
	return 0, 0
}

// str reads a str or bin value into the scratch buffer (valid until the
// next read).
func (d *VLLMDecoder) str() ([]byte, error) {
	n, err := d.dec.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, errors.New("unexpected nil")
	}
	if n > d.rd.Len() {
		return nil, fmt.Errorf("string of %d bytes exceeds the %d bytes left", n, d.rd.Len())
	}
	if cap(d.scratch) < n {
		d.scratch = make([]byte, n)
	}
	d.scratch = d.scratch[:n]
	if err := d.dec.ReadFull(d.scratch); err != nil {
		return nil, err
	}
	return d.scratch, nil
}

// optStr reads an interned string; nil reads as "".
func (d *VLLMDecoder) optStr() (string, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return "", err
	}
	if c == msgpcode.Nil {
		return "", d.skip()
	}
	b, err := d.str()
	if err != nil {
		return "", err
	}
	return d.intern(b), nil
}

// intern returns b as a string, reusing an earlier allocation for names seen
// before (media and LoRA names repeat in every batch).
func (d *VLLMDecoder) intern(b []byte) string {
	if s, ok := d.names[string(b)]; ok {
		return s
	}
	s := string(b)
	if d.names == nil {
		d.names = make(map[string]string)
	}
	if len(d.names) < maxInterned {
		d.names[s] = s
	}
	return s
}
