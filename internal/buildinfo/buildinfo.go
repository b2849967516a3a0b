// Package buildinfo says which build of kvproxy is running: the module
// version and the commit Go stamped into the binary.
package buildinfo

import (
	"runtime/debug"
	"strings"
)

// Info is what `kvproxy -version` prints and kvproxy_build_info labels.
type Info struct {
	Version   string // the module's version, "(devel)" for a build from a checkout
	Revision  string // the commit, "+dirty" when the tree had changes; "" if not stamped
	GoVersion string
}

// Read reads the running binary's build information.
func Read() Info {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return Info{Version: "unknown"}
	}
	info := Info{Version: bi.Main.Version, GoVersion: bi.GoVersion}
	dirty := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			info.Revision = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if info.Revision != "" && dirty {
		info.Revision += "+dirty"
	}
	if info.Version == "" {
		info.Version = "(devel)"
	}
	return info
}

// String is the one-line form: "kvproxy (devel) abc123…+dirty go1.26.8".
func (i Info) String() string {
	parts := []string{"kvproxy", i.Version}
	if i.Revision != "" {
		parts = append(parts, i.Revision)
	}
	if i.GoVersion != "" {
		parts = append(parts, i.GoVersion)
	}
	return strings.Join(parts, " ")
}
