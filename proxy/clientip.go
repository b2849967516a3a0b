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
	xff := ctx.Request.Header.Peek("X-Forwarded-For")
	client := peer
	for len(xff) > 0 {
		entry := xff
		if i := bytes.LastIndexByte(xff, ','); i >= 0 {
			entry, xff = xff[i+1:], xff[:i]
		} else {
			xff = nil
		}
		ip := net.ParseIP(string(bytes.TrimSpace(entry)))
		if ip == nil {
			break
		}
		client = ip
		if !st.isTrusted(ip) {
			break
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
