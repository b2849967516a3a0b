package proxy

import (
	"fmt"
	"reflect"
	"slices"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
)

// reloadChanges is what a reload changed, for its log line: ids and
// names, sorted, never keys.
type reloadChanges struct {
	backendsAdded, backendsRemoved, backendsReplaced      []string
	modelsAdded, modelsRemoved, modelsChanged             []string // changed: aliases, adapters or settings
	tenantsChanged                                        []string // settings or keys added, removed or changed
	adminKeysChanged, metricsKeysChanged, logLevelChanged bool
	restartNeeded                                         []string
}

func diffReload(prev, next *state) reloadChanges {
	var c reloadChanges
	for id, b := range next.backends {
		switch old := prev.backends[id]; {
		case old == nil:
			c.backendsAdded = append(c.backendsAdded, id)
		case old != b: // settings changed, or moved to another model
			c.backendsReplaced = append(c.backendsReplaced, id)
		}
	}
	for id := range prev.backends {
		if next.backends[id] == nil {
			c.backendsRemoved = append(c.backendsRemoved, id)
		}
	}
	had := map[string]*config.Model{} // as configured: a pool kept across a reload keeps its first cfg
	for i := range prev.cfg.Models {
		had[prev.cfg.Models[i].Name] = &prev.cfg.Models[i]
	}
	for i := range next.cfg.Models {
		m := &next.cfg.Models[i]
		switch old := had[m.Name]; {
		case old == nil:
			c.modelsAdded = append(c.modelsAdded, m.Name)
		case !reflect.DeepEqual(*old, *m):
			c.modelsChanged = append(c.modelsChanged, m.Name)
		}
		delete(had, m.Name)
	}
	for name := range had {
		c.modelsRemoved = append(c.modelsRemoved, name)
	}
	c.tenantsChanged = tenantsChanged(prev.cfg, next.cfg)
	c.adminKeysChanged = !slices.Equal(prev.cfg.Auth.AdminKeys, next.cfg.Auth.AdminKeys)
	c.metricsKeysChanged = !slices.Equal(prev.cfg.Auth.MetricsKeys, next.cfg.Auth.MetricsKeys)
	c.logLevelChanged = prev.cfg.LogLevel != next.cfg.LogLevel
	c.restartNeeded = next.restartNeeded
	for _, l := range [][]string{c.backendsAdded, c.backendsRemoved, c.backendsReplaced, c.modelsAdded, c.modelsRemoved, c.modelsChanged} {
		slices.Sort(l)
	}
	return c
}

// tenantsChanged names the tenants whose settings or API keys differ
// between a and b (added and removed ones included).
func tenantsChanged(a, b *config.Config) []string {
	type view struct {
		t    config.Tenant
		keys []string
	}
	views := func(c *config.Config) map[string]*view {
		m := map[string]*view{}
		get := func(name string) *view {
			if m[name] == nil {
				m[name] = &view{}
			}
			return m[name]
		}
		for _, t := range c.Tenants {
			get(t.Name).t = t
		}
		for _, k := range c.Auth.Keys {
			v := get(k.Tenant)
			v.keys = append(v.keys, k.Key)
		}
		for _, v := range m {
			slices.Sort(v.keys)
		}
		return m
	}
	va, vb := views(a), views(b)
	var out []string
	for name, x := range va {
		if y := vb[name]; y == nil || !reflect.DeepEqual(*x, *y) {
			out = append(out, name)
		}
	}
	for name := range vb {
		if va[name] == nil {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// maxLoggedNames bounds each list of names in the summary line.
const maxLoggedNames = 20

// log writes the reload's one summary line.
func (c reloadChanges) log(ev *zerolog.Event, backends, models int) {
	list := func(key string, l []string) {
		if len(l) > maxLoggedNames {
			// One line, not 15 KB for a fleet rebuilt at once; the count
			// says how many.
			l = append(l[:maxLoggedNames:maxLoggedNames], fmt.Sprintf("(and %d more)", len(l)-maxLoggedNames))
		}
		if len(l) > 0 {
			ev = ev.Strs(key, l)
		}
	}
	list("backends_added", c.backendsAdded)
	list("backends_removed", c.backendsRemoved)
	list("backends_replaced", c.backendsReplaced)
	list("models_added", c.modelsAdded)
	list("models_removed", c.modelsRemoved)
	list("models_changed", c.modelsChanged)
	list("tenants_changed", c.tenantsChanged)
	if c.adminKeysChanged {
		ev = ev.Bool("admin_keys_changed", true)
	}
	if c.metricsKeysChanged {
		ev = ev.Bool("metrics_keys_changed", true)
	}
	if c.logLevelChanged {
		ev = ev.Bool("log_level_changed", true)
	}
	list("restart_needed", c.restartNeeded)
	ev.Int("backends", backends).Int("models", models).Msg("configuration reloaded")
}
