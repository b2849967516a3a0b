//go:build !unix

package kv

import "time"

// cpuTime is unavailable here; the CPU-time metric is then meaningless.
func cpuTime() time.Duration { return 0 }
