package config

import (
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"
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
// in the url and in the kv_events endpoints. A template with no address
// stands for no backend. An address whose backend would take the id of
// another, or serve its model from the same engine, is left out and
// named in skipped (one bad address must not hold up the others). The
// result is validated; c is not changed. A configuration without
// templates is returned as it is.
func (c *Config) Expand(addrs map[string][]string) (out *Config, skipped []string, err error) {
	if len(c.Templates()) == 0 {
		return c, nil, nil
	}
	x := *c
	x.discovering = true
	x.Backends = nil
	var entries []*yaml.Node // the file's entry of each of x's backends
	entry := func(i int) *yaml.Node {
		if _, n := fieldAt(c.file, fmt.Sprintf("backends[%d]", i)); n != nil {
			return n
		}
		return &yaml.Node{} // no line
	}
	ids, engines := map[string]bool{}, map[string]bool{}
	for i, b := range c.Backends {
		if b.Discover == "" {
			x.Backends = append(x.Backends, b)
			entries = append(entries, entry(i))
			ids[b.ID], engines[engineKey(b)] = true, true
		}
	}
	for i, b := range c.Backends {
		if b.Discover == "" {
			continue
		}
		host := b.DiscoverHost()
		for _, a := range addrs[b.ID] {
			nb := b
			nb.Discover, nb.DiscoverInterval = "", 0
			nb.ID = b.ID + "@" + a
			u, _ := url.Parse(b.URL) // valid: c is
			u.Host = net.JoinHostPort(a, u.Port())
			if u.Port() == "" {
				u.Host = bracketed(a)
			}
			nb.URL = u.String()
			nb.KVEvents.Endpoint = withHost(b.KVEvents.Endpoint, host, a)
			nb.KVEvents.Replay = withHost(b.KVEvents.Replay, host, a)
			if ids[nb.ID] || engines[engineKey(nb)] {
				skipped = append(skipped, fmt.Sprintf("%s (%s): another backend has its id or serves its model from that engine", nb.ID, nb.URL))
				continue
			}
			ids[nb.ID], engines[engineKey(nb)] = true, true
			x.Backends = append(x.Backends, nb)
			entries = append(entries, entry(i)) // the template's
		}
	}
	x.Backends = slices.Clip(x.Backends)
	// Validate names the lines of x's backends only: its other fields
	// are c's, valid, unless changed in code since (kvproxy -listen),
	// where the file's line would be the wrong one.
	x.file = nil
	if c.file != nil {
		x.file = &yaml.Node{Kind: yaml.MappingNode, Content: []*yaml.Node{
			{Kind: yaml.ScalarNode, Value: "backends"}, {Kind: yaml.SequenceNode, Content: entries}}}
	}
	if err := x.Validate(); err != nil {
		return nil, skipped, err
	}
	return &x, skipped, nil
}

// engineKey is what makes two backends one engine serving one model (see
// Validate).
func engineKey(b Backend) string {
	u, err := url.Parse(b.URL)
	if err != nil {
		return b.URL
	}
	return b.Model + "\x00" + u.Scheme + "://" + strings.ToLower(u.Host) + "\x00" + b.APIKey
}

func bracketed(addr string) string {
	if strings.Contains(addr, ":") {
		return "[" + addr + "]"
	}
	return addr
}

// withHost replaces host (in any case) in an endpoint's "//host:",
// "//host/" or trailing "//host" with addr.
func withHost(endpoint, host, addr string) string {
	if host == "" {
		return endpoint
	}
	for i := 0; ; {
		j := strings.Index(endpoint[i:], "//")
		if j < 0 {
			return endpoint
		}
		at := i + j + 2
		if end := at + len(host); end <= len(endpoint) && strings.EqualFold(endpoint[at:end], host) &&
			(end == len(endpoint) || endpoint[end] == ':' || endpoint[end] == '/') {
			return endpoint[:at] + bracketed(addr) + endpoint[end:]
		}
		i = at
	}
}

// namesHost reports whether a ZMQ endpoint is on host (in any case).
func namesHost(endpoint, host string) bool {
	return withHost(endpoint, host, "x") != endpoint
}

// ResolvedAddrs sorts and de-duplicates what a lookup returned, keeping
// only the IPv4 addresses when there are any: a dual-stack name has an A
// and an AAAA record for each engine, which would be two backends.
func ResolvedAddrs(addrs []string) []string {
	out := make([]string, 0, len(addrs))
	v4 := false
	for _, a := range addrs {
		if ip := net.ParseIP(a); ip != nil {
			a = ip.String()
			v4 = v4 || ip.To4() != nil
		}
		out = append(out, a)
	}
	if v4 {
		out = slices.DeleteFunc(out, func(a string) bool { ip := net.ParseIP(a); return ip != nil && ip.To4() == nil })
	}
	slices.Sort(out)
	return slices.Compact(out)
}
