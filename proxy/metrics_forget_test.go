package proxy

import (
	"strings"
	"testing"
)

// A backend a reload removed loses its series once its last request ended
// (a fleet whose ids kept changing grew 22 series per id it ever had: the
// soak trial); one configured again starts anew, and the others keep
// theirs.
func TestRemovedBackendsLoseTheirSeries(t *testing.T) {
	e0, e1 := startFake(t, "e0", nil), startFake(t, "e1", nil)
	yaml := func(ids ...string) string {
		y := "models: [{name: m}]\nrouter: {policy: round_robin}\nbackends:\n"
		for _, id := range ids {
			addr := e0.addr
			if id == "old" {
				addr = e1.addr
			}
			y += "  - {id: " + id + ", url: 'http://" + addr + "', model: m}\n"
		}
		return y
	}
	p := startProxyYAML(t, yaml("keep", "old"))
	for range 4 {
		post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)
	}
	if m := p.metrics(t); !strings.Contains(m, `backend="old"`) || !strings.Contains(m, `backend="keep"`) {
		t.Fatalf("series of both backends expected:\n%s", grepLines(m, "backend="))
	}
	p.reloadYAML(t, yaml("keep"))
	waitFor(t, "the removed backend's series to go", func() bool { return !strings.Contains(p.metrics(t), `backend="old"`) })
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_requests_total{backend="keep",code="200"} 2`) {
		t.Fatalf("the kept backend lost its series:\n%s", grepLines(m, "requests_total"))
	}
	p.reloadYAML(t, yaml("keep", "old"))
	for range 2 {
		post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	}
	if m := p.metrics(t); !strings.Contains(m, `kvproxy_requests_total{backend="old",code="200"} 1`) {
		t.Fatalf("the re-added backend's series should start anew:\n%s", grepLines(m, "requests_total"))
	}
}
