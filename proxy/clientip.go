package proxy

import (
	"bytes"
	"net"

	"github.com/valyala/fasthttp"
)

// clientIP is the address a request came from, as logged: the peer's, or,
// when the peer is one of trusted_proxies, the address its
// X-Forwarded-For names: the last one not itself a trusted proxy (entries
// further left are the client's to write, and may be forged).
func (st *state) clientIP(ctx *fasthttp.RequestCtx) net.IP {
	peer := ctx.RemoteIP()
	if len(st.trusted) == 0 || !st.isTrusted(peer) {
		return peer
	}
	// Several header lines are one list (a proxy may add a line of its
	// own rather than append to the client's), the last line last.
	lines := ctx.Request.Header.PeekAll("X-Forwarded-For")
	client := peer
	for l := len(lines) - 1; l >= 0; l-- {
		for xff := lines[l]; len(xff) > 0; {
			entry := xff
			if i := bytes.LastIndexByte(xff, ','); i >= 0 {
				entry, xff = xff[i+1:], xff[:i]
			} else {
				xff = nil
			}
			ip := net.ParseIP(string(bytes.TrimSpace(entry)))
			if ip == nil {
				return client
			}
			client = ip
			if !st.isTrusted(ip) {
				return client
			}
		}
	}
	return client
}

func (st *state) isTrusted(ip net.IP) bool {
	for _, n := range st.trusted {
		if n.Contains(ip) {
			return true
		}
	}
	return false
}
