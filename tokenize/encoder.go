package tokenize

import (
	"errors"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// DefaultCacheEntries is the number of cached message renderings when
// NewEncoder is given cacheEntries <= 0.
const DefaultCacheEntries = 16384

// CacheBytesPerEntry bounds the cache's memory: it holds at most
// cacheEntries × CacheBytesPerEntry bytes (128 MiB by default), counting
// each entry's token ids (4 bytes each) and the text it keeps to compare
// (role, content, tool calls), and never one piece above a quarter of a
// shard's share of that. A budget of ids alone let text of 128 bytes a
// token (a run of spaces) hold about 2 GiB (found by a security review).
const CacheBytesPerEntry = 8 << 10

// CacheScope is the cache namespace a message is tokenized in: a message's
// cached tokens serve only requests of the same scope, so the time a
// request takes tells nothing of what another scope's requests sent. The
// proxy gives each tenant's cache namespace its own scope (tenants with
// shared_cache share one), as it does for the KV index.
type CacheScope uint64

const (
	cacheShardBits = 6
	cacheShards    = 1 << cacheShardBits
)

// Encoder turns chat messages and prompt text into token ids with one
// tokenizer and one chat template. It caches the tokens of each rendered
// message (bounded, CLOCK eviction), so a conversation's earlier turns are
// not tokenized again. It is safe for concurrent use; the cache is sharded,
// and a cache hit takes one shard's read lock.
//
// With a built-in template each message is tokenized on its own, so the ids
// at a boundary between two messages can differ from tokenizing the whole
// rendered text when a tiktoken encoding would merge across it (never for
// chatml, whose boundaries the pre-tokenizer splits anyway); the result is
// deterministic, which is what prefix matching needs. With a model's own
// template the rendered conversation is cut at the tokenizer's added
// tokens, where the model's tokenizer cuts it too, and each run of text
// between them is cached: the ids are exactly the engine's.
type Encoder struct {
	tok     Tokenizer
	tmpl    Template
	shards  [cacheShards]cacheShard
	scratch sync.Pool // *encScratch
}

type encScratch struct {
	pieces []piece
	buf    []byte
}

// NewEncoder returns an Encoder caching up to cacheEntries message
// renderings (DefaultCacheEntries if cacheEntries <= 0).
func NewEncoder(tok Tokenizer, tmpl Template, cacheEntries int) *Encoder {
	if cacheEntries <= 0 {
		cacheEntries = DefaultCacheEntries
	}
	per := (cacheEntries + cacheShards - 1) / cacheShards
	e := &Encoder{tok: tok, tmpl: tmpl}
	for i := range e.shards {
		e.shards[i].init(per, per*CacheBytesPerEntry)
	}
	e.scratch.New = func() any { return new(encScratch) }
	return e
}

// CacheBytes reports what the message cache holds and may hold, in bytes as
// its budget counts them (token ids and the text they are compared by).
func (e *Encoder) CacheBytes() (held, budget int) {
	for i := range e.shards {
		s := &e.shards[i]
		s.mu.RLock()
		held += s.bytes
		budget += s.budget
		s.mu.RUnlock()
	}
	return held, budget
}

// Tokenizer returns the Encoder's tokenizer.
func (e *Encoder) Tokenizer() Tokenizer { return e.tok }

// Template returns the Encoder's chat template.
func (e *Encoder) Template() Template { return e.tmpl }

// EncodeText appends the token ids of text as Tokenizer().Encode does
// (add_special_tokens=False: no BOS is added). It is not cached.
func (e *Encoder) EncodeText(dst []uint32, text string) []uint32 {
	return e.tok.Encode(dst, text)
}

// EncodePrompt appends the token ids of a completions prompt as an engine
// encodes it (add_special_tokens=True): with a tokenizer.json whose
// post-processor adds special tokens around a sequence (Llama 3's BOS),
// they are added; tiktoken encodings add none. It is not cached.
func (e *Encoder) EncodePrompt(dst []uint32, text string) []uint32 {
	dst, _ = e.EncodePromptLimit(dst, text, math.MaxInt)
	return dst
}

// EncodePromptLimit is EncodePrompt that stops once dst would hold more
// than limit ids, and then reports false (dst holds some of the ids, more
// than limit, or fewer when the text's length in bytes alone proves it
// over the limit: no token is longer than the vocabulary's longest): a
// prompt over a limit costs no more to refuse than one at the limit costs
// to read.
func (e *Encoder) EncodePromptLimit(dst []uint32, text string, limit int) ([]uint32, bool) {
	prefix, suffix := PromptSpecialTokens(e.tok)
	dst = append(dst, prefix...)
	dst, ok := encodeLimit(e.tok, dst, text, limit)
	if !ok {
		return dst, false
	}
	dst = append(dst, suffix...)
	return dst, len(dst) <= limit
}

// limitEncoder is a Tokenizer that can stop early (encodeLimit).
type limitEncoder interface {
	encodeLimit(dst []uint32, text string, limit int) ([]uint32, bool)
}

// encodeLimit appends the ids of text to dst, stopping once dst holds more
// than limit (between two pre-tokenized words, where tok can); it reports
// whether dst holds all of them within the limit.
func encodeLimit(tok Tokenizer, dst []uint32, text string, limit int) ([]uint32, bool) {
	if le, ok := tok.(limitEncoder); ok {
		return le.encodeLimit(dst, text, limit)
	}
	dst = tok.Encode(dst, text)
	return dst, len(dst) <= limit
}

// PromptSpecialTokens returns the ids a tokenizer adds before and after a
// prompt with add_special_tokens=True: a tokenizer.json's TemplateProcessing
// post-processor (such as Llama 3's <|begin_of_text|>); none for tiktoken
// encodings. The slices must not be modified.
func PromptSpecialTokens(tok Tokenizer) (prefix, suffix []uint32) {
	if s, ok := tok.(interface{ specialTokensAround() ([]uint32, []uint32) }); ok {
		return s.specialTokensAround()
	}
	return nil, nil
}

// EncodeChat appends the token ids of msgs rendered with the Encoder's
// template, followed by the generation prompt when addGenerationPrompt is
// set. Messages seen before (same role and content) come from the cache.
// If the template refuses the conversation (a model template's
// raise_exception), EncodeChat falls back to the raw concatenated contents,
// still deterministic for routing; use TryEncodeChat to see the error.
func (e *Encoder) EncodeChat(dst []uint32, msgs []Message, addGenerationPrompt bool) []uint32 {
	return e.EncodeChatTools(dst, msgs, "", addGenerationPrompt)
}

// EncodeChatTools is EncodeChat for a request with tools: their JSON (an
// array), which a model's own template renders as vLLM passes them to it.
func (e *Encoder) EncodeChatTools(dst []uint32, msgs []Message, tools string, addGenerationPrompt bool) []uint32 {
	out, _ := e.EncodeChatToolsLimit(dst, msgs, tools, addGenerationPrompt, math.MaxInt)
	return out
}

// EncodeChatToolsLimit is EncodeChatTools that stops once dst would hold
// more than limit ids, and then reports false (see EncodePromptLimit).
func (e *Encoder) EncodeChatToolsLimit(dst []uint32, msgs []Message, tools string, addGenerationPrompt bool, limit int) ([]uint32, bool) {
	return e.EncodeChatToolsLimitIn(0, dst, msgs, tools, addGenerationPrompt, limit)
}

// EncodeChatToolsLimitIn is EncodeChatToolsLimit in a cache scope: only
// messages cached in the same scope are reused (see CacheScope).
func (e *Encoder) EncodeChatToolsLimitIn(scope CacheScope, dst []uint32, msgs []Message, tools string, addGenerationPrompt bool, limit int) ([]uint32, bool) {
	out, err := e.tryEncodeChat(scope, dst, msgs, tools, addGenerationPrompt, limit)
	switch {
	case errors.Is(err, errTooLong):
		return out, false
	case err != nil:
		ps, _ := rawTemplate{}.pieces(nil, msgs, tools, false)
		out = dst
		for i := range ps {
			var ok bool
			if out, ok = e.encodePiece(scope, out, &ps[i], nil, limit); !ok {
				return out, false
			}
		}
	}
	return out, true
}

// errTooLong stops an encoding at its limit.
var errTooLong = errors.New("more token ids than the limit")

// TryEncodeChat is EncodeChat returning the template's error (a model
// template that rejects the conversation, e.g. roles that do not
// alternate) instead of falling back; dst is returned unchanged with it.
func (e *Encoder) TryEncodeChat(dst []uint32, msgs []Message, addGenerationPrompt bool) ([]uint32, error) {
	return e.TryEncodeChatTools(dst, msgs, "", addGenerationPrompt)
}

// TryEncodeChatTools is TryEncodeChat for a request with tools.
func (e *Encoder) TryEncodeChatTools(dst []uint32, msgs []Message, tools string, addGenerationPrompt bool) ([]uint32, error) {
	return e.tryEncodeChat(0, dst, msgs, tools, addGenerationPrompt, math.MaxInt)
}

func (e *Encoder) tryEncodeChat(scope CacheScope, dst []uint32, msgs []Message, tools string, addGenerationPrompt bool, limit int) ([]uint32, error) {
	s := e.scratch.Get().(*encScratch)
	defer e.scratch.Put(s)
	defer clear(s.pieces) // drop references to request strings
	var err error
	s.pieces, err = e.tmpl.pieces(s.pieces[:0], msgs, tools, addGenerationPrompt)
	if err != nil {
		return dst, err
	}
	for i := range s.pieces {
		ok := true
		if p := &s.pieces[i]; p.split {
			dst, ok = e.encodeSplit(scope, dst, p.msg.Content, s, limit)
		} else {
			dst, ok = e.encodePiece(scope, dst, p, s, limit)
		}
		if !ok {
			return dst, errTooLong
		}
	}
	return dst, nil
}

// addedTokenSplitter is implemented by tokenizers with added tokens
// (tokenizer.json): text between two added tokens is tokenized
// independently of the rest.
type addedTokenSplitter interface {
	nextAdded(s string, i int) (textEnd, tokEnd int, id uint32)
}

// encodeSplit encodes a rendered conversation, caching each run of text
// between the tokenizer's added tokens (for a model template, roughly one
// message each).
func (e *Encoder) encodeSplit(scope CacheScope, dst []uint32, text string, s *encScratch, limit int) ([]uint32, bool) {
	sp, ok := e.tok.(addedTokenSplitter)
	if !ok {
		return e.encodePiece(scope, dst, &piece{msg: Message{Content: text}, literal: true}, s, limit)
	}
	for i := 0; i < len(text); {
		textEnd, tokEnd, id := sp.nextAdded(text, i)
		if textEnd > i {
			if dst, ok = e.encodePiece(scope, dst, &piece{msg: Message{Content: text[i:textEnd]}, literal: true}, s, limit); !ok {
				return dst, false
			}
		}
		if tokEnd > textEnd {
			dst = append(dst, id)
		}
		i = tokEnd
	}
	return dst, len(dst) <= limit
}

// encodePiece appends the ids of p, from scope's cache or encoded (and then
// cached, unless the limit stopped it); it reports whether dst holds no
// more than limit ids.
func (e *Encoder) encodePiece(scope CacheScope, dst []uint32, p *piece, s *encScratch, limit int) ([]uint32, bool) {
	key := pieceKey(scope, p)
	sh := &e.shards[key>>(64-cacheShardBits)]
	if ids, ok := sh.get(key, scope, p); ok {
		dst = append(dst, ids...)
		return dst, len(dst) <= limit
	}
	n := len(dst)
	var ok bool
	if p.literal {
		dst, ok = encodeLimit(e.tok, dst, p.msg.Content, limit)
	} else {
		if s == nil {
			s = &encScratch{}
		}
		s.buf = e.tmpl.appendMessage(s.buf[:0], p.msg)
		dst, ok = encodeLimit(e.tok, dst, unsafe.String(unsafe.SliceData(s.buf), len(s.buf)), limit)
	}
	if ok {
		sh.put(key, scope, p, dst[n:])
	}
	return dst, ok
}

// pieceKey hashes p in scope: the scope seeds the hash, so the same
// message lands in unrelated slots (and shards) in two scopes.
func pieceKey(scope CacheScope, p *piece) uint64 {
	seed := uint64(0x9e3779b97f4a7c15) ^ uint64(scope)*0xbf58476d1ce4e5b9
	if !p.literal {
		seed = xxh3.HashStringSeed(p.msg.Role, seed)
	}
	key := xxh3.HashStringSeed(p.msg.Content, seed)
	if !p.literal && p.msg.ToolCalls != "" {
		key = xxh3.HashStringSeed(p.msg.ToolCalls, key)
	}
	return key
}

type cacheShard struct {
	mu      sync.RWMutex
	index   map[uint64]int32 // key → position in entries
	entries []cacheEntry     // a slot with ids == nil is free
	max     int              // entries
	budget  int              // bytes held by all entries (entryBytes)
	bytes   int
	hand    int
	_       [64]byte // keep shards on separate cache lines
}

type cacheEntry struct {
	key     uint64
	scope   CacheScope
	literal bool
	role    string
	content string
	calls   string   // the message's ToolCalls
	ids     []uint32 // never modified once stored
	ref     atomic.Bool
}

func (s *cacheShard) init(max, budget int) {
	s.max, s.budget = max, budget
	s.index = make(map[uint64]int32, max)
	s.entries = make([]cacheEntry, 0, max)
}

// entryBytes is what an entry holding ids and p's text costs the budget.
func entryBytes(p *piece, ids int) int {
	n := 4*ids + len(p.msg.Content)
	if !p.literal {
		n += len(p.msg.Role) + len(p.msg.ToolCalls)
	}
	return n
}

func (c *cacheEntry) size() int {
	return 4*len(c.ids) + len(c.content) + len(c.role) + len(c.calls)
}

func (c *cacheEntry) matches(scope CacheScope, p *piece) bool {
	return c.scope == scope && c.literal == p.literal && c.content == p.msg.Content &&
		(p.literal || c.role == p.msg.Role && c.calls == p.msg.ToolCalls)
}

func (s *cacheShard) get(key uint64, scope CacheScope, p *piece) ([]uint32, bool) {
	s.mu.RLock()
	i, ok := s.index[key]
	if !ok {
		s.mu.RUnlock()
		return nil, false
	}
	c := &s.entries[i]
	if !c.matches(scope, p) { // hash collision
		s.mu.RUnlock()
		return nil, false
	}
	c.ref.Store(true)
	ids := c.ids
	s.mu.RUnlock()
	return ids, true
}

func (s *cacheShard) put(key uint64, scope CacheScope, p *piece, ids []uint32) {
	size := entryBytes(p, len(ids))
	if len(ids) == 0 || size > s.budget/4 { // not worth a slot, or would flush the shard
		return
	}
	stored := cacheEntry{
		key:     key,
		scope:   scope,
		literal: p.literal,
		content: strings.Clone(p.msg.Content), // never pin a request buffer
		ids:     slices.Clone(ids),
	}
	if !p.literal {
		stored.role = strings.Clone(p.msg.Role)
		stored.calls = strings.Clone(p.msg.ToolCalls)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if i, ok := s.index[key]; ok { // raced with another miss, or a collision
		s.evict(int(i))
	}
	slot := -1
	if len(s.entries) < s.max {
		s.entries = append(s.entries, cacheEntry{})
		slot = len(s.entries) - 1
	}
	// CLOCK: skip (and clear) recently used entries, evict cold ones until
	// there is a slot and room for its bytes.
	for slot < 0 || s.bytes+size > s.budget {
		c := &s.entries[s.hand]
		if c.ids != nil && c.ref.Load() {
			c.ref.Store(false)
		} else {
			if c.ids != nil {
				s.evict(s.hand)
			}
			if slot < 0 {
				slot = s.hand
			}
		}
		s.hand = (s.hand + 1) % len(s.entries)
	}
	s.entries[slot].set(&stored)
	s.index[key] = int32(slot)
	s.bytes += size
}

func (s *cacheShard) evict(i int) {
	c := &s.entries[i]
	delete(s.index, c.key)
	s.bytes -= c.size()
	c.set(&cacheEntry{})
}

func (c *cacheEntry) set(from *cacheEntry) {
	c.key, c.scope, c.literal, c.role, c.content, c.calls, c.ids = from.key, from.scope, from.literal, from.role, from.content, from.calls, from.ids
	c.ref.Store(false)
}
