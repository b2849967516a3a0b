package router

import (
	"runtime"
	"syscall"
	"testing"
	"unsafe"
)

// threadCPU is the calling thread's CPU time in ns (CLOCK_THREAD_CPUTIME_ID).
func threadCPU() int64 {
	var ts syscall.Timespec
	syscall.Syscall(syscall.SYS_CLOCK_GETTIME, 3, uintptr(unsafe.Pointer(&ts)), 0)
	return ts.Nano()
}

// cpuTimer reports "cpu-ns/op", the benchmark goroutine's own CPU time per
// op, which stays meaningful on a loaded machine where ns/op does not.
type cpuTimer struct {
	b     *testing.B
	start int64
}

func startCPU(b *testing.B) *cpuTimer {
	runtime.LockOSThread()
	b.ResetTimer()
	return &cpuTimer{b: b, start: threadCPU()}
}

func (c *cpuTimer) stop() {
	d := threadCPU() - c.start
	c.b.StopTimer()
	runtime.UnlockOSThread()
	c.b.ReportMetric(float64(d)/float64(c.b.N), "cpu-ns/op")
}
