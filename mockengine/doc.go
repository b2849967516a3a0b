// Package mockengine is a simulated vLLM engine, good enough to test and
// benchmark KV-cache-aware routing honestly.
//
// It has two layers:
//
//   - Model: a deterministic engine core with no HTTP and no wall clock. It
//     keeps a block-based prefix cache of fixed capacity (LRU eviction of
//     unreferenced blocks), schedules with continuous batching and chunked
//     prefill, and says how long each step takes using Dynamo's mocker fit.
//     The fleet simulator drives it on a virtual clock.
//   - Engine: an OpenAI-compatible HTTP server around one Model, stepping it
//     in real time (step duration / Speedup), with vLLM's /metrics names and
//     a /debug/cache view of the resident blocks.
//
// The engine hashes blocks in its own namespace, deliberately different from
// the router's, because the router must never trust engine hashes (DESIGN.md
// §3): only /debug/cache reports router-scheme hashes, for comparisons.
//
// mockengine must not know about the router, the proxy or any transport of KV
// events; it imports only kv and tokenize.
package mockengine
