package router

import (
	"math"
	"testing"
)

// TestHugeRemoteLoadDoesNotWrap: a remote load near the int64 limit (a
// buggy or hostile replica) added to this router's own must not wrap
// negative and make the busiest worker look idle.
func TestHugeRemoteLoadDoesNotWrap(t *testing.T) {
	huge := Load{Inflight: math.MaxInt64, Pending: math.MaxInt64, PrefillTokens: math.MaxInt64, ActiveBlocks: math.MaxInt64}
	for _, policy := range []string{"kv", "least_load", "kv_dynamo", "cache_aware", "prefix_hash"} {
		r := newTestRouter(t, policy, 2, nil)
		req := &Request{Hashes: seq(20, 5), PromptTokens: 320}
		d, a, err := r.Route(req) // one request of this router's own on the worker
		if err != nil {
			t.Fatal(err)
		}
		busy := d.Worker
		r.SetRemoteLoad(busy, huge)
		for i := 0; i < 4; i++ {
			if d2, _ := r.Select(&Request{Hashes: seq(20, uint64(10+i)), PromptTokens: 320}); d2.Worker == busy {
				t.Fatalf("%s: chose worker %d, which holds the largest load", policy, busy)
			}
		}
		if st := r.Workers()[busy]; st.Remote.Inflight <= 0 || st.Remote.Inflight > MaxRemoteLoad {
			t.Fatalf("%s: remote %+v", policy, st.Remote)
		}
		a.Free()
	}
}
