package kv

import "testing"

// ContinueHashes takes a non-positive block size as HashBlocks does (the
// default), whether or not the blocks start a sequence; it divided by zero
// when they did not.
func TestContinueHashesDefaultBlockSize(t *testing.T) {
	tokens := make([]uint32, 3*DefaultBlockSize)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	full := HashBlocks(nil, tokens, DefaultBlockSize, 0)
	for _, bs := range []int{0, -1} {
		got := ContinueHashes(nil, full[0], false, tokens[DefaultBlockSize:], bs, 0)
		if len(got) != 2 || got[0] != full[1] || got[1] != full[2] {
			t.Fatalf("block size %d: %v, want %v", bs, got, full[1:])
		}
	}
}
