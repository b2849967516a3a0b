//go:build !(386 || amd64 || arm || arm64 || loong64 || mipsle || mips64le || ppc64le || riscv64 || wasm)

package kv

import "encoding/binary"

func tokenBytes(tokens []uint32) []byte {
	b := make([]byte, len(tokens)*4)
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[i*4:], t)
	}
	return b
}
