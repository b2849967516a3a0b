package proxy

import (
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/config"
)

func TestClientIP(t *testing.T) {
	st := &state{trusted: (&config.Config{TrustedProxies: []string{"127.0.0.1", "10.0.0.0/8"}}).TrustedNets()}
	for _, c := range []struct{ peer, xff, want string }{
		{"127.0.0.1", "203.0.113.7, 10.1.2.3", "203.0.113.7"},
		{"127.0.0.1", "198.51.100.9, 203.0.113.7", "203.0.113.7"}, // the left one is the client's word
		{"127.0.0.1", "", "127.0.0.1"},
		{"127.0.0.1", "10.0.0.1, 10.0.0.2", "10.0.0.1"},
		{"127.0.0.1", "not-an-ip", "127.0.0.1"},
		{"198.51.100.1", "203.0.113.7", "198.51.100.1"},     // not a trusted proxy: its header is ignored
		{"127.0.0.1", "6.6.6.6|203.0.113.7", "203.0.113.7"}, // the client's own line, then the proxy's
	} {
		var req fasthttp.Request
		for _, line := range strings.Split(c.xff, "|") {
			if line != "" {
				req.Header.Add("X-Forwarded-For", line)
			}
		}
		var ctx fasthttp.RequestCtx
		ctx.Init(&req, &net.TCPAddr{IP: net.ParseIP(c.peer), Port: 5000}, nil)
		if got := st.clientIP(&ctx).String(); got != c.want {
			t.Errorf("peer %s, X-Forwarded-For %q: %s, want %s", c.peer, c.xff, got, c.want)
		}
	}
}

// Behind a trusted load balancer the access log names the client.
func TestAccessLogNamesTheForwardedClient(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "trusted_proxies: [127.0.0.1]\nmodels: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	req, _ := http.NewRequest("POST", p.url+"/v1/chat/completions", strings.NewReader(chatBody))
	req.Header.Set("X-Forwarded-For", "203.0.113.7")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	p.waitIdle(t)
	if !strings.Contains(p.logs.String(), `"remote":"203.0.113.7"`) {
		t.Fatalf("logs:\n%s", p.logs.String())
	}
	if _, err := config.Parse([]byte("trusted_proxies: [10.0.0.0/33]\nmodels: [{name: m}]\nbackends: [{id: e0, url: 'http://127.0.0.1:1', model: m}]\n")); err == nil || !strings.Contains(err.Error(), "trusted_proxies[0]") {
		t.Fatalf("a bad CIDR: %v", err)
	}
}
