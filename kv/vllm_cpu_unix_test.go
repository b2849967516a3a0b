//go:build unix

package kv

import (
	"syscall"
	"time"
)

// cpuTime is the user+system CPU time consumed by the process: on a loaded
// machine it measures a benchmark's cost better than wall time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
