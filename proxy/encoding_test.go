package proxy

import (
	"bytes"
	"compress/flate"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/valyala/fasthttp"
)

func postEncoded(t *testing.T, url, encoding string, body []byte) (int, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Content-Encoding", encoding)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("%s: answer is not JSON: %s", encoding, b)
	}
	return resp.StatusCode, out
}

// TestCompressedRequestBodies: a body sent with a Content-Encoding is
// decompressed before it is read, routed and forwarded (the engine gets
// plain JSON and no Content-Encoding), within the body limit; an unknown
// coding, a corrupt body and a decompression bomb get clear errors.
func TestCompressedRequestBodies(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	plain := []byte(chatBody)
	for _, tc := range []struct {
		encoding string
		body     []byte
	}{
		{"gzip", fasthttp.AppendGzipBytes(nil, plain)},
		{"GZIP", fasthttp.AppendGzipBytes(nil, plain)},
		{"x-gzip", fasthttp.AppendGzipBytes(nil, plain)},
		{"deflate", fasthttp.AppendDeflateBytes(nil, plain)},
		{"br", fasthttp.AppendBrotliBytes(nil, plain)},
		{"zstd", fasthttp.AppendZstdBytes(nil, plain)},
		{"deflate", rawDeflate(t, plain)}, // without the zlib wrapper, as some clients send it
		{"identity", plain},
	} {
		status, out := postEncoded(t, p.url+"/v1/chat/completions", tc.encoding, tc.body)
		if status != 200 || out["choices"] == nil {
			t.Fatalf("%s: %d %v", tc.encoding, status, out)
		}
		e.mu.Lock()
		fwd := e.bodies[len(e.bodies)-1]
		e.mu.Unlock()
		if fwd["model"] != "engine-m" || fwd["temperature"] != 0.5 {
			t.Fatalf("%s: the engine got %v", tc.encoding, fwd)
		}
	}

	bomb := fasthttp.AppendGzipBytes(nil, []byte(`{"model":"m","prompt":"`+strings.Repeat("a", 1<<20)+`"}`))
	if len(bomb) > 65536 {
		t.Fatalf("the bomb is %d bytes compressed, over the raw limit", len(bomb))
	}
	for _, tc := range []struct {
		encoding string
		body     []byte
		status   int
		code     string
	}{
		{"compress", plain, 415, "unsupported_content_encoding"},
		{"gzip", plain, 400, ""},
		{"br", plain, 400, ""},
		{"gzip", bomb, 413, "request_too_large"},
		{"zstd", zstdBytes(t, []byte(`{"model":"m","prompt":"`+strings.Repeat("a", 1<<20)+`"}`)), 413, "request_too_large"},
		{"zstd", plain, 400, ""},
		// A frame that asks for a 256 MiB window (zstd --long): refused.
		{"zstd", zstdBytes(t, plain, zstd.WithWindowSize(256<<20), zstd.WithSingleSegment(false)), 400, ""},
		{"deflate", rawDeflate(t, []byte(`{"model":"m","prompt":"`+strings.Repeat("a", 1<<20)+`"}`)), 413, "request_too_large"},
	} {
		status, out := postEncoded(t, p.url+"/v1/completions", tc.encoding, tc.body)
		errObj, _ := out["error"].(map[string]any)
		if status != tc.status || errObj == nil || errObj["message"] == "" || (tc.code != "" && errObj["code"] != tc.code) {
			t.Fatalf("%s: %d %v, want %d %s", tc.encoding, status, out, tc.status, tc.code)
		}
	}
	p.waitIdle(t)
}

func zstdBytes(t *testing.T, b []byte, opts ...zstd.EOption) []byte {
	t.Helper()
	var out bytes.Buffer
	w, err := zstd.NewWriter(&out, opts...)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(b)
	w.Close()
	return out.Bytes()
}

// zstd bodies over the limit leaked fasthttp's decoder (its goroutines and
// window, for good: 125 MB a request; found by the twelfth session's abuse
// trial). kvproxy decodes them itself now, and a run of them leaves nothing.
func TestZstdBombsLeaveNothingBehind(t *testing.T) {
	p := startProxy(t, "kv", startFake(t, "e0", nil))
	bomb := zstdBytes(t, []byte(`{"model":"m","prompt":"`+strings.Repeat("a", 8<<20)+`"}`))
	status, _ := postEncoded(t, p.url+"/v1/completions", "zstd", bomb)
	if status != 413 {
		t.Fatalf("a zstd bomb: %d", status)
	}
	runtime.GC()
	base := runtime.NumGoroutine()
	for range 20 {
		if status, out := postEncoded(t, p.url+"/v1/completions", "zstd", bomb); status != 413 {
			t.Fatalf("a zstd bomb: %d %v", status, out)
		}
		// Two collections empty a sync.Pool: fasthttp's pooled decoder,
		// still running, then lived on with nothing to reuse it.
		runtime.GC()
		runtime.GC()
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > base+4 {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines after 20 zstd bombs, %d before", runtime.NumGoroutine(), base)
		}
		time.Sleep(20 * time.Millisecond)
	}
	p.waitIdle(t)
}

func rawDeflate(t *testing.T, b []byte) []byte {
	var out bytes.Buffer
	w, err := flate.NewWriter(&out, flate.DefaultCompression)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(b)
	w.Close()
	return out.Bytes()
}

// TestCompressedEventsAndLookups: KV event pushes and index lookups are
// decompressed as completions are (they were parsed compressed: 400).
func TestCompressedEventsAndLookups(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n  - {id: e0, url: 'http://{{e0}}', model: m, kv_events: {mode: http}}\n", e)
	batch := `{"engine_id":"e0","events":[{"type":"block_stored","block_hashes":[1,2],"parent_block_hash":null,"token_ids":[` + tokenList(32) + `],"block_size":16}]}`
	if status, out := postEncoded(t, p.url+"/v1/kv_events", "gzip", fasthttp.AppendGzipBytes(nil, []byte(batch))); status != 200 {
		t.Fatalf("gzip event batch: %d %v", status, out)
	}
	resp, b := post(t, p.url+"/v1/completions", `{"model":"m","prompt":[`+tokenList(32)+`],"nvext":{"annotations":["query_instance_id"]}}`)
	var d struct {
		BlockHashes []string `json:"block_hashes"`
	}
	if err := json.Unmarshal([]byte(b), &d); err != nil || resp.StatusCode != 200 || len(d.BlockHashes) != 2 {
		t.Fatalf("dry run: %d %s", resp.StatusCode, b)
	}
	q, _ := json.Marshal(map[string]any{"model": "m", "hashes": d.BlockHashes})
	status, out := postEncoded(t, p.url+"/admin/index/lookup", "zstd", fasthttp.AppendZstdBytes(nil, q))
	if held, _ := out["held"].(map[string]any); status != 200 || held["e0"] != 2.0 {
		t.Fatalf("zstd lookup: %d %v", status, out)
	}
	if status, out := postEncoded(t, p.url+"/v1/kv_events", "compress", []byte(batch)); status != 415 {
		t.Fatalf("unknown coding: %d %v", status, out)
	}
}

// tokenList is "0,1,...,n-1".
func tokenList(n int) string {
	s := make([]string, n)
	for i := range s {
		s[i] = fmt.Sprint(i)
	}
	return strings.Join(s, ",")
}
