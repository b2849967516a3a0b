module github.com/kvproxy/kvproxy

go 1.26.8

require github.com/zeebo/xxh3 v1.1.0

require (
	github.com/klauspost/cpuid/v2 v2.2.10 // indirect
	golang.org/x/sys v0.48.0 // indirect
)
