// Package kv is kvproxy's shared vocabulary: block hashing of token sequences,
// the BlockHash key of the prefix index, storage tiers, and cache events.
//
// It knows nothing of HTTP, routing or tokenizers. It imports the standard
// library, xxh3, and msgpack for the one engine wire format it decodes
// (vLLM's KV event batches, vllm_decode.go); sockets live in backends.
package kv
