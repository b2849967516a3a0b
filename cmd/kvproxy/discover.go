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
// A reload looks up the names it adds itself (side by side, lookupsTime
// in all), so that a template renamed keeps serving, and keeps what it
// found only if it applies; the watcher keeps the names in force current,
// and retries those not resolved yet, after 1 s, 2 s, 4 s ... up to a
// minute. Addresses are kept only for the names in force: a name that
// comes back is resolved anew.
type discoverer struct {
	lookup func(ctx context.Context, host string) ([]string, error)
	log    zerolog.Logger

	mu      sync.Mutex
	addrs   map[string][]string  // by host
	inForce []string             // the hosts of the configuration in force
	failed  map[string]int       // lookups failed in a row, by host
	retry   map[string]time.Time // when to try an unresolved host again
}

func newDiscoverer(log zerolog.Logger) *discoverer {
	return &discoverer{lookup: net.DefaultResolver.LookupHost, log: log, addrs: map[string][]string{},
		failed: map[string]int{}, retry: map[string]time.Time{}}
}

const (
	// discoverTimeout bounds one lookup.
	discoverTimeout = 5 * time.Second
	// lookupsTime bounds the lookups of a start, a reload or a tick, all
	// together: a SIGTERM behind a reload waits for them, and a name that
	// does not answer holds up the others' changes no longer. A name not
	// resolved by then keeps what it stood for (none, if new).
	lookupsTime = 2 * time.Second
	// retryMax bounds the wait before an unresolved name is tried again.
	retryMax = time.Minute
)

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

// lookupAll looks the hosts up side by side and returns what each stands
// for: its addresses, or none for a name that does not exist (a headless
// service with no engine ready). A failed lookup is left out: the
// addresses a host had are kept (a DNS server's hiccup must not take every
// engine out).
func (d *discoverer) lookupAll(ctx context.Context, hs []string) map[string][]string {
	var mu sync.Mutex
	out := map[string][]string{}
	var wg sync.WaitGroup
	for _, host := range hs {
		wg.Go(func() {
			lctx, cancel := context.WithTimeout(ctx, discoverTimeout)
			got, err := d.lookup(lctx, host)
			cancel()
			var de *net.DNSError
			switch {
			case err == nil:
				got = config.ResolvedAddrs(got)
			case errors.As(err, &de) && de.IsNotFound:
				got = nil
			case ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded):
				return // shutting down
			default:
				d.lookupFailed(host, err)
				return
			}
			d.mu.Lock()
			if d.failed[host] > 0 {
				d.log.Info().Str("host", host).Msg("discovery: lookups answered again")
			}
			delete(d.failed, host)
			delete(d.retry, host)
			d.mu.Unlock()
			mu.Lock()
			out[host] = got
			mu.Unlock()
		})
	}
	wg.Wait()
	return out
}

// lookupFailed warns of the first of a host's failed lookups in a row
// (the others are at debug level), and sets when to try it again.
func (d *discoverer) lookupFailed(host string, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := d.failed[host] + 1
	d.failed[host] = n
	ev := d.log.Debug()
	if n == 1 {
		ev = d.log.Warn()
	}
	ev.Str("host", host).Err(err).Int("in_a_row", n).Msg("discovery: lookup failed; keeping the addresses it had, if any")
	d.retry[host] = time.Now().Add(min(time.Second<<min(n-1, 6), retryMax))
}

// record keeps what lookupAll found. With onlyInForce (the watcher's
// lookups), a name a reload took out meanwhile is not kept.
func (d *discoverer) record(found map[string][]string, onlyInForce bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for host, got := range found {
		if onlyInForce && !slices.Contains(d.inForce, host) {
			continue
		}
		if prev, ok := d.addrs[host]; !ok || !slices.Equal(prev, got) {
			d.addrs[host] = got
			d.log.Info().Str("host", host).Strs("addresses", got).Strs("was", prev).Msg("discovery: addresses changed")
		}
	}
}

// keep makes hs the hosts in force, and forgets the addresses and failed
// lookups of the others.
func (d *discoverer) keep(hs []string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.inForce = hs
	for h := range d.addrs {
		if !slices.Contains(hs, h) {
			delete(d.addrs, h)
		}
	}
	for h := range d.failed { // a name back starts a streak of its own
		if !slices.Contains(hs, h) {
			delete(d.failed, h)
			delete(d.retry, h)
		}
	}
}

// unresolved are the hosts in force with no addresses yet, due to be
// tried again.
func (d *discoverer) unresolved() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	return slices.DeleteFunc(slices.Clone(d.inForce), func(h string) bool {
		_, ok := d.addrs[h]
		return ok || now.Before(d.retry[h])
	})
}

// found is what each of the templates stands for now, by template id
// (none while its host has not been resolved): what staged holds for its
// host (a reload's own lookups), else what is kept.
func (d *discoverer) found(templates []config.Backend, staged map[string][]string) map[string][]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[string][]string, len(templates))
	for _, t := range templates {
		a, ok := staged[t.DiscoverHost()]
		if !ok {
			a, ok = d.addrs[t.DiscoverHost()]
		}
		if ok {
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

// watch calls tick with the hosts to look up, until ctx ends: every host
// in force each interval (the shortest discover_interval of the templates
// in force, asked every second: a reload may change it), and every second
// the hosts in force not resolved yet.
func (d *discoverer) watch(ctx context.Context, interval func() time.Duration, tick func(hs []string)) {
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
		d.mu.Lock()
		all := slices.Clone(d.inForce)
		d.mu.Unlock()
		if iv := interval(); iv > 0 && time.Since(last) >= iv {
			last = time.Now()
			tick(all)
		} else if hs := d.unresolved(); len(hs) > 0 {
			tick(hs)
		}
	}
}
