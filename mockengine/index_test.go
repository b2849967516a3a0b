package mockengine

import (
	"math/rand/v2"
	"testing"

	"github.com/kvproxy/kvproxy/kv"
)

// blockIndex agrees with a Go map under random churn at full occupancy,
// with spread-out and with clustered keys.
func TestBlockIndexMatchesMap(t *testing.T) {
	for _, clustered := range []bool{false, true} {
		const max = 500
		ix := newBlockIndex(max)
		ref := map[kv.BlockHash]int32{}
		r := rand.New(rand.NewPCG(3, 4))
		key := func() kv.BlockHash {
			if clustered {
				return kv.BlockHash(r.IntN(2 * max))
			}
			return kv.BlockHash(r.Uint64())
		}
		var keys []kv.BlockHash
		for step := 0; step < 200000; step++ {
			if len(ref) < max && (len(keys) == 0 || r.IntN(2) == 0) {
				k, v := key(), int32(r.IntN(1000))
				_, had := ref[k]
				if ix.insert(k, v) == had {
					t.Fatalf("insert %x: present %v", k, had)
				}
				if !had {
					ref[k] = v
					keys = append(keys, k)
				}
			} else if len(keys) > 0 {
				i := r.IntN(len(keys))
				k := keys[i]
				keys[i] = keys[len(keys)-1]
				keys = keys[:len(keys)-1]
				ix.remove(k)
				delete(ref, k)
				ix.remove(k) // removing an absent key is a no-op
			}
			probe := key()
			v, ok := ix.get(probe)
			w, wok := ref[probe]
			if ok != wok || (ok && v != w) {
				t.Fatalf("step %d: get %x = %d %v, want %d %v", step, probe, v, ok, w, wok)
			}
		}
		if ix.len() != len(ref) {
			t.Fatalf("len %d want %d", ix.len(), len(ref))
		}
		n := 0
		ix.each(func(k kv.BlockHash, v int32) {
			if ref[k] != v {
				t.Fatalf("each: %x → %d, want %d", k, v, ref[k])
			}
			n++
		})
		if n != len(ref) {
			t.Fatalf("each visited %d of %d", n, len(ref))
		}
	}
}
