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
	addrs map[string][]string // by template id
}

func newDiscoverer(log zerolog.Logger) *discoverer {
	return &discoverer{lookup: net.DefaultResolver.LookupHost, log: log, addrs: map[string][]string{}}
}

// discoverTimeout bounds one lookup.
const discoverTimeout = 5 * time.Second

// resolve looks up every template (its caller holds the lock that orders
// resolutions and reloads: a slow lookup's older answer must not undo a
// reload's). A failed lookup keeps the addresses its template had (a DNS
// server's hiccup must not take every engine out), except a name that
// does not exist, as a headless service with no engine ready: it stands
// for none.
func (d *discoverer) resolve(ctx context.Context, templates []config.Backend) {
	for _, t := range templates {
		host := t.DiscoverHost()
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
			d.log.Warn().Str("backend", t.ID).Str("host", host).Err(err).Msg("discovery: lookup failed; keeping the addresses it had")
			continue
		}
		d.mu.Lock()
		if prev, ok := d.addrs[t.ID]; !ok || !slices.Equal(prev, got) {
			d.addrs[t.ID] = got
			d.log.Info().Str("backend", t.ID).Str("host", host).Strs("addresses", got).Strs("was", prev).Msg("discovery: addresses changed")
		}
		d.mu.Unlock()
	}
}

// found is what each of the templates stands for now (a template of an
// earlier configuration keeps its entry: a reload that fails, or one
// that puts it back, finds it there).
func (d *discoverer) found(templates []config.Backend) map[string][]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[string][]string, len(templates))
	for _, t := range templates {
		if a, ok := d.addrs[t.ID]; ok {
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
// templates interval returns, until ctx ends.
func (d *discoverer) watch(ctx context.Context, interval func() time.Duration, tick func()) {
	for {
		wait := interval()
		if wait == 0 {
			wait = 10 * time.Second // none now; a reload may add some
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		tick()
	}
}
