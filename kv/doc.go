// Package kv is kvproxy's shared vocabulary: block hashing of token sequences,
// the BlockHash key of the prefix index, storage tiers, and cache events.
//
// It knows nothing of HTTP, engines, routing or tokenizers, and imports only
// the standard library and xxh3.
package kv
