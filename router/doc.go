// Package router is kvproxy's routing brain: the prefix index (which worker
// holds which KV block, in which tier), per-worker load tracking of in-flight
// requests, the cost model, and the policies that turn both into a decision.
//
// It owns: worker identities (dense WorkerIDs and stable instance ids), the
// Index interface and its in-memory implementation, the zero-counters
// invariant of load tracking, and every routing policy (one file each, named
// in the policy table of policy.go).
//
// It must not know: HTTP, SSE, ZMQ, engine wire formats, configuration files
// or tokenizers. Callers hand it block hashes (package kv) and tell it what
// happened to a request (first token, output blocks, end). Engine KV events
// reach the index through the Index interface, applied by package backends.
//
// Load figures read by Select and Workers are advisory: counters are atomics
// read without a lock, so a snapshot may be torn. Only Commit and the Active
// methods change load; Select has no side effects.
package router
