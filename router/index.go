package router

import (
	"time"

	"github.com/kvproxy/kvproxy/kv"
)

// AllTiers, passed to Index.Remove, removes a block from every tier.
const AllTiers = kv.NumTiers

// Index maps block hashes to the workers holding them, with the tier each
// (block, worker) entry lives in. Implementations are safe for concurrent use.
//
// Approximate mode stores the router's own decisions with a TTL; event mode
// (package backends) stores and removes from engine KV events with ttl 0,
// which never expires. A block may be held by one worker in several tiers at
// once; it matches while it is held in any tier, at the fastest one.
type Index interface {
	// Store records that worker w holds hashes in tier. ttl 0 means no expiry;
	// a positive ttl (re)arms the entry's expiry unless it is already
	// unbounded. Storing an entry marks it most recently used.
	Store(w WorkerID, hashes []kv.BlockHash, tier kv.Tier, ttl time.Duration)
	// Remove drops hashes from w's tier (AllTiers: from every tier). Unknown
	// hashes are ignored.
	Remove(w WorkerID, hashes []kv.BlockHash, tier kv.Tier)
	// ClearWorker drops every entry of w (engine restart, worker removed).
	ClearWorker(w WorkerID)
	// Match appends to dst[:0] one Overlap per worker holding at least
	// hashes[0], with the depth of the leading prefix of hashes it holds, and
	// returns it. Expired entries do not match. Order of the result is
	// unspecified.
	Match(hashes []kv.BlockHash, dst []Overlap) []Overlap
	// Len is the number of resident (block, worker) entries, including
	// expired entries not yet swept.
	Len() int
	// WorkerBlocks is the number of resident entries of w.
	WorkerBlocks(w WorkerID) int
}

// Overlap is one worker's leading-prefix match for a request.
type Overlap struct {
	Worker WorkerID
	// Depth is the number of leading blocks of the request w holds.
	Depth int32
	// Tiers counts, among those Depth blocks, how many are held at best in
	// each tier (Tiers[kv.TierDevice] blocks are usable at once; the others
	// cost a fetch).
	Tiers [kv.NumTiers]int32
}
