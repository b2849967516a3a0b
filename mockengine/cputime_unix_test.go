//go:build unix

package mockengine

import (
	"syscall"
	"time"
)

// cpuTime is the CPU time (user + system) the process has used, so
// benchmarks can report a cost that does not depend on how busy the machine
// is.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return -1
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
