package mockengine

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"
)

// BenchmarkEngineStream measures the cost per streamed token over loopback:
// 32 concurrent streams of 64 tokens, engine time compressed to nothing, so
// the HTTP and SSE path is all that is measured (client included). One op is
// one token delivered.
func BenchmarkEngineStream(b *testing.B) {
	e, err := New(Config{Speedup: 1e9, Tokenizer: "cl100k_base"})
	if err != nil {
		b.Fatal(err)
	}
	addr, err := e.Start("127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	const conc, tokens = 32, 64
	reqs := b.N/tokens + 1
	bodies := make([][]byte, conc)
	for i := range bodies {
		bodies[i] = fmt.Appendf(nil, `{"prompt":[%d,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20],"max_tokens":%d,"ignore_eos":true,"stream":true}`, i, tokens)
	}
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	var wg sync.WaitGroup
	var next sync.Mutex
	left := reqs
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for {
				next.Lock()
				if left == 0 {
					next.Unlock()
					return
				}
				left--
				next.Unlock()
				resp, err := client.Post("http://"+addr+"/v1/completions", "application/json", bytes.NewReader(bodies[w]))
				if err != nil {
					b.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}(w)
	}
	wg.Wait()
	// CPU time of client and server together, per token.
	if cpu := cpuTime() - cpu0; cpu0 >= 0 && cpu > 0 {
		b.ReportMetric(float64(cpu.Nanoseconds())/float64(reqs*tokens), "cpu-ns/token")
	}
}
