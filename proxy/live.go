package proxy

import (
	"sync"
	"sync/atomic"

	"github.com/kvproxy/kvproxy/backends"
)

// liveExchanges are the requests in flight towards engines. Shutdown waits
// for them; cut ends them when the drain deadline has passed.
type liveExchanges struct {
	wg  sync.WaitGroup
	mu  sync.Mutex
	set map[*exchange]struct{}
	cut atomic.Bool
	// cutCh is closed by cutAll: requests waiting for a slot are answered
	// then, not dispatched to an engine only to be cut there (under mu).
	cutCh chan struct{}
}

// add registers x; after cut, x is aborted at once.
func (l *liveExchanges) add(x *exchange) {
	x.live = true
	l.wg.Add(1)
	l.mu.Lock()
	x.cutB = x.b
	cut := l.cut.Load()
	if !cut {
		if l.set == nil {
			l.set = make(map[*exchange]struct{})
		}
		l.set[x] = struct{}{}
	}
	l.mu.Unlock()
	if cut {
		x.ab.Abort()
	}
}

// done unregisters x. Once is enough: a panicked handler's clean-up may
// come after the exchange's own.
func (l *liveExchanges) done(x *exchange) {
	if !x.live {
		return
	}
	x.live = false
	l.mu.Lock()
	delete(l.set, x)
	l.mu.Unlock()
	l.wg.Done()
}

// cutAll aborts every exchange's engine connection. The relays and the
// waiting requests see the abort, and isCut tells them to answer the
// client rather than treat it as a client hang-up.
func (l *liveExchanges) cutAll() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.cut.Swap(true) {
		close(l.cutChLocked())
	}
	for x := range l.set {
		x.ab.Abort()
	}
	return len(l.set)
}

func (l *liveExchanges) isCut() bool { return l.cut.Load() }

// cutSignal is closed once cutAll has run.
func (l *liveExchanges) cutSignal() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cutChLocked()
}

func (l *liveExchanges) cutChLocked() chan struct{} {
	if l.cutCh == nil {
		l.cutCh = make(chan struct{})
	}
	return l.cutCh
}

// cutSilent aborts the exchanges with the backend of id that have heard
// nothing from its engine since before since (clockAt), each told why.
// Another backend of the same host (another model, another API key) has a
// probe of its own.
func (l *liveExchanges) cutSilent(id string, since int64, why string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for x := range l.set {
		if x.cutB != nil && x.cutB.cfg.ID == id && x.heard.Load() < since {
			x.unresponsive.Store(&why)
			x.ab.Abort()
			n++
		}
	}
	return n
}

func (l *liveExchanges) wait() { l.wg.Wait() }

// move points x's cuts at its new engine b (nil: none yet) and abort ab,
// as its stream moves to another engine; a cut since has ab aborted at once.
func (l *liveExchanges) move(x *exchange, b *backend, ab *backends.Abort) {
	l.mu.Lock()
	x.ab, x.cutB = ab, b
	x.unresponsive.Store(nil) // a cut of the engine it leaves is over with
	cut := l.cut.Load()
	l.mu.Unlock()
	if cut {
		ab.Abort()
	}
}
