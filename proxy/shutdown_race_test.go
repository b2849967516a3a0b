package proxy

import (
	"net"
	"testing"

	"github.com/rs/zerolog"

	"github.com/kvproxy/kvproxy/config"
)

// SIGTERM right after start: Shutdown runs while Serve is starting (-race).
func TestShutdownRacingServe(t *testing.T) {
	cfg, err := config.Parse([]byte("models:\n  - name: m\nbackends:\n  - {id: a, url: \"http://127.0.0.1:1\"}\n"))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		s, err := New(cfg, Options{Logger: zerolog.Nop()})
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- s.Serve(ln) }()
		s.Shutdown()
		ln.Close()
		<-served
	}
}
