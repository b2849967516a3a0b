package kv

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
)

// HTTPBatch is a validated KvEventBatch pushed over HTTP (POST /v1/kv_events)
// by engines and cache layers (LMCache, custom engines):
//
//	{"engine_id": "gpu-3", "model": "llama", "tenant": "acme", "bytes_per_block": 131072,
//	 "data_parallel_rank": 0,
//	 "events": [
//	   {"type": "block_stored", "block_hashes": [1, 2], "parent_block_hash": null,
//	    "token_ids": [...], "block_size": 16, "medium": "GPU", "lora_name": null,
//	    "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
//	   {"type": "block_removed", "block_hashes": [2], "medium": "GPU", "group_idx": 0},
//	   {"type": "all_blocks_cleared"}]}
//
// Block hashes are JSON integers (signed or unsigned 64-bit; the bits are
// kept) or strings (folded with EngineHashFromBytes). group_idx and
// kv_cache_spec_kind are a hybrid model's KV cache group and its kind, as
// vLLM's events carry them (see GroupFollower). Unknown fields are
// ignored.
type HTTPBatch struct {
	EngineID      string
	Model         string
	Tenant        string
	BytesPerBlock int64
	DPRank        int
	Events        []Event
	// Groups are the events' KV cache groups, nil when no event names one
	// (all of group 0).
	Groups []EventGroup
}

// EventGroup is a pushed event's KV cache group: its index, and for a
// BlockStored its kind ("" when not named).
type EventGroup struct {
	Index int64
	Kind  string
}

// MaxHTTPBatchEvents bounds the events of one pushed batch.
const MaxHTTPBatchEvents = 1 << 16

// HTTPBatchError is a malformed batch; Path names the offending field
// ("events[3].token_ids").
type HTTPBatchError struct {
	Path string
	Msg  string
}

func (e *HTTPBatchError) Error() string {
	if e.Path == "" {
		return "kv event batch: " + e.Msg
	}
	return "kv event batch: " + e.Path + ": " + e.Msg
}

type httpBatchJSON struct {
	EngineID      *string           `json:"engine_id"`
	Model         string            `json:"model"`
	Tenant        string            `json:"tenant"`
	BytesPerBlock int64             `json:"bytes_per_block"`
	DPRank        int               `json:"data_parallel_rank"`
	Events        []json.RawMessage `json:"events"`
}

type httpEventJSON struct {
	Type        string       `json:"type"`
	BlockHashes []engineHash `json:"block_hashes"`
	Parent      *engineHash  `json:"parent_block_hash"`
	TokenIDs    []uint32     `json:"token_ids"`
	BlockSize   int          `json:"block_size"`
	Medium      *string      `json:"medium"`
	LoRAName    *string      `json:"lora_name"`
	GroupIdx    *int64       `json:"group_idx"`
	SpecKind    *string      `json:"kv_cache_spec_kind"`
}

type engineHash uint64

func (h *engineHash) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*h = engineHash(EngineHashFromBytes([]byte(s)))
		return nil
	}
	if bytes.Equal(b, []byte("null")) {
		return errors.New("null block hash")
	}
	if u, err := strconv.ParseUint(string(b), 10, 64); err == nil {
		*h = engineHash(u)
		return nil
	}
	i, err := strconv.ParseInt(string(b), 10, 64)
	if err != nil {
		return fmt.Errorf("block hash %s is not a 64-bit integer or a string", b)
	}
	*h = engineHash(uint64(i))
	return nil
}

// ParseHTTPBatch decodes and validates a pushed batch. Either every event is
// valid and returned, or the error (an *HTTPBatchError) names the first
// problem and nothing is returned.
func ParseHTTPBatch(body []byte) (HTTPBatch, error) {
	var raw httpBatchJSON
	if err := strictUnmarshal(body, &raw); err != nil {
		return HTTPBatch{}, jsonErr("", err)
	}
	if raw.EngineID == nil || *raw.EngineID == "" {
		return HTTPBatch{}, &HTTPBatchError{"engine_id", "required"}
	}
	if raw.BytesPerBlock < 0 {
		return HTTPBatch{}, &HTTPBatchError{"bytes_per_block", "must not be negative"}
	}
	if raw.DPRank < 0 {
		return HTTPBatch{}, &HTTPBatchError{"data_parallel_rank", "must not be negative"}
	}
	if raw.Events == nil {
		return HTTPBatch{}, &HTTPBatchError{"events", "required"}
	}
	if len(raw.Events) > MaxHTTPBatchEvents {
		return HTTPBatch{}, &HTTPBatchError{"events", fmt.Sprintf("%d events, at most %d per batch", len(raw.Events), MaxHTTPBatchEvents)}
	}
	out := HTTPBatch{
		EngineID: *raw.EngineID, Model: raw.Model, Tenant: raw.Tenant,
		BytesPerBlock: raw.BytesPerBlock, DPRank: raw.DPRank,
		Events: make([]Event, 0, len(raw.Events)),
	}
	for i, msg := range raw.Events {
		ev, group, err := parseHTTPEvent(msg)
		if err != nil {
			var be *HTTPBatchError
			if errors.As(err, &be) {
				be.Path = joinPath(fmt.Sprintf("events[%d]", i), be.Path)
				return HTTPBatch{}, be
			}
			return HTTPBatch{}, err
		}
		out.Events = append(out.Events, ev)
		if group != (EventGroup{}) && out.Groups == nil {
			out.Groups = make([]EventGroup, i, len(raw.Events))
		}
		if out.Groups != nil {
			out.Groups = append(out.Groups, group)
		}
	}
	return out, nil
}

func parseHTTPEvent(msg json.RawMessage) (Event, EventGroup, error) {
	var e httpEventJSON
	if err := strictUnmarshal(msg, &e); err != nil {
		return Event{}, EventGroup{}, jsonErr("", err)
	}
	var ev Event
	switch e.Type {
	case "block_stored":
		ev.Kind = BlockStored
	case "block_removed":
		ev.Kind = BlockRemoved
	case "all_blocks_cleared":
		ev.Kind = AllBlocksCleared
	case "":
		return Event{}, EventGroup{}, &HTTPBatchError{"type", "required (block_stored, block_removed or all_blocks_cleared)"}
	default:
		return Event{}, EventGroup{}, &HTTPBatchError{"type", fmt.Sprintf("unknown event type %q (want block_stored, block_removed or all_blocks_cleared)", e.Type)}
	}
	var group EventGroup
	if e.GroupIdx != nil {
		if *e.GroupIdx < 0 {
			return Event{}, group, &HTTPBatchError{"group_idx", "must not be negative"}
		}
		group.Index = *e.GroupIdx
	}
	if e.SpecKind != nil && ev.Kind == BlockStored {
		group.Kind = *e.SpecKind
	}
	if ev.Kind == AllBlocksCleared {
		return ev, group, nil
	}
	if len(e.BlockHashes) == 0 {
		return Event{}, EventGroup{}, &HTTPBatchError{"block_hashes", "required and non-empty"}
	}
	ev.EngineHashes = make([]uint64, len(e.BlockHashes))
	for i, h := range e.BlockHashes {
		ev.EngineHashes[i] = uint64(h)
	}
	if e.Medium != nil {
		t, err := TierFromMedium(*e.Medium)
		if err != nil {
			return Event{}, EventGroup{}, &HTTPBatchError{"medium", err.Error()}
		}
		ev.Tier = t
	}
	if ev.Kind == BlockRemoved {
		return ev, group, nil
	}
	if len(e.TokenIDs) == 0 && e.Parent == nil {
		// A copy (vLLM's CPU offloading announces one so): blocks stored
		// before, by these hashes, are now also in this medium.
		return ev, group, nil
	}
	if e.BlockSize <= 0 || e.BlockSize > 1<<20 {
		return Event{}, EventGroup{}, &HTTPBatchError{"block_size", fmt.Sprintf("%d out of range (1..1048576)", e.BlockSize)}
	}
	if len(e.TokenIDs) != len(e.BlockHashes)*e.BlockSize {
		return Event{}, EventGroup{}, &HTTPBatchError{"token_ids", fmt.Sprintf("%d tokens for %d blocks of %d", len(e.TokenIDs), len(e.BlockHashes), e.BlockSize)}
	}
	ev.BlockSize = e.BlockSize
	ev.Tokens = e.TokenIDs
	if e.Parent != nil {
		ev.HasParent, ev.EngineParent = true, uint64(*e.Parent)
	}
	if e.LoRAName != nil {
		ev.LoRAName = *e.LoRAName
	}
	return ev, group, nil
}

// strictUnmarshal decodes one JSON value and rejects trailing data.
func strictUnmarshal(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(v); err != nil {
		return err
	}
	if len(bytes.TrimSpace(b[dec.InputOffset():])) != 0 {
		return errors.New("trailing data after the JSON value")
	}
	return nil
}

// JSONKind names the JSON value a Go type is decoded from, for messages
// that speak JSON, not Go ("[]json.RawMessage").
func JSONKind(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Interface:
		return "a value"
	case reflect.Float32, reflect.Float64:
		return "a number"
	default:
		return "an integer"
	}
}

// jsonErr turns an encoding/json error into an HTTPBatchError naming the
// field where it can.
func jsonErr(prefix string, err error) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return &HTTPBatchError{joinPath(prefix, te.Field), fmt.Sprintf("want %s, not %s", JSONKind(te.Type), te.Value)}
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return &HTTPBatchError{prefix, fmt.Sprintf("bad JSON at byte %d: %v", se.Offset, err)}
	}
	return &HTTPBatchError{prefix, err.Error()}
}

func joinPath(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "." + b
}
