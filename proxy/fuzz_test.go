package proxy

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/kvproxy/kvproxy/config"
)

// frameAll cuts stream into events, reading it in pieces of the given sizes.
func frameAll(stream []byte, sizes []byte) (events [][]byte, pending []byte) {
	f := newSSEFramer(make([]byte, 8))
	k := 0
	for len(stream) > 0 {
		n := len(stream)
		if k < len(sizes) {
			n = min(n, int(sizes[k])%17+1)
			k++
		}
		free := f.free()
		n = min(n, len(free))
		copy(free, stream[:n])
		stream = stream[n:]
		f.commit(n)
		for {
			raw, content, ok := f.next()
			if !ok {
				break
			}
			if !bytes.HasPrefix(raw, content) {
				panic("content must be a prefix of the raw event")
			}
			events = append(events, append([]byte(nil), raw...))
		}
	}
	return events, append([]byte(nil), f.pending()...)
}

func TestSSEFramer(t *testing.T) {
	in := []byte("data: a\n\ndata: b\r\n\r\nevent: x\rdata: c\r\r: comment\n\ndata: tail")
	events, pending := frameAll(in, nil)
	want := []string{"data: a\n\n", "data: b\r\n\r\n", "event: x\rdata: c\r\r", ": comment\n\n"}
	if len(events) != len(want) {
		t.Fatalf("got %q", events)
	}
	for i := range want {
		if string(events[i]) != want[i] {
			t.Fatalf("event %d: %q, want %q", i, events[i], want[i])
		}
	}
	if string(pending) != "data: tail" {
		t.Fatalf("pending %q", pending)
	}
	// \r at the end of a read is undecided: \r\n\r\n must stay one terminator.
	events, _ = frameAll([]byte("data: x\r\n\r\ndata: y\n\n"), []byte{7, 0, 0, 0, 0})
	if len(events) != 2 || string(events[0]) != "data: x\r\n\r\n" {
		t.Fatalf("split \\r\\n: %q", events)
	}
}

// FuzzSSEFramer: the events and their inspection do not depend on how the
// stream is split into reads, and no byte is lost or invented.
func FuzzSSEFramer(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"), []byte{3, 5, 1})
	f.Add([]byte("data: a\r\n\r\ndata: b\r\r\n\n"), []byte{1, 1, 1, 1, 1, 1, 1, 1})
	f.Add([]byte(": keep-alive\n\nevent: error\ndata: {\"error\":{}}\n\n"), []byte{16})
	f.Add([]byte("\n\n\r\r\r\n\r\n"), []byte{0})
	f.Fuzz(func(t *testing.T, stream, sizes []byte) {
		whole, wholePending := frameAll(stream, nil)
		split, splitPending := frameAll(stream, sizes)
		if len(whole) != len(split) {
			t.Fatalf("%d events read whole, %d split", len(whole), len(split))
		}
		var joined []byte
		for i := range whole {
			if !bytes.Equal(whole[i], split[i]) {
				t.Fatalf("event %d differs: %q vs %q", i, whole[i], split[i])
			}
			joined = append(joined, whole[i]...)
		}
		joined = append(joined, wholePending...)
		if !bytes.Equal(joined, stream) || !bytes.Equal(wholePending, splitPending) {
			t.Fatal("bytes lost or invented")
		}
		for _, ev := range whole {
			carriesToken(ev)
			u := tokenUsage{-1, -1, -1}
			u.read(ev)
		}
	})
}

// FuzzParseRequest: any body gets a parsed request or a parameter error,
// never a panic; a parsed request re-encodes for the engine.
func FuzzParseRequest(f *testing.F) {
	f.Add([]byte(chatBody), true)
	f.Add([]byte(`{"model":"m","prompt":[1,2,3],"nvext":{"token_data":[4,5],"backend_instance_id":7}}`), false)
	f.Add([]byte(`{"model":"m","prompt":["a","b"]}`), false)
	f.Add([]byte(`{"model":"m","prompt":[[1,2],[3]]}`), false)
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url","image_url":{"url":"u"}}]}],"cache_salt":"evil"}`), true)
	f.Add([]byte(`{"model":"","messages":null}`), true)
	f.Add([]byte(`null`), false)
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		req, pe := parseRequest(body, chat)
		if (req == nil) == (pe == nil) {
			t.Fatal("want exactly one of a request and an error")
		}
		if pe != nil {
			if pe.msg == "" {
				t.Fatal("an error needs a message")
			}
			return
		}
		if req.model == "" && req.fields.Model != nil {
			t.Fatal("a model sent, and none read") // none sent is vLLM's one model (readModel)
		}
		req.nv.pinned()
		out, err := req.forwardBody(nil, "served", "salt")
		if err != nil {
			t.Fatalf("re-encoding failed: %v", err)
		}
		var fields, orig map[string]json.RawMessage
		if err := json.Unmarshal(out, &fields); err != nil {
			t.Fatalf("the engine body is not JSON: %v\n%s", err, out)
		}
		if _, ok := fields["nvext"]; ok || string(fields["model"]) != `"served"` || string(fields["cache_salt"]) != `"salt"` {
			t.Fatalf("engine body: nvext must go, model and cache_salt be ours: %s", out)
		}
		// The engine reads the stream flag the proxy relays by.
		if st := string(fields["stream"]); req.stream != (st == "true") {
			t.Fatalf("engine body: stream %q, the proxy read %v: %s", st, req.stream, out)
		}
		// Every other member reaches the engine unchanged ("Stream" too: the
		// proxy and the engine both leave it unread).
		if json.Unmarshal(body, &orig) == nil {
			for k, v := range orig {
				if k == "model" || k == "nvext" || k == "cache_salt" || k == "stream" {
					continue
				}
				if got, ok := fields[k]; !ok || !bytes.Equal(bytes.TrimSpace(got), bytes.TrimSpace(v)) {
					t.Fatalf("member %q changed on the way: %s -> %s", k, v, got)
				}
			}
		}
	})
}

// FuzzConfig: any YAML gets a config or an error, never a panic, and an
// accepted config validates again.
func FuzzConfig(f *testing.F) {
	f.Add([]byte("models: [{name: m}]\nbackends: [{id: a, url: 'http://127.0.0.1:1'}]\n"))
	f.Add([]byte("models: [{name: m, aliases: [x]}]\nbackends: [{id: a, url: 'http://h:1', kind: mock, mock: {cache_blocks: -1}}]\nrouter: {policy: kv}\n"))
	f.Add([]byte("listen: ${NOPE}\n"))
	f.Add([]byte("models:\n  - name: m\n    block_size: 99999\n"))
	f.Add([]byte("auth: {keys: [{key: short, tenant: t}]}\n"))
	f.Fuzz(func(t *testing.T, yaml []byte) {
		c, err := config.Parse(yaml)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error")
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("an accepted config fails validation: %v", err)
		}
	})
}
