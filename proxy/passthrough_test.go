package proxy

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestPassthroughEndpoints: embeddings, scoring, reranking and tokenizing
// requests reach an engine of their model at the same path, with the model
// rewritten to the engine's name, nvext and cache_salt dropped and the rest
// untouched; the engine's answer comes back as it was.
func TestPassthroughEndpoints(t *testing.T) {
	e0, e1 := startFake(t, "e0", nil), startFake(t, "e1", nil)
	p := startProxy(t, "kv", e0, e1)
	for path := range passthroughPaths {
		body := `{"model":"alias-m","input":["a b c",[1,2,3]],"encoding_format":"float","nvext":{"annotations":["query_instance_id"]},"cache_salt":"mine"}`
		req, _ := http.NewRequest("POST", p.url+path, strings.NewReader(body))
		req.Header.Set("X-Request-Id", "client-7")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var got struct{ Path, Model, Served_by string }
		json.NewDecoder(resp.Body).Decode(&got)
		resp.Body.Close()
		worker := resp.Header.Get(WorkerHeader)
		if resp.StatusCode != 200 || got.Path != path || got.Model != "engine-m" || got.Served_by != worker || resp.Header.Get("X-Request-Id") != "client-7" {
			t.Fatalf("%s: %d %+v from %q (request id %q)", path, resp.StatusCode, got, worker, resp.Header.Get("X-Request-Id"))
		}
		e := e0
		if worker == "e1" {
			e = e1
		}
		sent := e.lastBody()
		in, _ := json.Marshal(sent["input"])
		if _, ok := sent["nvext"]; ok || sent["cache_salt"] != nil || sent["encoding_format"] != "float" || string(in) != `["a b c",[1,2,3]]` {
			t.Fatalf("%s: the engine got %v", path, sent)
		}
	}
	p.waitIdle(t)
}

func TestPassthroughErrors(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	for _, c := range []struct {
		body   string
		status int
		param  string
	}{
		{`{"model":7,"input":"x"}`, 400, "model"},
		{`{"model":[],"input":"x"}`, 400, "model"},
		{`{"model":"nope","input":"x"}`, 404, "model"},
		{`["model","m"]`, 400, ""},
		{`{"model":"m",`, 400, ""},
		{``, 400, ""},
	} {
		resp, b := post(t, p.url+"/v1/embeddings", c.body)
		var answer struct {
			Error *struct{ Message, Type, Param string }
		}
		json.Unmarshal([]byte(b), &answer)
		if resp.StatusCode != c.status || answer.Error == nil || answer.Error.Param != c.param || answer.Error.Message == "" {
			t.Fatalf("%s: %d %s", c.body, resp.StatusCode, b)
		}
	}
	resp, err := http.Get(p.url + "/v1/embeddings")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 || resp.Header.Get("Allow") != "POST" {
		t.Fatalf("GET: %d, Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
	}
	if n := e.requests.Load(); n != 0 {
		t.Fatalf("the engine saw %d bad requests: %v %v", n, e.paths, e.bodies)
	}
	p.waitIdle(t)
}

// TestPassthroughWithoutModel: vLLM's pooling and tokenizing requests may
// leave the model out; with one model configured they go to it (a member
// spelt otherwise, "Model", is no model member), with several they are a
// 400 naming model.
func TestPassthroughWithoutModel(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	for _, body := range []string{`{"prompt":"x"}`, `{"Model":"m","prompt":"x"}`} {
		if resp, b := post(t, p.url+"/tokenize", body); resp.StatusCode != 200 || e.lastBody()["model"] != "engine-m" {
			t.Fatalf("%s: %d %s, the engine got %v", body, resp.StatusCode, b, e.lastBody())
		}
	}
	p.waitIdle(t)

	two := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml}, {name: n, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m}, {id: e1, url: 'http://{{e0}}', model: n}]\n", e)
	resp, b := post(t, two.url+"/tokenize", `{"prompt":"x"}`)
	var answer struct{ Error *struct{ Param string } }
	json.Unmarshal([]byte(b), &answer)
	if resp.StatusCode != 400 || answer.Error == nil || answer.Error.Param != "model" {
		t.Fatalf("two models, none named: %d %s", resp.StatusCode, b)
	}
}

// TestPassthroughLoadAndRetry: a pass-through request holds a load slot
// while it runs, so the next one goes to the other engine; an engine that
// refuses the connection is skipped, and an engine's own error comes back
// in OpenAI's shape.
func TestPassthroughLoadAndRetry(t *testing.T) {
	for _, policy := range []string{"kv", "least_load"} {
		slow := func(f *fakeEngine) { f.prefillDelay = 400 * time.Millisecond }
		e0, e1 := startFake(t, "e0", slow), startFake(t, "e1", slow)
		p := startProxy(t, policy, e0, e1)
		first := make(chan string, 1)
		go func() {
			resp, _ := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"one"}`)
			first <- resp.Header.Get(WorkerHeader)
		}()
		deadline := time.Now().Add(3 * time.Second)
		for e0.current.Load()+e1.current.Load() == 0 && time.Now().Before(deadline) {
			time.Sleep(2 * time.Millisecond)
		}
		resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"two"}`)
		if w := <-first; resp.StatusCode != 200 || w == "" || resp.Header.Get(WorkerHeader) == w {
			t.Fatalf("%s: both went to %q: %d %s", policy, w, resp.StatusCode, b)
		}
		p.waitIdle(t)
	}

	down, up := startFake(t, "down", nil), startFake(t, "up", nil)
	down.srv.Close()
	p := startProxy(t, "round_robin", down, up)
	for i := 0; i < 4; i++ {
		if resp, b := post(t, p.url+"/v1/rerank", `{"model":"m","query":"q","documents":["a","b"]}`); resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "up" {
			t.Fatalf("request %d: %d from %q: %s", i, resp.StatusCode, resp.Header.Get(WorkerHeader), b)
		}
	}
	p.waitIdle(t)

	bad := startFake(t, "bad", func(f *fakeEngine) { f.status, f.errBody = 500, `{"detail":"pooling failed"}` })
	p = startProxy(t, "kv", bad)
	resp, b := post(t, p.url+"/v1/embeddings", `{"model":"m","input":"x"}`)
	var answer struct {
		Error *struct{ Message, Type string }
	}
	json.Unmarshal([]byte(b), &answer)
	if resp.StatusCode != 500 || answer.Error == nil || !strings.Contains(answer.Error.Message, "pooling failed") || resp.Header.Get(WorkerHeader) != "bad" {
		t.Fatalf("engine error: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// TestTraceContextReachesTheEngine: W3C trace context and baggage go on to
// the engine (vLLM joins the client's trace with them); the client's other
// headers, its API key above all, do not.
func TestTraceContextReachesTheEngine(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	for _, path := range []string{"/v1/chat/completions", "/v1/embeddings"} {
		req, _ := http.NewRequest("POST", p.url+path, strings.NewReader(chatBody))
		req.Header.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
		req.Header.Set("tracestate", "congo=t61rcWkgMzE")
		req.Header.Set("baggage", "userId=alice")
		req.Header.Set("Authorization", "Bearer client-secret")
		req.Header.Set("X-Custom", "1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		e.mu.Lock()
		h := e.headers[len(e.headers)-1]
		e.mu.Unlock()
		if resp.StatusCode != 200 || h.Get("Traceparent") != "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" ||
			h.Get("Tracestate") != "congo=t61rcWkgMzE" || h.Get("Baggage") != "userId=alice" || h.Get("Authorization") != "" || h.Get("X-Custom") != "" {
			t.Fatalf("%s: %d, the engine got %v", path, resp.StatusCode, h)
		}
	}
	p.waitIdle(t)
}

// TestPassthroughBodyBrokenOff: an engine that dies partway through a
// pass-through answer cuts the client's answer short (an error for any
// HTTP client, never a shorter body taken for whole) and is ejected (one
// of two: a model's only one is not); a client that leaves partway through cancels the engine's answer. Either
// way the load is freed.
func TestPassthroughBodyBrokenOff(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var cancelled atomic.Int64
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Input string }
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/json")
		switch req.Input {
		case "sized", "chunked":
			if req.Input == "sized" {
				w.Header().Set("Content-Length", "100000")
			}
			w.Write([]byte(`{"object":"list","data":[{"embedding":[0.5,`))
			w.(http.Flusher).Flush()
			c, _, _ := w.(http.Hijacker).Hijack()
			c.Close()
		case "parts":
			for _, part := range []string{`{"object":"list",`, `"data":[]}`} {
				w.Write([]byte(part))
				w.(http.Flusher).Flush()
			}
		case "endless":
			for {
				if _, err := w.Write(bytes.Repeat([]byte("0.5,"), 4096)); err != nil {
					cancelled.Add(1)
					return
				}
				w.(http.Flusher).Flush()
				time.Sleep(5 * time.Millisecond)
			}
		default:
			w.Write([]byte(`{"object":"list","data":[]}`))
		}
	})}
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	go srv.Serve(ln2)
	t.Cleanup(func() { srv.Close() })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends: [{id: e0, url: 'http://"+ln.Addr().String()+"', model: m}, {id: e1, url: 'http://"+ln2.Addr().String()+"', model: m}]\n"+
		"health: {eject_base: 50ms, eject_max: 50ms}\n")
	for _, input := range []string{"sized", "chunked"} {
		// The client learns of the break when the headers or the body end
		// early, whichever fasthttp had sent.
		resp, err := http.Post(p.url+"/v1/embeddings", "application/json", strings.NewReader(`{"model":"m","input":"`+input+`"}`))
		if err == nil {
			b, rerr := io.ReadAll(resp.Body)
			resp.Body.Close()
			if rerr == nil {
				t.Fatalf("%s: the broken answer read as whole: %d %q", input, resp.StatusCode, b)
			}
		}
		p.waitIdle(t)
		if !ejected(p, "e0") && !ejected(p, "e1") {
			t.Fatalf("%s: the engine that broke off is still in", input)
		}
		for ejected(p, "e0") || ejected(p, "e1") { // back after eject_base
			time.Sleep(5 * time.Millisecond)
		}
	}

	// A chunked answer to an HTTP/1.0 client: the body as it was, ended by
	// closing the connection.
	body := `{"model":"m","input":"parts"}`
	c := rawPost(t, p, "HTTP/1.0", "/v1/embeddings", body)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	raw, err := io.ReadAll(c)
	c.Close()
	if err != nil || !bytes.HasPrefix(raw, []byte("HTTP/1.0 200")) && !bytes.HasPrefix(raw, []byte("HTTP/1.1 200")) ||
		!bytes.HasSuffix(raw, []byte("\r\n\r\n"+`{"object":"list","data":[]}`)) || bytes.Contains(raw, []byte("chunked")) {
		t.Fatalf("HTTP/1.0: %v %q", err, raw)
	}
	p.waitIdle(t)

	body = `{"model":"m","input":"endless"}`
	c = rawPost(t, p, "HTTP/1.1", "/v1/embeddings", body)
	if _, err := io.ReadFull(c, make([]byte, 64<<10)); err != nil {
		t.Fatalf("the endless answer did not flow: %v", err)
	}
	c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for cancelled.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the engine kept writing after the client left")
		}
		time.Sleep(5 * time.Millisecond)
	}
	p.waitIdle(t)
	if ejected(p, "e0") {
		t.Fatal("a client leaving ejected the engine")
	}
}

// TestCompletionsWithoutModel: chat and completions may leave the model
// out (or send null), as vLLM allows: with one model configured they go to
// it; with several they are a 400 naming model (from the eighth session's
// trial).
func TestCompletionsWithoutModel(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxy(t, "kv", e)
	for path, body := range map[string]string{
		"/v1/chat/completions": `{"messages":[{"role":"user","content":"hi"}]}`,
		"/v1/completions":      `{"model":null,"prompt":"hi","stream":true}`,
		"/v1/embeddings":       `{"model":"","input":"hi"}`,
	} {
		if resp, b := post(t, p.url+path, body); resp.StatusCode != 200 || e.lastBody()["model"] != "engine-m" {
			t.Fatalf("%s %s: %d %s, the engine got %v", path, body, resp.StatusCode, b, e.lastBody())
		}
	}
	p.waitIdle(t)

	two := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml}, {name: n, tokenizer: cl100k_base, template: chatml}]\n"+
		"backends: [{id: e0, url: 'http://{{e0}}', model: m}, {id: e1, url: 'http://{{e0}}', model: n}]\n", e)
	resp, b := post(t, two.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`)
	var answer struct {
		Error *struct{ Param, Message string }
	}
	json.Unmarshal([]byte(b), &answer)
	if resp.StatusCode != 400 || answer.Error == nil || answer.Error.Param != "model" || !strings.Contains(answer.Error.Message, "several models") {
		t.Fatalf("two models, none named: %d %s", resp.StatusCode, b)
	}
}

// An engine answer without a Content-Type is not given fasthttp's default
// (text/plain): a chat answer is JSON, and a pass-through answer goes
// without one, as it came (the HTTP trial).
func TestAnswerWithoutContentType(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil // no sniffing: none sent
		if r.URL.Path == "/health" {
			return
		}
		io.Copy(io.Discard, r.Body)
		w.Write([]byte(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`))
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	e := &fakeEngine{id: "e0", addr: ln.Addr().String()}
	p := startProxyYAML(t, "models: [{name: m}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\n", e)
	for path, want := range map[string]string{"/v1/chat/completions": "application/json", "/v1/embeddings": ""} {
		resp, b := post(t, p.url+path, `{"model":"m","messages":[{"role":"user","content":"hi"}],"input":"hi"}`)
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != want {
			t.Errorf("%s: %d, Content-Type %q, want %q: %s", path, resp.StatusCode, resp.Header.Get("Content-Type"), want, b)
		}
	}
}
