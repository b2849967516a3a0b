//go:build unix

package proxy

import "syscall"

// openFilesLimit is the process's soft RLIMIT_NOFILE (Go raises it to the
// hard limit at start); 0 when it cannot be read.
func openFilesLimit() uint64 {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 0
	}
	return uint64(rl.Cur)
}
