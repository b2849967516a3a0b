package backends

import (
	"strings"
	"sync"
	"testing"

	"github.com/kvproxy/kvproxy/kv"
)

// problems records what a feed's OnChange hears.
type problems struct {
	mu   sync.Mutex
	list []string
}

func (p *problems) add(s string) {
	p.mu.Lock()
	p.list = append(p.list, s)
	p.mu.Unlock()
}

func (p *problems) get() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.list...)
}

// Blocks dropped because the engine's block size does not fit the router's
// were only counted, in a counter /admin/backends did not show: the feed
// now warns once, naming both sizes.
func TestKVFeedWarnsOfBlockSizeMismatchOnce(t *testing.T) {
	var heard problems
	feed, err := StartKVFeed(KVFeedConfig{Backend: "b", Mode: FeedHTTP, ZMQ: ZMQConfig{OnChange: heard.add}}, newRouter(t))
	if err != nil {
		t.Fatal(err)
	}
	defer feed.Close()
	toks := tokens(64, 0)
	big := kv.Event{Kind: kv.BlockStored, EngineHashes: []uint64{1, 2}, Tokens: toks, BlockSize: 32}
	feed.Push(kv.HTTPBatch{Events: []kv.Event{big}})
	feed.Push(kv.HTTPBatch{Events: []kv.Event{big, big}})
	if s := feed.Stats().Apply; s.BlockSizeMismatch != 6 {
		t.Fatalf("stats %+v", s)
	}
	got := heard.get()
	if len(got) != 1 || !strings.HasPrefix(got[0], "block size mismatch: ") ||
		!strings.Contains(got[0], "blocks of 32 tokens are larger than the configured block_size 16") {
		t.Fatalf("heard %q", got)
	}

	// Engine blocks that do not divide the router's: off the block grid.
	var heard12 problems
	a := NewKVApplier(KVApplierConfig{Backend: "sg", OnProblem: heard12.add}, newRouter(t))
	a.ApplyEvents(0, pages(toks[:48], 12, 1000, nil))
	got = heard12.get()
	if s := a.Stats(); s.BlockSizeMismatch != 1 || len(got) != 1 ||
		!strings.Contains(got[0], "blocks of 12 tokens do not divide the configured block_size 16") {
		t.Fatalf("stats %+v, heard %q", s, got)
	}
}
