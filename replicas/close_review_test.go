package replicas

import (
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/router"
)

// Close (a proxy's Shutdown) leaves NATS without warning of a
// disconnection "until it is back", and nothing is logged once it returned.
func TestCloseIsNoOutage(t *testing.T) {
	url := startNATS(t).ClientURL()
	var logs syncBuffer
	a, err := Start(Config{URL: url, ID: "a", Interval: 20 * time.Millisecond},
		func() []Entry { return nil }, func(map[Key]router.Load) {}, zerolog.New(&logs))
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	if l := logs.String(); strings.Contains(l, "disconnected") || !strings.Contains(l, "connected to NATS") {
		t.Fatalf("log after Close: %s", l)
	}
}
