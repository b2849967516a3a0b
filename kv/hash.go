package kv

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// HashSeed is the xxh3 seed of every block hash, identical to Dynamo's
// LocalBlockHash.
const HashSeed = 1337

// DefaultBlockSize matches vLLM's default KV block size.
const DefaultBlockSize = 16

// BlockHash is a sequence hash: the hash of a block chained with every block
// before it, so equal hashes mean equal prefixes. The prefix index is keyed by it.
type BlockHash uint64

// Namespace seeds block 0 of a sequence, so that two namespaces (tenants,
// LoRA adapters) never share a prefix. The zero Namespace is the default
// seed (no namespace).
type Namespace uint64

// NewNamespace derives the block-0 seed for a namespace name (tenant cache
// namespace, LoRA adapter name). Parts are joined with a separator byte that
// cannot occur in UTF-8 text. The empty name is the default namespace.
func NewNamespace(parts ...string) Namespace {
	n := 0
	for _, p := range parts {
		if p != "" {
			n++
		}
	}
	if n == 0 {
		return 0
	}
	var buf []byte
	for _, p := range parts {
		if p == "" {
			continue
		}
		buf = append(buf, p...)
		buf = append(buf, 0xff)
	}
	s := xxh3.HashSeed(buf, HashSeed)
	if s == HashSeed || s == 0 {
		s++ // never collide with the default seed
	}
	return Namespace(s)
}

// RequestNamespace is the namespace of a request's blocks, and of the
// blocks an engine stores for it: its cache salt and the LoRA adapter it
// runs with ("" for the base model). An engine never reuses one adapter's
// blocks for another or for the base model, and a salt cannot pose as an
// adapter: the adapter's part starts with a byte no JSON string holds.
func RequestNamespace(salt, lora string) Namespace {
	if lora == "" {
		return NewNamespace(salt)
	}
	return NewNamespace(salt, "\xfe"+lora)
}

func (ns Namespace) seed() uint64 {
	if ns == 0 {
		return HashSeed
	}
	return uint64(ns)
}

// LocalHash hashes one block of tokens on its own: xxh3-64 with seed 1337 over
// the tokens as little-endian u32.
func LocalHash(tokens []uint32) uint64 {
	return localHash(tokens, HashSeed)
}

func localHash(tokens []uint32, seed uint64) uint64 {
	return xxh3.HashSeed(tokenBytes(tokens), seed)
}

// ChainHash combines the previous sequence hash with a block's local hash:
// xxh3(le64(parent) ‖ le64(local), 1337).
func ChainHash(parent BlockHash, local uint64) BlockHash {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[0:], uint64(parent))
	binary.LittleEndian.PutUint64(b[8:], local)
	return BlockHash(xxh3.HashSeed(b[:], HashSeed))
}

// HashBlocks appends to dst the sequence hashes of every full block of tokens.
// A trailing partial block is never hashed. Block 0 is seeded by ns.
func HashBlocks(dst []BlockHash, tokens []uint32, blockSize int, ns Namespace) []BlockHash {
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	n := len(tokens) / blockSize
	if n == 0 {
		return dst
	}
	var prev BlockHash
	for i := 0; i < n; i++ {
		buf := tokenBytes(tokens[i*blockSize : (i+1)*blockSize])
		if i == 0 {
			prev = BlockHash(xxh3.HashSeed(buf, ns.seed()))
		} else {
			prev = ChainHash(prev, xxh3.HashSeed(buf, HashSeed))
		}
		dst = append(dst, prev)
	}
	return dst
}

// ContinueHashes hashes the full blocks of tokens that follow a sequence whose
// last sequence hash is parent (the zero parent with start==true means block 0
// of a new sequence). It is how KV events are re-hashed block by block. A
// non-positive blockSize means DefaultBlockSize, as for HashBlocks.
func ContinueHashes(dst []BlockHash, parent BlockHash, first bool, tokens []uint32, blockSize int, ns Namespace) []BlockHash {
	if first {
		return HashBlocks(dst, tokens, blockSize, ns)
	}
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	n := len(tokens) / blockSize
	prev := parent
	for i := 0; i < n; i++ {
		prev = ChainHash(prev, localHash(tokens[i*blockSize:(i+1)*blockSize], HashSeed))
		dst = append(dst, prev)
	}
	return dst
}
