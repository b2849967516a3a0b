package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestCgroupMemoryLimit(t *testing.T) {
	for name, c := range map[string]struct {
		proc  string
		files map[string]string // under the cgroup root
		want  int64             // 0: no limit
	}{
		"v2, the process's own cgroup": {"0::/kubepods/pod1/c1\n", map[string]string{
			"kubepods/pod1/c1/memory.max": "536870912\n", "memory.max": "max\n"}, 512 << 20},
		"v2, namespaced":            {"0::/\n", map[string]string{"memory.max": "1073741824\n"}, 1 << 30},
		"v2, only the root's":       {"0::/a/b\n", map[string]string{"memory.max": "1073741824\n"}, 1 << 30},
		"v2, a parent's, smaller":   {"0::/a/b/c\n", map[string]string{"a/b/c/memory.max": "max\n", "a/b/memory.max": "268435456\n", "a/memory.max": "536870912\n"}, 256 << 20},
		"v2, the child's, smaller":  {"0::/init\n", map[string]string{"init/memory.max": "134217728\n", "memory.max": "536870912\n"}, 128 << 20},
		"v2, no limit":              {"0::/\n", map[string]string{"memory.max": "max\n"}, 0},
		"v1, memory alone":          {"4:memory:/docker/abc\n3:cpu,cpuacct:/x\n", map[string]string{"memory/docker/abc/memory.limit_in_bytes": "268435456\n"}, 256 << 20},
		"v1, controllers together":  {"5:cpuacct,memory:/\n", map[string]string{"memory/memory.limit_in_bytes": "1048576000"}, 1048576000},
		"v1, no limit":              {"4:memory:/\n", map[string]string{"memory/memory.limit_in_bytes": "9223372036854771712\n"}, 0},
		"v1, a parent's":            {"4:memory:/docker/abc\n", map[string]string{"memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n", "memory/docker/memory.limit_in_bytes": "268435456\n"}, 256 << 20},
		"no cgroup files":           {"0::/\n", nil, 0},
		"garbage":                   {"0::/\n", map[string]string{"memory.max": "lots\n"}, 0},
		"no /proc/self/cgroup line": {"", map[string]string{"memory.max": "1073741824\n"}, 0},
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			proc := filepath.Join(dir, "cgroup")
			os.WriteFile(proc, []byte(c.proc), 0o644)
			root := filepath.Join(dir, "fs")
			for f, content := range c.files {
				p := filepath.Join(root, f)
				os.MkdirAll(filepath.Dir(p), 0o755)
				os.WriteFile(p, []byte(content), 0o644)
			}
			limit, ok := cgroupMemoryLimit(proc, root)
			if limit != c.want || ok != (c.want > 0) {
				t.Fatalf("%d %v, want %d", limit, ok, c.want)
			}
		})
	}
	if _, ok := cgroupMemoryLimit(filepath.Join(t.TempDir(), "absent"), "/sys/fs/cgroup"); ok {
		t.Fatal("a limit without /proc/self/cgroup")
	}
}
