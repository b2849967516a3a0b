package tokenize

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
)

func conversation(turns int) []Message {
	msgs := []Message{{Role: "system", Content: "You are a helpful assistant. Answer in full sentences."}}
	for i := 0; i < turns; i++ {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, Message{Role: role, Content: fmt.Sprintf("Turn %d: %s", i, longText(60+i))})
	}
	return msgs
}

// coldEncode tokenizes each piece without any cache: the reference for the
// Encoder's output.
func coldEncode(tok Tokenizer, tmpl Template, msgs []Message, gen bool) []uint32 {
	return coldEncodeTools(tok, tmpl, msgs, "", gen)
}

func coldEncodeTools(tok Tokenizer, tmpl Template, msgs []Message, tools string, gen bool) []uint32 {
	var ids []uint32
	ps, err := tmpl.pieces(nil, msgs, tools, gen)
	if err != nil {
		panic(err)
	}
	for _, p := range ps {
		if p.literal {
			ids = tok.Encode(ids, p.msg.Content)
		} else {
			ids = tok.Encode(ids, string(tmpl.appendMessage(nil, p.msg)))
		}
	}
	return ids
}

func TestEncodeChatCachedEqualsCold(t *testing.T) {
	for _, tn := range []string{"cl100k_base", "o200k_base"} {
		for _, tm := range []string{"chatml", "llama3", "raw"} {
			tok := mustGet(t, tn)
			tmpl, _ := GetTemplate(tm)
			enc := NewEncoder(tok, tmpl, 0)
			msgs := conversation(12)
			for n := 1; n <= len(msgs); n++ {
				want := coldEncode(tok, tmpl, msgs[:n], true)
				first := enc.EncodeChat(nil, msgs[:n], true)
				again := enc.EncodeChat([]uint32{}, msgs[:n], true)
				if !slices.Equal(first, want) || !slices.Equal(again, want) {
					t.Fatalf("%s/%s turn %d: cached encode differs from cold encode", tn, tm, n)
				}
			}
		}
	}
}

func TestEncodeChatMatchesWholeRenderForChatml(t *testing.T) {
	// chatml message boundaries are "\n" followed by "<": the tiktoken
	// pre-tokenizer splits there anyway, so per-message == whole text.
	tok := mustGet(t, "cl100k_base")
	tmpl, _ := GetTemplate("chatml")
	msgs := conversation(6)
	got := NewEncoder(tok, tmpl, 0).EncodeChat(nil, msgs, true)
	text, err := Render(tmpl, msgs, true)
	if err != nil {
		t.Fatal(err)
	}
	want := tok.Encode(nil, text)
	if !slices.Equal(got, want) {
		t.Fatalf("per-message encode differs from whole render")
	}
}

func TestEncodeChatRoleIsPartOfKey(t *testing.T) {
	tok := mustGet(t, "cl100k_base")
	tmpl, _ := GetTemplate("chatml")
	enc := NewEncoder(tok, tmpl, 0)
	u := enc.EncodeChat(nil, []Message{{Role: "user", Content: "same text"}}, false)
	a := enc.EncodeChat(nil, []Message{{Role: "assistant", Content: "same text"}}, false)
	if slices.Equal(u, a) {
		t.Fatal("user and assistant messages with the same content share ids")
	}
	if want := coldEncode(tok, tmpl, []Message{{Role: "assistant", Content: "same text"}}, false); !slices.Equal(a, want) {
		t.Fatalf("got %v want %v", a, want)
	}
}

func TestEncoderCacheIsBounded(t *testing.T) {
	tok := mustGet(t, "cl100k_base")
	tmpl, _ := GetTemplate("chatml")
	enc := NewEncoder(tok, tmpl, 64) // one entry per shard
	for i := 0; i < 2000; i++ {
		m := []Message{{Role: "user", Content: fmt.Sprintf("message number %d", i)}}
		if got, want := enc.EncodeChat(nil, m, true), coldEncode(tok, tmpl, m, true); !slices.Equal(got, want) {
			t.Fatalf("message %d: got %v want %v", i, got, want)
		}
	}
	total := 0
	for i := range enc.shards {
		total += len(enc.shards[i].index)
		if len(enc.shards[i].index) != len(enc.shards[i].entries) || len(enc.shards[i].entries) > 1 {
			t.Fatalf("shard %d holds %d index / %d entries, max 1", i, len(enc.shards[i].index), len(enc.shards[i].entries))
		}
	}
	if total == 0 || total > 64 {
		t.Fatalf("cache holds %d entries, want 1..64", total)
	}
}

func TestEncoderCacheBudget(t *testing.T) {
	tok := mustGet(t, "cl100k_base")
	tmpl := mustTemplate(t, "raw")
	enc := NewEncoder(tok, tmpl, 2*cacheShards) // 2 entries, 16 KiB per shard
	for i := range 300 {
		m := []Message{{Role: "user", Content: fmt.Sprintf("%d %s", i, longText(100+i%300))}} // ~150 to ~600 tokens
		if got, want := enc.EncodeChat(nil, m, false), coldEncode(tok, tmpl, m, false); !slices.Equal(got, want) {
			t.Fatalf("message %d differs", i)
		}
	}
	cached := 0
	for i := range enc.shards {
		s := &enc.shards[i]
		sum := 0
		for j := range s.entries {
			sum += s.entries[j].size()
		}
		if sum != s.bytes || s.bytes > s.budget || len(s.index) > s.max {
			t.Fatalf("shard %d: %d bytes (counted %d), budget %d, %d entries", i, sum, s.bytes, s.budget, len(s.index))
		}
		cached += len(s.index)
	}
	if cached == 0 {
		t.Fatal("nothing cached")
	}
}

func TestEncodeTextEqualsTokenizer(t *testing.T) {
	tok := mustGet(t, "o200k_base")
	enc := NewEncoder(tok, mustTemplate(t, "raw"), 0)
	text := longText(300)
	if !slices.Equal(enc.EncodeText(nil, text), tok.Encode(nil, text)) {
		t.Fatal("EncodeText differs from Tokenizer.Encode")
	}
	if enc.Tokenizer() != tok {
		t.Fatal("Tokenizer() returned a different tokenizer")
	}
}

func TestEncoderConcurrentUse(t *testing.T) {
	tok := mustGet(t, "cl100k_base")
	tmpl := mustTemplate(t, "llama3")
	enc := NewEncoder(tok, tmpl, 128) // small: exercises eviction under contention
	convs := make([][]Message, 8)
	wants := make([][]uint32, 8)
	for i := range convs {
		convs[i] = conversation(4 + i)
		convs[i][0].Content += fmt.Sprint(i)
		wants[i] = coldEncode(tok, tmpl, convs[i], true)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			var buf []uint32
			for i := 0; i < 40; i++ {
				c := (g + i) % len(convs)
				buf = enc.EncodeChat(buf[:0], convs[c], true)
				if !slices.Equal(buf, wants[c]) {
					errs <- fmt.Errorf("goroutine %d iteration %d: wrong ids for conversation %d", g, i, c)
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func mustTemplate(t testing.TB, name string) Template {
	t.Helper()
	tmpl, err := GetTemplate(name)
	if err != nil {
		t.Fatal(err)
	}
	return tmpl
}

// longText returns deterministic English-and-code-like text of about n words.
func longText(n int) string {
	words := []string{"the", "router", "sends", "each", "request", "to", "engine", "holding", "its",
		"longest", "cached", "prefix,", "weighing", "load", "against", "reuse.", "func", "main()", "{",
		"return", "x", "+", "42;", "}", "KV-cache", "blocks", "of", "16", "tokens", "héllo", "世界", "🙂"}
	b := make([]byte, 0, n*7)
	seed := uint32(n)
	for i := 0; i < n; i++ {
		seed = seed*1664525 + 1013904223
		if i > 0 {
			if seed>>28 == 0 {
				b = append(b, '\n')
			} else {
				b = append(b, ' ')
			}
		}
		b = append(b, words[(seed>>8)%uint32(len(words))]...)
	}
	return string(b)
}

// An encoding with a limit stops soon after passing it (at the next
// pre-tokenized word), says so, and leaves nothing half-done in the cache;
// within the limit it is the plain encoding (found by the twelfth
// session's abuse trial: a prompt far over max_prompt_tokens was tokenized
// whole before it was refused, 13 s of CPU for 16 MB).
func TestEncodeLimitStopsEarly(t *testing.T) {
	hf, err := LoadHF(tinyHF(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	long := []Message{{Role: "user", Content: longText(20000)}}
	for name, tok := range map[string]Tokenizer{"cl100k_base": mustGet(t, "cl100k_base"), "tokenizer.json": hf} {
		tmpl, _ := GetTemplate("chatml")
		want := coldEncode(tok, tmpl, long, true)
		enc := NewEncoder(tok, tmpl, 0)
		got, ok := enc.EncodeChatToolsLimit(nil, long, "", true, 100)
		if ok || len(got) > 200 || len(want) < 10000 {
			t.Fatalf("%s: limit 100 of %d ids: ok %v after %d ids", name, len(want), ok, len(got))
		}
		if got, ok := enc.EncodeChatToolsLimit(nil, long, "", true, len(want)); !ok || !slices.Equal(got, want) {
			t.Fatalf("%s: at the limit: ok %v, %d ids of %d", name, ok, len(got), len(want))
		}
		if got, ok := enc.EncodeChatToolsLimit(nil, long, "", true, len(want)-1); ok || len(got) != len(want) {
			t.Fatalf("%s: one over the limit: ok %v, %d ids", name, ok, len(got))
		}
		if got := enc.EncodeChat(nil, long, true); !slices.Equal(got, want) {
			t.Fatalf("%s: after stopped encodings, the cache gives %d ids of %d", name, len(got), len(want))
		}
		text := long[0].Content
		full := enc.EncodePrompt(nil, text)
		if got, ok := enc.EncodePromptLimit(nil, text, 50); ok || len(got) > 150 {
			t.Fatalf("%s: a prompt over the limit: ok %v after %d ids", name, ok, len(got))
		}
		if got, ok := enc.EncodePromptLimit(nil, text, len(full)); !ok || !slices.Equal(got, full) {
			t.Fatalf("%s: a prompt at the limit: ok %v", name, ok)
		}
	}
}

// A word of megabytes (letters with no break) is merged in slices of
// maxWordBytes, cut at a rune's start, so a limit stops it after one slice
// (the abuse trial's 16 MB of random letters, one word, took 13.5 s to
// refuse); within a slice nothing changes.
func TestHugeWordsAreMergedInSlices(t *testing.T) {
	hf, err := LoadHF(tinyHF(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	r := uint32(1)
	word := make([]byte, 3*maxWordBytes+1000)
	for i := range word {
		r = r*1664525 + 1013904223
		word[i] = byte('a' + r>>24%26)
	}
	word[maxWordBytes-1] = 0xc3 // é across the first cut: it must not split the rune
	word[maxWordBytes] = 0xa9
	text := string(word)
	for name, tok := range map[string]Tokenizer{"cl100k_base": mustGet(t, "cl100k_base"), "tokenizer.json": hf} {
		var want []uint32
		for rest := text; len(rest) > 0; {
			k := wordSlice(rest)
			want = tok.Encode(want, rest[:k])
			rest = rest[k:]
		}
		if got := tok.Encode(nil, text); !slices.Equal(got, want) {
			t.Fatalf("%s: %d ids, want the slices' %d", name, len(got), len(want))
		}
		got, ok := encodeLimit(tok, nil, text, 1000)
		if ok || len(got) >= len(want)/2 {
			t.Fatalf("%s: limit 1000: ok %v after %d ids of %d", name, ok, len(got), len(want))
		}
	}
	if k := wordSlice(text); k != maxWordBytes-1 {
		t.Fatalf("the first cut is at %d, want %d (before the é)", k, maxWordBytes-1)
	}
}

// The cache's budget counts the text an entry keeps, not only its ids: a
// run of spaces is 128 bytes a token, and a budget of ids let it hold
// about 2 GiB (found by a security review: 24 dry runs of 8 MB of spaces
// left 460 MB in use).
func TestEncoderCacheBoundsBytes(t *testing.T) {
	tok := mustGet(t, "cl100k_base")
	tmpl := mustTemplate(t, "raw")
	enc := NewEncoder(tok, tmpl, cacheShards) // one entry, 8 KiB per shard
	for i := range 100 {
		m := []Message{{Role: "user", Content: fmt.Sprint(i) + strings.Repeat(" ", 30_000) + "x"}} // ~240 tokens
		if got, want := enc.EncodeChat(nil, m, false), coldEncode(tok, tmpl, m, false); !slices.Equal(got, want) {
			t.Fatalf("message %d differs", i)
		}
	}
	held := 0
	for i := range enc.shards {
		for j := range enc.shards[i].entries {
			held += enc.shards[i].entries[j].size()
		}
	}
	if limit := cacheShards * CacheBytesPerEntry; held > limit {
		t.Fatalf("the cache holds %d bytes, more than its %d", held, limit)
	}
}

// A message cached for one scope (a tenant's cache namespace) is not
// served to another: the time a request takes must not tell a tenant what
// another one sent (found by a security review: 280 KB took 1.5-2.7 ms when
// another tenant had sent it, 3.7-7.8 ms when not). The same scope hits.
func TestEncoderCacheIsPerScope(t *testing.T) {
	tok := mustGet(t, "cl100k_base")
	for _, name := range []string{"chatml", "raw"} {
		tmpl := mustTemplate(t, name)
		enc := NewEncoder(tok, tmpl, 0)
		m := []Message{{Role: "user", Content: "a secret only tenant A sent " + longText(200)}}
		const a, b CacheScope = 0x1111, 0x2222
		want := coldEncode(tok, tmpl, m, true)
		if got, _ := enc.EncodeChatToolsLimitIn(a, nil, m, "", true, math.MaxInt); !slices.Equal(got, want) {
			t.Fatalf("%s: scope A's tokens differ", name)
		}
		cached := func(scope CacheScope) bool {
			for _, p := range mustPieces(t, tmpl, m) {
				key := pieceKey(scope, &p)
				if _, ok := enc.shards[key>>(64-cacheShardBits)].get(key, scope, &p); ok {
					return true
				}
			}
			return false
		}
		if !cached(a) {
			t.Fatalf("%s: scope A's message is not cached for A", name)
		}
		if cached(b) || cached(0) {
			t.Fatalf("%s: scope A's message is served from the cache to another scope", name)
		}
		if got, _ := enc.EncodeChatToolsLimitIn(b, nil, m, "", true, math.MaxInt); !slices.Equal(got, want) {
			t.Fatalf("%s: scope B's tokens differ", name)
		}
		if !cached(b) {
			t.Fatalf("%s: scope B's message is not cached for B", name)
		}
	}
}

func mustPieces(t *testing.T, tmpl Template, msgs []Message) []piece {
	t.Helper()
	ps, err := tmpl.pieces(nil, msgs, "", true)
	if err != nil {
		t.Fatal(err)
	}
	for i := range ps {
		if ps[i].split { // cached as the literal runs between added tokens
			ps[i] = piece{msg: Message{Content: ps[i].msg.Content}, literal: true}
		}
	}
	return ps
}
