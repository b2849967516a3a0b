package proxy

import (
	"testing"
	"time"
)

func TestRetryBudget(t *testing.T) {
	b := newRetryBudget(0.5)
	t0 := time.Now().Add(time.Hour) // withdraw's clock reading adds no reserve
	b.last, b.balance = t0, 0
	// Arrival times interleave across requests: an earlier one adds its
	// share and no (negative) reserve.
	b.deposit(t0.Add(-time.Second))
	if b.balance != 0.5 || !b.last.Equal(t0) {
		t.Fatalf("balance %v, last moved to %v", b.balance, b.last)
	}
	b.deposit(t0.Add(time.Second)) // one second of reserve, and a share
	if want := 0.5 + retryReservePerSec + 0.5; b.balance != want {
		t.Fatalf("balance %v, want %v", b.balance, want)
	}
	n := 0
	for b.withdraw() {
		n++
	}
	if n != 4 {
		t.Fatalf("%d retries from a balance of 4", n)
	}
	for i := 0; i < 1000; i++ {
		b.deposit(b.last)
	}
	if b.balance != retryBalanceMax {
		t.Fatalf("balance %v above the cap", b.balance)
	}
}

// retry_budget 0 allows no retry at all: README says so, and the reserve
// let a quiet proxy retry anyway (the twenty-sixth session's docs review).
func TestRetryBudgetZeroAllowsNone(t *testing.T) {
	b := newRetryBudget(0)
	b.deposit(time.Now().Add(time.Minute))
	if b.withdraw() {
		t.Fatalf("a retry allowed with a budget of 0 (balance %v)", b.balance)
	}
}
