package kv

// EventKind tells what a cache Event reports.
type EventKind uint8

const (
	BlockStored EventKind = iota + 1
	BlockRemoved
	AllBlocksCleared
)

// Event is one engine cache change, decoded from whatever transport carried
// it. Engine hashes are opaque: they are only used to find the router's own
// hashes again on removal. Token ids let the router recompute its own hashes.
//
// A BlockStored without Tokens (BlockSize 0, no parent) is a copy: blocks
// the engine announced before, by the same engine hashes, are now also held
// in Tier (vLLM's CPU offloading reports its copies so).
type Event struct {
	Kind EventKind
	// EngineHashes are the engine's own block hashes, one per block.
	EngineHashes []uint64
	// HasParent is set when EngineParent names the block before the first one.
	HasParent    bool
	EngineParent uint64
	// Tokens of the stored blocks, len = len(EngineHashes) * BlockSize.
	Tokens    []uint32
	BlockSize int
	Tier      Tier
	LoRAName  string
	// CacheSalt is the cache_salt of a BlockStored that starts a sequence
	// (no parent): vLLM folds it into block 0 and reports it in extra_keys.
	// Encoding only; decoders report it through VLLMDecoder.CacheSalt.
	CacheSalt string
}
