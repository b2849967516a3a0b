package main

import (
	"bytes"
	"net"
	"net/http"
	"strconv"
	"time"
)

// engine answers every completion with one large JSON answer, its length
// declared; /health and /v1/models as an OpenAI-compatible engine does.
type engine struct {
	addr string
	srv  *http.Server
}

func startEngine(size int, wait float64) (*engine, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	answer := largeAnswer(size)
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"object":"list","data":[{"id":"m","object":"model"}]}`))
	})
	mux.HandleFunc("/v1/completions", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(answer)))
		w.WriteHeader(http.StatusOK)
		// The headers first, the body after a while: kvproxy takes the
		// answer's room when they come, and the clients' answers overlap.
		w.(http.Flusher).Flush()
		time.Sleep(time.Duration(wait * float64(time.Second)))
		w.Write(answer)
	})
	e := &engine{addr: ln.Addr().String(), srv: &http.Server{Handler: mux}}
	go e.srv.Serve(ln)
	return e, nil
}

func (e *engine) close() { e.srv.Close() }

// largeAnswer is a completion of about size bytes.
func largeAnswer(size int) []byte {
	const head = `{"id":"cmpl-kvmemory","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"`
	const tail = `","finish_reason":"length","logprobs":null}],"usage":{"prompt_tokens":6,"completion_tokens":16,"total_tokens":22}}`
	b := make([]byte, 0, size)
	b = append(b, head...)
	b = append(b, bytes.Repeat([]byte("a"), max(0, size-len(head)-len(tail)))...)
	return append(b, tail...)
}
