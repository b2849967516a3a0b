package main

import (
	"context"
	"errors"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
)

// discoverer resolves the hosts of the configuration's discovery templates
// (backends[].discover: dns) and keeps the addresses each stands for.
type discoverer struct {
	lookup func(ctx context.Context, host string) ([]string, error)
	log    zerolog.Logger

	mu    sync.Mutex
	addrs map[string][]string // by host: a template whose host changed has none until it is resolved
}

func newDiscoverer(log zerolog.Logger) *discoverer {
	return &discoverer{lookup: net.DefaultResolver.LookupHost, log: log, addrs: map[string][]string{}}
}

// discoverTimeout bounds one lookup.
const discoverTimeout = 5 * time.Second

// hosts are the names the templates resolve through, each once.
func hosts(templates []config.Backend) []string {
	var hs []string
	for _, t := range templates {
		if h := t.DiscoverHost(); !slices.Contains(hs, h) {
			hs = append(hs, h)
		}
	}
	return hs
}

// reloadLookups bounds the lookups a reload makes, all together: a
// SIGTERM behind a reload waits for them. A name not resolved in time
// stands for none until the watcher's next tick.
const reloadLookups = 2 * time.Second

// stale are the hosts of hs not in inForce: the watcher does not keep
// them current (never resolved, or resolved while an earlier
// configuration had them).
func stale(hs, inForce []string) []string {
	return slices.DeleteFunc(slices.Clone(hs), func(h string) bool { return slices.Contains(inForce, h) })
}

// resolve looks the hosts up. A failed lookup keeps the addresses a host
// had (a DNS server's hiccup must not take every engine out), except a
// name that does not exist, as a headless service with no engine ready:
// it stands for none.
func (d *discoverer) resolve(ctx context.Context, hs []string) {
	for _, host := range hs {
		lctx, cancel := context.WithTimeout(ctx, discoverTimeout)
		got, err := d.lookup(lctx, host)
		cancel()
		var de *net.DNSError
		switch {
		case err == nil:
			got = config.ResolvedAddrs(got)
		case errors.As(err, &de) && de.IsNotFound:
			got = nil
		case ctx.Err() != nil:
			return // shutting down
		default:
			d.log.Warn().Str("host", host).Err(err).Msg("discovery: lookup failed; keeping the addresses it had")
			continue
		}
		d.mu.Lock()
		if prev, ok := d.addrs[host]; !ok || !slices.Equal(prev, got) {
			d.addrs[host] = got
			d.log.Info().Str("host", host).Strs("addresses", got).Strs("was", prev).Msg("discovery: addresses changed")
		}
		d.mu.Unlock()
	}
}

// found is what each of the templates stands for now, by template id
// (none while its host has not been resolved).
func (d *discoverer) found(templates []config.Backend) map[string][]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[string][]string, len(templates))
	for _, t := range templates {
		if a, ok := d.addrs[t.DiscoverHost()]; ok {
			out[t.ID] = slices.Clone(a)
		}
	}
	return out
}

// every is how often templates are resolved again: the shortest
// discover_interval among them (0: none).
func every(templates []config.Backend) time.Duration {
	var d time.Duration
	for _, t := range templates {
		if d == 0 || t.DiscoverInterval < d {
			d = t.DiscoverInterval
		}
	}
	return d
}

// watch calls tick (which resolves the templates in force and applies
// what changed) every interval, the shortest discover_interval of the
// templates in force (interval, asked every second: a reload may change
// it), until ctx ends.
func (d *discoverer) watch(ctx context.Context, interval func() time.Duration, tick func()) {
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
		if iv := interval(); iv > 0 && time.Since(last) >= iv {
			last = time.Now()
			tick()
		}
	}
}
