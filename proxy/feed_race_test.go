package proxy

import (
	"sync"
	"testing"
)

// A reload sets a rebuilt backend's event feed after the backend owns the
// slot count (shareSlots), while requests its predecessor took release
// slots and read the feed for the backend's workers: the write is under the
// backend's lock, as those reads are. The race detector (CI runs it) found
// the unguarded write in the reload chaos trial.
func TestFeedSetWhileSlotsAreReleased(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m, max_concurrency: 1, kv_events: {mode: http}}]\n", e)
	b := p.s.st.Load().backends["e0"]
	started := b.feed
	b.setFeed(nil) // as a backend a reload has just built
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for range 2000 {
			if b.acquire() { // full: markFull reads the workers
				b.release()
			}
		}
	}()
	go func() {
		defer wg.Done()
		b.startEvents()
	}()
	wg.Wait()
	if b.feed == nil {
		t.Fatal("no feed started")
	}
	started.Close()
}
