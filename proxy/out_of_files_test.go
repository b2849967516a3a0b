package proxy

import (
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/backends"
)

// A request whose engine connection cannot be opened for want of file
// descriptors (here every dial to the engines fails so, the pools' idle
// connections shed and the dial tried again) gets 503
// out_of_file_descriptors, counted as such, and no engine is ejected, a
// prefill engine dialled first included (the scale trial, the review).
func TestOutOfDescriptorsIsA503(t *testing.T) {
	for _, disaggregated := range []bool{false, true} {
		e0, pre := startFake(t, "e0", nil), startFake(t, "pre", nil)
		yaml := "models: [{name: m, aliases: [alias-m]}]\nbackends:\n  - {id: e0, url: 'http://{{e0}}'}\n"
		if disaggregated {
			yaml += "  - {id: pre, url: 'http://{{e1}}', role: prefill}\n"
		}
		p := startProxyYAML(t, yaml, e0, pre)
		engines := map[string]bool{e0.addr: true, pre.addr: true}
		restore := backends.SetDialForTests(func(network, addr string, d time.Duration) (net.Conn, error) {
			if engines[addr] {
				return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError("socket", syscall.EMFILE)}
			}
			return net.DialTimeout(network, addr, d)
		})
		resp, b := post(t, p.url+"/v1/chat/completions", chatBody)
		restore()
		if resp.StatusCode != 503 || !strings.Contains(string(b), `"code":"out_of_file_descriptors"`) || resp.Header.Get("Retry-After") != "1" {
			t.Fatalf("disaggregated %v: %d %s", disaggregated, resp.StatusCode, b)
		}
		p.waitIdle(t)
		m := p.metrics(t)
		want := []string{`kvproxy_unavailable_total{reason="out_of_file_descriptors"} 1`, `kvproxy_requests_total{backend="e0",code="503"} 1`}
		if disaggregated {
			want = append(want, `kvproxy_requests_total{backend="pre",code="503"} 1`)
		}
		for _, w := range want {
			if !strings.Contains(m, w) {
				t.Fatalf("disaggregated %v: no %s in\n%s", disaggregated, w, grepLines(m, "kvproxy_"))
			}
		}
		if strings.Contains(m, "kvproxy_backend_ejections_total{") || strings.Contains(p.logs.String(), "backend ejected") {
			t.Fatalf("disaggregated %v: an engine was ejected:\n%s", disaggregated, p.logs.String())
		}
		if resp, _ := post(t, p.url+"/v1/chat/completions", chatBody); resp.StatusCode != 200 {
			t.Fatalf("disaggregated %v: %d once descriptors are back", disaggregated, resp.StatusCode)
		}
	}
}
