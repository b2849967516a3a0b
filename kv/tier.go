package kv

import (
	"fmt"
	"strings"
)

// Tier is where a cached block lives. Lower values are faster to use.
type Tier uint8

const (
	TierDevice Tier = iota // GPU memory: usable at once
	TierHost               // CPU memory of the engine's host
	TierDisk               // local disk of the engine's host
	TierShared             // a cache layer every worker of the pool can reach
	NumTiers
)

func (t Tier) String() string {
	switch t {
	case TierDevice:
		return "device"
	case TierHost:
		return "host"
	case TierDisk:
		return "disk"
	case TierShared:
		return "shared"
	}
	return fmt.Sprintf("tier(%d)", uint8(t))
}

// TierFromMedium maps an engine's medium string (vLLM: "GPU", "CPU", "DISK";
// absent means GPU) to a Tier.
func TierFromMedium(medium string) (Tier, error) {
	switch strings.ToUpper(medium) {
	case "", "GPU", "DEVICE", "CUDA", "HBM":
		return TierDevice, nil
	case "CPU", "HOST", "CPU_PINNED", "DRAM":
		return TierHost, nil
	case "DISK", "SSD", "LOCAL_DISK", "NVME":
		return TierDisk, nil
	case "SHARED", "REMOTE", "LMCACHE":
		return TierShared, nil
	}
	return 0, fmt.Errorf("unknown medium %q (want GPU, CPU, DISK or SHARED)", medium)
}
