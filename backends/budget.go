package backends

import (
	"errors"
	"io"
	"math"
	"sync/atomic"

	"github.com/valyala/fasthttp"
)

// Budget bounds the memory kvproxy holds at once in large bodies read
// whole: engine answers (DoWhole) and client request bodies. Each one up
// to Untracked bytes is free, so ordinary traffic never meets the budget;
// a larger one takes its whole size before it is read (or as it grows,
// when its length is not declared) and gives it back when it is let go.
// A body that does not fit fails at once with ErrOverBudget: none waits
// for another's memory, so none holds part of the budget while it waits.
// A nil Budget bounds nothing. Safe for concurrent use.
type Budget struct {
	limit   atomic.Int64
	used    atomic.Int64
	refused atomic.Int64
}

// Untracked is the size up to which a body is not counted.
const Untracked = 1 << 20

// ErrOverBudget: the body would take kvproxy past its Budget, held by
// other bodies; it may fit later.
var ErrOverBudget = errors.New("kvproxy holds its limit of memory in large bodies")

// ErrBeyondBudget: the body is larger than the whole Budget, and never
// fits.
var ErrBeyondBudget = errors.New("the body is larger than kvproxy's limit of memory for large bodies")

// NewBudget is a Budget of limit bytes.
func NewBudget(limit int64) *Budget {
	b := &Budget{}
	b.limit.Store(limit)
	return b
}

// SetLimit changes the limit; what bodies hold already stays held.
func (b *Budget) SetLimit(limit int64) { b.limit.Store(limit) }

// Reserve is Take for a body that needs n more bytes to reach size bytes
// held in all: ErrBeyondBudget when size is over the whole limit,
// ErrOverBudget when other bodies hold the room.
func (b *Budget) Reserve(n, size int64) error {
	switch {
	case size > b.Limit():
		return ErrBeyondBudget
	case !b.Take(n):
		return ErrOverBudget
	}
	return nil
}

// Take reserves n bytes, or reports false and reserves nothing.
func (b *Budget) Take(n int64) bool {
	if b == nil || n <= 0 {
		return true
	}
	for {
		used := b.used.Load()
		if used+n > b.limit.Load() {
			b.refused.Add(1)
			return false
		}
		if b.used.CompareAndSwap(used, used+n) {
			return true
		}
	}
}

// Give returns n bytes that Take reserved.
func (b *Budget) Give(n int64) {
	if b != nil && n > 0 {
		b.used.Add(-n)
	}
}

// Limit is the budget's size in bytes.
func (b *Budget) Limit() int64 {
	if b == nil {
		return math.MaxInt64
	}
	return b.limit.Load()
}

// Used is how many bytes bodies hold now.
func (b *Budget) Used() int64 {
	if b == nil {
		return 0
	}
	return b.used.Load()
}

// Refused counts the bodies refused for want of room.
func (b *Budget) Refused() int64 {
	if b == nil {
		return 0
	}
	return b.refused.Load()
}

// ReadGrowing reads r to its end into buf (appending), at most limit
// bytes (fasthttp.ErrBodyTooLarge past them), taking from b as the buffer
// grows past Untracked; *held is what it took, which stays taken on error
// too (the caller gives it back with the body), and own what the body's
// request holds besides. The buffer doubles, so a body takes at most
// twice its size, or the whole budget.
func (b *Budget) ReadGrowing(r io.Reader, buf []byte, limit int, own int64, held *int64) ([]byte, error) {
	for {
		if len(buf) == cap(buf) {
			if len(buf) > limit {
				return buf, fasthttp.ErrBodyTooLarge
			}
			size := b.Grown(len(buf), min(limit+1, max(2*cap(buf), 4<<10)), own)
			if size > Untracked {
				if err := b.Reserve(int64(size)-*held, own+int64(size)); err != nil {
					return buf, err
				}
				*held = int64(size)
			}
			nb := make([]byte, len(buf), size)
			copy(nb, buf)
			buf = nb
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			if len(buf) > limit {
				return buf, fasthttp.ErrBodyTooLarge
			}
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
}

// Grown is the size a buffer of n bytes grows to, size or less: a body
// cannot hold more than the whole budget less own (what its request holds
// besides), so doubling stops there (a body of 2.5 MiB grew from 2 to 4
// MiB, over a budget of 3).
func (b *Budget) Grown(n, size int, own int64) int {
	if lim := b.Limit() - own; int64(size) > lim && lim > int64(n) {
		return int(lim)
	}
	return size
}
