package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Under a memory limit (GOMEMLIMIT here; a container's cgroup limit sets
// one the same way), limits.body_memory_mb defaults to a quarter of it,
// and the serving line says so; one set over a third is warned of.
func TestBodyMemoryFollowsTheMemoryLimit(t *testing.T) {
	engines := fleet(t, 1)
	listen := freePort(t)
	path := filepath.Join(t.TempDir(), "kvproxy.yaml")
	body := "listen: " + listen + "\n" + backendsYAML(map[string]string{"e0": engines[0]}, "")
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	limited := func(args ...string) *exec.Cmd {
		cmd := exec.Command(filepath.Join(binDir, "kvproxy"), args...)
		cmd.Env = append(os.Environ(), "GOMEMLIMIT=400MiB")
		return cmd
	}
	p := startCmd(t, "kvproxy", limited("-config", path))
	waitHealthy(t, "http://"+listen, p)
	waitFor(t, 5*time.Second, "the serving line", func() bool { return strings.Contains(p.String(), `"message":"kvproxy serving"`) })
	if !strings.Contains(p.String(), `"body_memory_mb":100,`) {
		t.Fatalf("under GOMEMLIMIT=400MiB, want body_memory_mb 100 in the serving line:\n%s", p.String())
	}
	if err := os.WriteFile(path, []byte(body+"limits: {body_memory_mb: 1024}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := limited("-check", "-config", path).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "limits.body_memory_mb (1024) is over a third of kvproxy's memory limit (400 MiB") {
		t.Fatalf("body_memory_mb 1024 under a 400 MiB limit: %v\n%s", err, out)
	}
}
