//go:build !unix

package mockengine

import "time"

func cpuTime() time.Duration { return -1 }
