package config

import (
	"net"
	"net/url"
	"slices"
	"strings"
)

// Templates returns the backends with discover set: each stands for the
// engines at the addresses its url's host resolves to.
func (c *Config) Templates() []Backend {
	var ts []Backend
	for _, b := range c.Backends {
		if b.Discover != "" {
			ts = append(ts, b)
		}
	}
	return ts
}

// DiscoverHost is the name a template's url resolves through.
func (b *Backend) DiscoverHost() string {
	u, err := url.Parse(b.URL)
	if err != nil {
		return ""
	}
	return u.Hostname()
}

// Expand returns the configuration with each discovery template replaced
// by one backend per address in addrs[template id], in the order given:
// its id followed by "@address", the address standing for the url's host
// in the url and in the kv_events endpoints that name it. A template with
// no address stands for no backend. The result is validated; c is not
// changed. A configuration without templates is returned as it is.
func (c *Config) Expand(addrs map[string][]string) (*Config, error) {
	if len(c.Templates()) == 0 {
		return c, nil
	}
	out := *c
	out.discovering = true
	out.Backends = nil
	for _, b := range c.Backends {
		if b.Discover == "" {
			out.Backends = append(out.Backends, b)
			continue
		}
		host := b.DiscoverHost()
		for _, a := range addrs[b.ID] {
			nb := b
			nb.Discover, nb.DiscoverInterval = "", 0
			nb.ID = b.ID + "@" + a
			nb.URL = withHost(b.URL, host, a)
			nb.KVEvents.Endpoint = withHost(b.KVEvents.Endpoint, host, a)
			nb.KVEvents.Replay = withHost(b.KVEvents.Replay, host, a)
			out.Backends = append(out.Backends, nb)
		}
	}
	out.Backends = slices.Clip(out.Backends)
	if err := out.Validate(); err != nil {
		return nil, err
	}
	return &out, nil
}

// withHost replaces host in an endpoint's "//host:" or "//host/" or a
// trailing "//host" with addr (bracketed when IPv6).
func withHost(endpoint, host, addr string) string {
	if strings.Contains(addr, ":") {
		addr = "[" + addr + "]"
	}
	i := strings.Index(endpoint, "//"+host)
	if i < 0 {
		return endpoint
	}
	rest := endpoint[i+2+len(host):]
	if rest != "" && rest[0] != ':' && rest[0] != '/' {
		return endpoint // another name that starts with host
	}
	return endpoint[:i+2] + addr + rest
}

// ResolvedAddrs sorts and de-duplicates what a lookup returned.
func ResolvedAddrs(addrs []string) []string {
	out := make([]string, 0, len(addrs))
	for _, a := range addrs {
		if ip := net.ParseIP(a); ip != nil {
			a = ip.String()
		}
		out = append(out, a)
	}
	slices.Sort(out)
	return slices.Compact(out)
}
