package proxy

import (
	"sync"
	"sync/atomic"
	"time"
)

// coarseNow is the time in Unix ns, at most coarseTick old. The relays note
// when an engine last sent (exchange.heard) on every read: a clock read
// there (about 50 ns) added a quarter to BenchmarkSSERelay, where this is an
// atomic load. One goroutine per process keeps it, from the first use.
func coarseNow() int64 {
	coarse.once.Do(func() {
		coarse.now.Store(time.Now().UnixNano())
		go func() {
			for t := range time.Tick(coarseTick) {
				coarse.now.Store(t.UnixNano())
			}
		}()
	})
	return coarse.now.Load()
}

// coarseTick is coarseNow's resolution: well under the shortest time an
// engine's probe takes to find it silent (a probe timeout).
const coarseTick = 100 * time.Millisecond

var coarse struct {
	once sync.Once
	now  atomic.Int64
}
