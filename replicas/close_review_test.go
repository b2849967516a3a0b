package replicas

import (
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/router"
)

// Close (a proxy's Shutdown) leaves NATS without warning of a
// disconnection "until it is back", and nothing is logged once it returned.
func TestCloseIsNoOutage(t *testing.T) {
	url := startNATS(t).ClientURL()
	a, logs := startLogged(t, Config{URL: url, ID: "a", Interval: 20 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {})
	a.Close()
	if l := logs.String(); strings.Contains(l, "disconnected") || !strings.Contains(l, "connected to NATS") {
		t.Fatalf("log after Close: %s", l)
	}
}
