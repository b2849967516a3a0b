package proxy

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

// TestRetiredBackendTakesNoRoutedRequest: a request whose route chose a
// backend just before a reload removed it, and that takes its slot only
// after the backend's retirement found it idle, goes to another backend.
// It was sent to the retired one, whose engine may have been stopped since
// (AwaitRetired said the proxy was done with it: an in-process mock stops
// then).
func TestRetiredBackendTakesNoRoutedRequest(t *testing.T) {
	e0, e1 := startFake(t, "e0", nil), startFake(t, "e1", nil)
	head := "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n" +
		"backends:\n" +
		"  - {id: e1, url: 'http://{{e1}}', model: m}\n"
	p := startProxyYAML(t, head+"  - {id: e0, url: 'http://{{e0}}', model: m, kv_events: {mode: http}}\n", e0, e1)
	ids := promptIDs(100)
	pushRank(t, p, "e0", 0, ids) // e0 holds the prompt: routes go there

	reached, resume := make(chan struct{}), make(chan struct{})
	var once sync.Once
	hook := func(b *backend) {
		if b.cfg.ID == "e0" {
			once.Do(func() { close(reached); <-resume })
		}
	}
	p.s.testRouted.Store(&hook)
	defer func() {
		select {
		case <-resume:
		default:
			close(resume)
		}
	}()
	type result struct {
		status int
		worker string
		body   string
	}
	res := make(chan result, 1)
	go func() {
		resp, err := http.Post(p.url+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"m","prompt":[`+ids+`],"stream":true}`))
		if err != nil {
			res <- result{body: err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		res <- result{resp.StatusCode, resp.Header.Get(WorkerHeader), string(b)}
	}()
	select {
	case <-reached:
	case r := <-res:
		t.Fatalf("answered without routing to e0: %+v", r)
	case <-time.After(5 * time.Second):
		t.Fatal("the request was not routed to e0")
	}
	e0URL := "http://" + e0.addr
	cfg, err := config.Parse([]byte(strings.ReplaceAll(head, "{{e1}}", e1.addr))) // e0 removed
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	// Nothing holds a slot on e0: it retires at once.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := p.s.AwaitRetired(ctx, "e0", e0URL); err != nil {
		t.Fatalf("e0 not retired: %v: %s", err, p.logs.String())
	}
	if !strings.Contains(p.logs.String(), `"backend":"e0","replaced":false,"message":"backend retired"`) {
		t.Fatalf("AwaitRetired returned before e0 retired: %s", p.logs.String())
	}
	// e1 is still configured: the proxy is not done with it.
	short, cancelShort := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancelShort()
	if err := p.s.AwaitRetired(short, "e1", "http://"+e1.addr); err == nil {
		t.Fatal("AwaitRetired returned for e1, which is configured")
	}
	close(resume)
	var r result
	select {
	case r = <-res:
	case <-time.After(10 * time.Second):
		t.Fatal("no answer")
	}
	if r.status != 200 || r.worker != "e1" || !strings.HasSuffix(strings.TrimSpace(r.body), "data: [DONE]") {
		t.Fatalf("the request routed to e0 before its removal: %d from %q: %s", r.status, r.worker, r.body)
	}
	if n := e0.requests.Load(); n != 0 {
		t.Fatalf("the retired e0 got %d requests", n)
	}
	p.waitIdle(t)
}
