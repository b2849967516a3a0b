//go:build !linux

package proxy

func processCPU() int64 { return -1 }
