package kv

import (
	"encoding/binary"
	"testing"

	"github.com/zeebo/xxh3"
)

func seqTokens(n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(i*7 + 3)
	}
	return t
}

// The contract from DESIGN.md §3, computed the long way.
func TestHashBlocksMatchesContract(t *testing.T) {
	tokens := seqTokens(50)
	got := HashBlocks(nil, tokens, 16, 0)
	if len(got) != 3 {
		t.Fatalf("want 3 full blocks of 16 from 50 tokens, got %d", len(got))
	}
	var want []BlockHash
	for i := 0; i < 3; i++ {
		b := make([]byte, 64)
		for j := 0; j < 16; j++ {
			binary.LittleEndian.PutUint32(b[j*4:], tokens[i*16+j])
		}
		local := xxh3.HashSeed(b, 1337)
		if i == 0 {
			want = append(want, BlockHash(local))
			continue
		}
		c := make([]byte, 16)
		binary.LittleEndian.PutUint64(c, uint64(want[i-1]))
		binary.LittleEndian.PutUint64(c[8:], local)
		want = append(want, BlockHash(xxh3.HashSeed(c, 1337)))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("block %d: got %x want %x", i, got[i], want[i])
		}
	}
	if LocalHash(tokens[:16]) != uint64(want[0]) {
		t.Fatal("LocalHash of block 0 must equal sequence hash 0")
	}
}

// A fixed vector guards against accidental changes to the byte layout.
func TestHashVector(t *testing.T) {
	tokens := []uint32{1, 2, 3, 4}
	got := HashBlocks(nil, tokens, 4, 0)
	want := BlockHash(xxh3.HashSeed([]byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0}, 1337))
	if len(got) != 1 || got[0] != want {
		t.Fatalf("got %v want %x", got, want)
	}
}

func TestPartialBlockNeverHashed(t *testing.T) {
	if n := len(HashBlocks(nil, seqTokens(15), 16, 0)); n != 0 {
		t.Fatalf("15 tokens at block size 16 gave %d hashes", n)
	}
	if n := len(HashBlocks(nil, seqTokens(32), 16, 0)); n != 2 {
		t.Fatalf("32 tokens gave %d hashes", n)
	}
}

func TestSharedPrefixSharesHashes(t *testing.T) {
	a := seqTokens(64)
	b := append(append([]uint32(nil), a[:40]...), 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87, 86, 85, 84, 83, 82, 81, 80, 79, 78, 77, 76)
	ha := HashBlocks(nil, a, 16, 0)
	hb := HashBlocks(nil, b, 16, 0)
	if ha[0] != hb[0] || ha[1] != hb[1] {
		t.Fatal("first two blocks are equal and must hash equal")
	}
	if ha[2] == hb[2] {
		t.Fatal("third block differs and must hash differently")
	}
	// Chaining: the same block after a different prefix hashes differently.
	c := append(append([]uint32(nil), b[:16]...), a[16:32]...)
	c[0]++
	hc := HashBlocks(nil, c, 16, 0)
	if hc[1] == ha[1] {
		t.Fatal("equal block after a different prefix must hash differently")
	}
}

func TestNamespaceSeedsBlockZero(t *testing.T) {
	tok := seqTokens(48)
	plain := HashBlocks(nil, tok, 16, 0)
	if NewNamespace("") != 0 || NewNamespace() != 0 {
		t.Fatal("empty namespace must be the default")
	}
	a := HashBlocks(nil, tok, 16, NewNamespace("tenant-a"))
	b := HashBlocks(nil, tok, 16, NewNamespace("tenant-b"))
	a2 := HashBlocks(nil, tok, 16, NewNamespace("tenant-a"))
	for i := range plain {
		if a[i] == plain[i] || b[i] == plain[i] || a[i] == b[i] {
			t.Fatalf("block %d shared across namespaces", i)
		}
		if a[i] != a2[i] {
			t.Fatal("namespace hashing must be deterministic")
		}
	}
	if NewNamespace("x", "y") == NewNamespace("xy") {
		t.Fatal("parts must be separated")
	}
}

func TestContinueHashesMatchesWhole(t *testing.T) {
	tok := seqTokens(80)
	whole := HashBlocks(nil, tok, 16, NewNamespace("ns"))
	head := HashBlocks(nil, tok[:32], 16, NewNamespace("ns"))
	tail := ContinueHashes(nil, head[1], false, tok[32:], 16, NewNamespace("ns"))
	all := append(head, tail...)
	for i := range whole {
		if whole[i] != all[i] {
			t.Fatalf("block %d differs when hashed in two steps", i)
		}
	}
}

func TestTierFromMedium(t *testing.T) {
	for in, want := range map[string]Tier{"": TierDevice, "GPU": TierDevice, "cpu": TierHost, "DISK": TierDisk, "shared": TierShared} {
		got, err := TierFromMedium(in)
		if err != nil || got != want {
			t.Fatalf("%q: got %v %v", in, got, err)
		}
	}
	if _, err := TierFromMedium("floppy"); err == nil {
		t.Fatal("unknown medium must be an error")
	}
}

func BenchmarkHashBlocks8k(b *testing.B) {
	tok := seqTokens(8192)
	dst := make([]BlockHash, 0, 512)
	b.SetBytes(int64(len(tok) * 4))
	b.ReportAllocs()
	for b.Loop() {
		dst = HashBlocks(dst[:0], tok, 16, 0)
	}
}
