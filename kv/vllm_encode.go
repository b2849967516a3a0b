package kv

import (
	"encoding/binary"
	"math"
)

// VLLMEncoding selects how AppendVLLMBatch lays out a batch.
type VLLMEncoding uint8

const (
	// VLLMArrays is msgspec's array_like=True layout (older vLLM):
	// [ts, [["BlockStored", ...], ...], dp_rank].
	VLLMArrays VLLMEncoding = iota
	// VLLMMaps is the newer layout: {"ts", "events", "data_parallel_rank"}
	// with each event a map carrying a "type" key.
	VLLMMaps
)

// AppendVLLMBatch appends to dst the msgpack encoding of a vLLM KVEventBatch
// exactly as vLLM's msgspec encoder lays it out (field order of
// vllm/distributed/kv_events.py). It is what a simulated engine publishes.
// Engine hashes are written as unsigned integers; a missing parent is nil; an
// event's medium is written from its Tier ("GPU", "CPU", "DISK", "SHARED");
// lora_id is always nil. extra_keys is written only to carry the cache_salt
// of a sequence's first blocks (as vLLM does); other fields msgspec omits by
// default (group_idx, ...) are omitted.
func AppendVLLMBatch(dst []byte, ts float64, events []Event, dpRank int, enc VLLMEncoding) []byte {
	if enc == VLLMMaps {
		dst = mpMapLen(dst, 3)
		dst = mpStr(dst, "ts")
		dst = mpFloat(dst, ts)
		dst = mpStr(dst, "events")
	} else {
		dst = mpArrayLen(dst, 3)
		dst = mpFloat(dst, ts)
	}
	dst = mpArrayLen(dst, len(events))
	for i := range events {
		dst = appendVLLMEvent(dst, &events[i], enc)
	}
	if enc == VLLMMaps {
		dst = mpStr(dst, "data_parallel_rank")
	}
	return mpInt(dst, int64(dpRank))
}

// MediumOf is the vLLM medium string of a tier.
func MediumOf(t Tier) string {
	switch t {
	case TierHost:
		return "CPU"
	case TierDisk:
		return "DISK"
	case TierShared:
		return "SHARED"
	}
	return "GPU"
}

func appendVLLMEvent(dst []byte, ev *Event, enc VLLMEncoding) []byte {
	maps := enc == VLLMMaps
	key := func(dst []byte, k string) []byte {
		if maps {
			return mpStr(dst, k)
		}
		return dst
	}
	switch ev.Kind {
	case BlockStored:
		fields := 8
		salted := ev.CacheSalt != "" && !ev.HasParent && len(ev.EngineHashes) > 0
		if salted {
			fields = 9 // + extra_keys
		}
		if maps {
			dst = mpMapLen(dst, fields)
			dst = mpStr(dst, "type")
		} else {
			dst = mpArrayLen(dst, fields)
		}
		dst = mpStr(dst, "BlockStored")
		dst = key(dst, "block_hashes")
		dst = mpHashes(dst, ev.EngineHashes)
		dst = key(dst, "parent_block_hash")
		if ev.HasParent {
			dst = mpUint(dst, ev.EngineParent)
		} else {
			dst = mpNil(dst)
		}
		dst = key(dst, "token_ids")
		dst = mpArrayLen(dst, len(ev.Tokens))
		for _, t := range ev.Tokens {
			dst = mpUint(dst, uint64(t))
		}
		dst = key(dst, "block_size")
		dst = mpInt(dst, int64(ev.BlockSize))
		dst = key(dst, "lora_id")
		dst = mpNil(dst)
		dst = key(dst, "medium")
		dst = mpStr(dst, MediumOf(ev.Tier))
		dst = key(dst, "lora_name")
		if ev.LoRAName == "" {
			dst = mpNil(dst)
		} else {
			dst = mpStr(dst, ev.LoRAName)
		}
		if !salted {
			return dst
		}
		// extra_keys: one entry per block; block 0's tuple holds the salt.
		dst = key(dst, "extra_keys")
		dst = mpArrayLen(dst, len(ev.EngineHashes))
		dst = mpArrayLen(dst, 1)
		dst = mpStr(dst, ev.CacheSalt)
		for range len(ev.EngineHashes) - 1 {
			dst = mpNil(dst)
		}
		return dst
	case BlockRemoved:
		if maps {
			dst = mpMapLen(dst, 3)
			dst = mpStr(dst, "type")
		} else {
			dst = mpArrayLen(dst, 3)
		}
		dst = mpStr(dst, "BlockRemoved")
		dst = key(dst, "block_hashes")
		dst = mpHashes(dst, ev.EngineHashes)
		dst = key(dst, "medium")
		return mpStr(dst, MediumOf(ev.Tier))
	default:
		if maps {
			dst = mpMapLen(dst, 1)
			dst = mpStr(dst, "type")
		} else {
			dst = mpArrayLen(dst, 1)
		}
		return mpStr(dst, "AllBlocksCleared")
	}
}

func mpHashes(dst []byte, hs []uint64) []byte {
	dst = mpArrayLen(dst, len(hs))
	for _, h := range hs {
		dst = mpUint(dst, h)
	}
	return dst
}

func mpNil(dst []byte) []byte { return append(dst, 0xc0) }

func mpArrayLen(dst []byte, n int) []byte {
	switch {
	case n < 16:
		return append(dst, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(dst, 0xdd), uint32(n))
}

func mpMapLen(dst []byte, n int) []byte {
	switch {
	case n < 16:
		return append(dst, 0x80|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(dst, 0xdf), uint32(n))
}

func mpStr(dst []byte, s string) []byte {
	n := len(s)
	switch {
	case n < 32:
		dst = append(dst, 0xa0|byte(n))
	case n <= math.MaxUint8:
		dst = append(dst, 0xd9, byte(n))
	case n <= math.MaxUint16:
		dst = binary.BigEndian.AppendUint16(append(dst, 0xda), uint16(n))
	default:
		dst = binary.BigEndian.AppendUint32(append(dst, 0xdb), uint32(n))
	}
	return append(dst, s...)
}

// mpUint writes v in the smallest unsigned form, as msgspec does.
func mpUint(dst []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(dst, byte(v))
	case v <= math.MaxUint8:
		return append(dst, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(dst, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(dst, 0xcf), v)
}

func mpInt(dst []byte, v int64) []byte {
	if v >= 0 {
		return mpUint(dst, uint64(v))
	}
	switch {
	case v >= -32:
		return append(dst, byte(v))
	case v >= math.MinInt8:
		return append(dst, 0xd0, byte(v))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(dst, 0xd1), uint16(v))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(dst, 0xd2), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(dst, 0xd3), uint64(v))
}

func mpFloat(dst []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(dst, 0xcb), math.Float64bits(f))
}
