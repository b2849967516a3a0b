package proxy

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestPassthroughKeepsContentEncoding: a pass-through answer is relayed
// byte for byte, so the engine's Content-Encoding must go with it: a
// gzipped answer without it reaches the client as binary noise.
func TestPassthroughKeepsContentEncoding(t *testing.T) {
	const answer = `{"object":"list","data":[{"embedding":[0.5]}]}`
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzip.NewWriter(w)
		zw.Write([]byte(answer))
		zw.Close()
	})
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m}]\n")
	// Go's client asks for gzip and decodes it when the answer says so.
	resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"x"}`)
	if resp.StatusCode != 200 || string(b) != answer {
		t.Fatalf("gzipped answer: %d %q (Content-Encoding %q)", resp.StatusCode, b, resp.Header.Get("Content-Encoding"))
	}
	p.waitIdle(t)
}

// TestWholeAnswerFromAGzippingEngine: a non-streamed completion, or an
// error, that the engine gzipped anyway reaches the client plain (kvproxy
// reads it: cached_tokens, error reshaping); it went out as compressed
// bytes without their Content-Encoding.
func TestWholeAnswerFromAGzippingEngine(t *testing.T) {
	const answer = `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"hi"}],"usage":{"prompt_tokens":4,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":3}}}`
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		body := answer
		if r.URL.Path == "/v1/chat/completions" {
			w.WriteHeader(400)
			body = `{"object":"error","message":"bad temperature","type":"BadRequestError","param":"temperature","code":400}`
		}
		zw := gzip.NewWriter(w)
		zw.Write([]byte(body))
		zw.Close()
	})
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m}]\n")
	resp, b := postUndecoded(t, p.url+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 200 || string(b) != answer || resp.Header.Get("Content-Encoding") != "" {
		t.Fatalf("completion: %d %q (Content-Encoding %q)", resp.StatusCode, b, resp.Header.Get("Content-Encoding"))
	}
	if !strings.Contains(p.logs.String(), `"cached_tokens":3`) {
		t.Fatalf("cached tokens not read from the gzipped answer: %s", p.logs.String())
	}
	resp2, b2 := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	if resp2.StatusCode != 400 || !strings.Contains(string(b2), `"message":"bad temperature"`) || !strings.Contains(string(b2), `"error":{`) {
		t.Fatalf("error: %d %s", resp2.StatusCode, b2)
	}
	p.waitIdle(t)
}

// TestWholeAnswerCodings: a coding named in capitals is decompressed too;
// one kvproxy does not know reaches the client as it came, with its
// Content-Encoding: not as compressed bytes labelled plain JSON. A bomb
// beyond the whole-answer bound is a 502, as an answer that large plain
// is (it reached the client as it came, 1 GB once decoded: the verifying
// trial), and its decoding is charged to limits.body_memory_mb.
func TestWholeAnswerCodings(t *testing.T) {
	const answer = `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"hi"}]}`
	var zipped, bomb bytes.Buffer
	zw := gzip.NewWriter(&zipped)
	zw.Write([]byte(answer))
	zw.Close()
	zw = gzip.NewWriter(&bomb)
	zw.Write(make([]byte, 65<<20)) // zeros: 64 KiB compressed
	zw.Close()
	large := `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"` + strings.Repeat("x", 3<<20) + `"}]}`
	var largeZipped bytes.Buffer
	zw = gzip.NewWriter(&largeZipped)
	zw.Write([]byte(large))
	zw.Close()
	addr := startRawEngine(t, func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Prompt string }
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/json")
		switch req.Prompt {
		case "caps":
			w.Header().Set("Content-Encoding", "GZIP")
			w.Write(zipped.Bytes())
		case "alias":
			w.Header().Set("Content-Encoding", "x-gzip")
			w.Write(zipped.Bytes())
		case "custom":
			w.Header().Set("Content-Encoding", "x-custom")
			w.Write([]byte("opaque"))
		case "bomb":
			w.Header().Set("Content-Encoding", "gzip")
			w.Write(bomb.Bytes())
		case "large":
			w.Header().Set("Content-Encoding", "gzip")
			w.Write(largeZipped.Bytes())
		}
	})
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+addr+"', model: m}]\n")
	for _, c := range []struct{ prompt, body, coding string }{
		{"caps", answer, ""},
		{"alias", answer, ""},
		{"custom", "opaque", "x-custom"},
	} {
		resp, b := postUndecoded(t, p.url+"/v1/completions", `{"model":"m","prompt":"`+c.prompt+`"}`)
		if resp.StatusCode != 200 || string(b) != c.body || resp.Header.Get("Content-Encoding") != c.coding {
			t.Fatalf("%s: %d, %d bytes (want %d), Content-Encoding %q (want %q)", c.prompt, resp.StatusCode, len(b), len(c.body), resp.Header.Get("Content-Encoding"), c.coding)
		}
	}
	resp, b := postUndecoded(t, p.url+"/v1/completions", `{"model":"m","prompt":"bomb"}`)
	if resp.StatusCode != 502 || !strings.Contains(string(b), "once decompressed") || resp.Header.Get("Content-Encoding") != "" {
		t.Fatalf("bomb: %d %q, Content-Encoding %q", resp.StatusCode, b, resp.Header.Get("Content-Encoding"))
	}
	p.waitIdle(t)
	// An answer of 3 MiB, 3 KiB compressed, is charged as it decodes:
	// with less room than that in all, a 502 too; nothing stays charged.
	for _, limit := range []int64{64 << 20, 2 << 20} {
		p.s.bodyMem.SetLimit(limit)
		resp, b := postUndecoded(t, p.url+"/v1/completions", `{"model":"m","prompt":"large"}`)
		if limit > 2<<20 && (resp.StatusCode != 200 || len(b) != len(large)) || limit == 2<<20 && (resp.StatusCode != 502 || !strings.Contains(string(b), "once decompressed")) {
			t.Fatalf("3 MiB with %d MiB of room: %d %.200q", limit>>20, resp.StatusCode, b)
		}
		p.waitIdle(t)
		// Given back once fasthttp has written the answer, which the
		// client may have read whole a moment before.
		for deadline := time.Now().Add(5 * time.Second); p.s.bodyMem.Used() != 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d still charged", p.s.bodyMem.Used())
			}
		}
	}
}

// postUndecoded posts body and returns the answer's bytes as they came:
// Go's client would decode a gzip answer itself and hide a missing or
// wrong Content-Encoding.
func postUndecoded(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Accept-Encoding", "identity")
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}
