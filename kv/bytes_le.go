//go:build 386 || amd64 || arm || arm64 || loong64 || mipsle || mips64le || ppc64le || riscv64 || wasm

package kv

import "unsafe"

// tokenBytes views tokens as their little-endian u32 bytes without copying;
// on little-endian machines that is already their memory layout.
func tokenBytes(tokens []uint32) []byte {
	if len(tokens) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), len(tokens)*4)
}
