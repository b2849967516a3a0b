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
//
// A reload never waits on a lookup: it applies the addresses known, and a
// name it adds stands for none until the watcher, woken by it, has
// resolved it (a moment, with a DNS server that answers). Addresses are
// kept only for the names in force: a name that comes back is resolved
// anew.
type discoverer struct {
	lookup func(ctx context.Context, host string) ([]string, error)
	log    zerolog.Logger
	wake   chan struct{} // a reload added a name: resolve now

	mu    sync.Mutex
	addrs map[string][]string // by host
}

func newDiscoverer(log zerolog.Logger) *discoverer {
	return &discoverer{lookup: net.DefaultResolver.LookupHost, log: log, wake: make(chan struct{}, 1), addrs: map[string][]string{}}
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

// resolve looks the hosts up, all at once, and calls done (if not nil)
// after each lookup, so that a name that does not answer holds up no
// other. A failed lookup keeps the addresses a host had (a DNS server's
// hiccup must not take every engine out), except a name that does not
// exist, as a headless service with no engine ready: it stands for none.
func (d *discoverer) resolve(ctx context.Context, hs []string, done func()) {
	var wg sync.WaitGroup
	for _, host := range hs {
		wg.Go(func() {
			d.resolveOne(ctx, host)
			if done != nil {
				done()
			}
		})
	}
	wg.Wait()
}

func (d *discoverer) resolveOne(ctx context.Context, host string) {
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
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if prev, ok := d.addrs[host]; !ok || !slices.Equal(prev, got) {
		d.addrs[host] = got
		d.log.Info().Str("host", host).Strs("addresses", got).Strs("was", prev).Msg("discovery: addresses changed")
	}
}

// keep forgets the addresses of the hosts not in hs (those no longer in
// force), and reports whether any host of hs has none yet.
func (d *discoverer) keep(hs []string) (unresolved bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for h := range d.addrs {
		if !slices.Contains(hs, h) {
			delete(d.addrs, h)
		}
	}
	for _, h := range hs {
		if _, ok := d.addrs[h]; !ok {
			unresolved = true
		}
	}
	return unresolved
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

// watch calls tick (which resolves the names in force and applies what
// changed) every interval, the shortest discover_interval of the templates
// in force (asked every second: a reload may change it), and at once when
// woken, until ctx ends.
func (d *discoverer) watch(ctx context.Context, interval func() time.Duration, tick func()) {
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		case <-time.After(time.Second):
			if iv := interval(); iv == 0 || time.Since(last) < iv {
				continue
			}
		}
		last = time.Now()
		tick()
	}
}

// woken asks the watcher for a tick now.
func (d *discoverer) woken() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}
