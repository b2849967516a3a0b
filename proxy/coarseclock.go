package proxy

import (
	"sync"
	"sync/atomic"
	"time"
)

// coarseNow is the monotonic time in ns (clockAt), at most coarseTick old.
// The relays note when an engine last sent (exchange.heard) on every read:
// a clock read there (about 50 ns) added a quarter to BenchmarkSSERelay,
// where this is an atomic load. One goroutine per process keeps it, from
// the first use. Monotonic: a step of the wall clock (NTP, a VM resumed)
// made every stream look silent, or none.
func coarseNow() int64 {
	coarse.once.Do(func() {
		coarse.now.Store(clockAt(time.Now()))
		go func() {
			for t := range time.Tick(coarseTick) {
				coarse.now.Store(clockAt(t))
			}
		}()
	})
	return coarse.now.Load()
}

// clockAt is t on coarseNow's clock: ns since an hour before the process
// started, so that 0 stays "never".
func clockAt(t time.Time) int64 { return int64(t.Sub(clockBase)) }

var clockBase = time.Now().Add(-time.Hour)

// coarseTick is coarseNow's resolution: well under the shortest time an
// engine's probe takes to find it silent (a probe timeout).
const coarseTick = 100 * time.Millisecond

var coarse struct {
	once sync.Once
	now  atomic.Int64
}
