package main

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// cgroupMemoryLimit is the memory limit of the cgroup the process runs in
// (a container's), read from procCgroup (/proc/self/cgroup) and the
// cgroup filesystem at root (/sys/fs/cgroup): cgroup v2's memory.max or
// v1's memory.limit_in_bytes, the smallest of the process's cgroup and
// those above it (a limit set on a parent, a systemd slice or a pod,
// bounds the child). ok is false without a limit. Go's garbage collector
// does not know it: the heap may grow to twice what is live before a
// collection, and the kernel kills a process past its limit rather than
// tell it.
func cgroupMemoryLimit(procCgroup, root string) (limit int64, ok bool) {
	f, err := os.Open(procCgroup)
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// hierarchy-ID:controllers:path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		switch {
		case parts[0] == "0" && parts[1] == "": // v2
			limit, ok = smallestLimit(root, parts[2], "memory.max", limit, ok)
		case hasController(parts[1], "memory"): // v1
			limit, ok = smallestLimit(filepath.Join(root, "memory"), parts[2], "memory.limit_in_bytes", limit, ok)
		}
	}
	return limit, ok
}

// smallestLimit reads file in the cgroup at path under root and in each
// one above it, and returns the smallest limit of those and limit (when
// ok). A cgroup namespace shows the container's own cgroup as the root.
func smallestLimit(root, path, file string, limit int64, ok bool) (int64, bool) {
	for dir := filepath.Join("/", path); ; dir = filepath.Dir(dir) {
		if n, has := readLimit(filepath.Join(root, dir, file)); has && (!ok || n < limit) {
			limit, ok = n, true
		}
		if dir == "/" {
			return limit, ok
		}
	}
}

// readLimit reads a cgroup memory limit file: "max" (v2) or a page-rounded
// 2^63-1 (v1) is none.
func readLimit(name string) (int64, bool) {
	b, err := os.ReadFile(name)
	if err != nil {
		return 0, false
	}
	n, err := strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
	if err != nil || n <= 0 || n >= 1<<62 {
		return 0, false
	}
	return n, true
}

func hasController(list, name string) bool {
	for c := range strings.SplitSeq(list, ",") {
		if c == name {
			return true
		}
	}
	return false
}

// memoryLimitShare is the part of a cgroup's limit kvproxy sets as Go's
// soft memory limit: the rest is for what Go does not count (thread
// stacks outside the heap, the kernel's socket buffers charged to the
// cgroup).
const memoryLimitShare = 0.9
