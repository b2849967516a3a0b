package proxy

import (
	"sync"
	"time"
)

// retryBudget limits retries to a share of traffic (Finagle's design): every
// request deposits ratio, every retry withdraws 1, and a small reserve per
// second lets a quiet proxy still retry. A ratio of 0 allows no retries,
// reserve included.
type retryBudget struct {
	mu      sync.Mutex
	ratio   float64
	balance float64
	last    time.Time
}

const (
	retryReservePerSec = 3.0
	retryBalanceMax    = 100.0
	retryInitial       = 10.0
)

func newRetryBudget(ratio float64) *retryBudget {
	b := &retryBudget{ratio: ratio, last: time.Now()}
	if ratio > 0 {
		b.balance = retryInitial
	}
	return b
}

func (b *retryBudget) refill(now time.Time) {
	if !now.After(b.last) || b.ratio == 0 {
		return // requests deposit with their arrival times, which interleave
	}
	b.balance += now.Sub(b.last).Seconds() * retryReservePerSec
	if b.balance > retryBalanceMax {
		b.balance = retryBalanceMax
	}
	b.last = now
}

// deposit credits one request that arrived at now.
func (b *retryBudget) deposit(now time.Time) {
	b.mu.Lock()
	b.refill(now)
	b.balance += b.ratio
	if b.balance > retryBalanceMax {
		b.balance = retryBalanceMax
	}
	b.mu.Unlock()
}

func (b *retryBudget) withdraw() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(time.Now())
	if b.balance >= 1 {
		b.balance--
		return true
	}
	return false
}

// refund gives back a retry withdrawn for an attempt that found no engine
// to try.
func (b *retryBudget) refund() {
	b.mu.Lock()
	b.balance = min(b.balance+1, retryBalanceMax)
	b.mu.Unlock()
}
