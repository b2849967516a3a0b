//go:build !linux

package router

import "testing"

// cpuTimer falls back to wall time where thread CPU time is not wired up.
type cpuTimer struct{ b *testing.B }

func startCPU(b *testing.B) *cpuTimer { b.ResetTimer(); return &cpuTimer{b} }

func (c *cpuTimer) stop() { c.b.StopTimer() }
