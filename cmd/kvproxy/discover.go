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

// resolve looks up every template. A failed lookup keeps the addresses its template had (a DNS
// server's hiccup must not take every engine out), except a name that
// does not exist, as a headless service with no engine ready: it stands
// for none.
func (d *discoverer) resolve(templates []config.Backend) {
	seen := make(map[string]bool, len(templates))
	for _, t := range templates {
		seen[t.ID] = true
		host := t.DiscoverHost()
		ctx, cancel := context.WithTimeout(context.Background(), discoverTimeout)
		got, err := d.lookup(ctx, host)
		cancel()
		var de *net.DNSError
		switch {
		case err == nil:
			got = config.ResolvedAddrs(got)
		case errors.As(err, &de) && de.IsNotFound:
			got = nil
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
	d.mu.Lock()
	for id := range d.addrs {
		if !seen[id] {
			delete(d.addrs, id)
		}
	}
	d.mu.Unlock()
}

// snapshot is what each template stands for now.
func (d *discoverer) snapshot() map[string][]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[string][]string, len(d.addrs))
	for id, a := range d.addrs {
		out[id] = slices.Clone(a)
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

// watch resolves the templates current() returns again every interval,
// and then calls sync (which applies what changed since it last applied,
// or failed to), until ctx ends.
func (d *discoverer) watch(ctx context.Context, current func() []config.Backend, sync func()) {
	for {
		wait := every(current())
		if wait == 0 {
			wait = 10 * time.Second // none now; a reload may add some
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if ts := current(); len(ts) > 0 {
			d.resolve(ts)
			sync()
		}
	}
}
