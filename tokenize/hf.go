package tokenize

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// hfTokenizer is a Hugging Face tokenizer.json byte-level BPE model (Llama 3,
// Qwen 2/3, GPT-2 and the like). Encode behaves like the model's tokenizer
// with add_special_tokens=False: added tokens (special or not) written in the
// text are recognized, no BOS/EOS is added.
type hfTokenizer struct {
	name         string
	norms        []norm.Form // normalizers, applied in order
	split        func(s string, i int) int
	byteID       [256]uint32
	vocab        map[string]uint32 // token bytes → id
	maxLen       int               // bytes of the longest token in vocab
	merges       map[uint64]uint64 // left<<32|right → rank<<32|merged id
	ignoreMerges bool              // a piece found whole in vocab is one token
	// prefix and suffix are what add_special_tokens=True adds around a
	// prompt (a TemplateProcessing post-processor, e.g. Llama 3's BOS).
	prefix, suffix []uint32
	// direct holds the pieces that encode to a single token without
	// running the merges: the vocabulary itself with ignore_merges,
	// otherwise the tokens their own merges rebuild (checked at load).
	direct map[string]uint32
	added  addedVocab
}

// Split patterns written by hand; tokenizer.json files using another pattern
// are refused rather than tokenized differently.
var hfSplitPatterns = map[string]func(string, int) int{
	cl100kPattern: splitCL100K, // Llama 3
	qwenPattern:   splitQwen,
	o200kPattern:  splitO200K,
	gpt2Pattern:   splitGPT2,
}

type hfJSON struct {
	AddedTokens []struct {
		ID         uint32 `json:"id"`
		Content    string `json:"content"`
		SingleWord bool   `json:"single_word"`
		Lstrip     bool   `json:"lstrip"`
		Rstrip     bool   `json:"rstrip"`
		Normalized bool   `json:"normalized"`
	} `json:"added_tokens"`
	Normalizer    *hfComponent     `json:"normalizer"`
	PreTokenizer  *hfComponent     `json:"pre_tokenizer"`
	PostProcessor *hfPostProcessor `json:"post_processor"`
	Model         struct {
		Type                    string            `json:"type"`
		Dropout                 *float64          `json:"dropout"`
		ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
		EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
		ByteFallback            bool              `json:"byte_fallback"`
		IgnoreMerges            bool              `json:"ignore_merges"`
		Vocab                   map[string]uint32 `json:"vocab"`
		Merges                  json.RawMessage   `json:"merges"`
	} `json:"model"`
}

// hfComponent is a normalizer or pre-tokenizer node.
type hfComponent struct {
	Type           string         `json:"type"`
	Normalizers    []*hfComponent `json:"normalizers"`
	Pretokenizers  []*hfComponent `json:"pretokenizers"`
	Pattern        hfPattern      `json:"pattern"`
	Behavior       string         `json:"behavior"`
	Invert         bool           `json:"invert"`
	AddPrefixSpace bool           `json:"add_prefix_space"`
	UseRegex       bool           `json:"use_regex"`
}

// hfPostProcessor is the part of a post_processor that decides which
// special tokens add_special_tokens=True puts around a single sequence.
type hfPostProcessor struct {
	Type       string             `json:"type"`
	Processors []*hfPostProcessor `json:"processors"`
	Single     []struct {
		SpecialToken *struct{ ID string } `json:"SpecialToken"`
		Sequence     *struct{ ID string } `json:"Sequence"`
	} `json:"single"`
	SpecialTokens map[string]struct {
		IDs []uint32 `json:"ids"`
	} `json:"special_tokens"`
}

// specialAround returns the ids a TemplateProcessing puts before and after
// a single sequence.
func (p *hfPostProcessor) specialAround() (prefix, suffix []uint32) {
	if p == nil {
		return nil, nil
	}
	if p.Type == "Sequence" {
		for _, c := range p.Processors {
			if pre, suf := c.specialAround(); pre != nil || suf != nil {
				return pre, suf
			}
		}
		return nil, nil
	}
	if p.Type != "TemplateProcessing" {
		return nil, nil
	}
	seen := false
	for _, item := range p.Single {
		switch {
		case item.Sequence != nil:
			seen = true
		case item.SpecialToken != nil:
			ids := p.SpecialTokens[item.SpecialToken.ID].IDs
			if seen {
				suffix = append(suffix, ids...)
			} else {
				prefix = append(prefix, ids...)
			}
		}
	}
	return prefix, suffix
}

type hfPattern struct {
	Regex  string `json:"Regex"`
	String string `json:"String"`
}

// LoadHF loads a Hugging Face tokenizer.json (a file, or a directory holding
// one) for a byte-level BPE model. A tokenizer of another kind, or using a
// feature this package does not reproduce exactly, is an error naming it.
func LoadHF(path string) (Tokenizer, error) {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		path = filepath.Join(path, "tokenizer.json")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	t, err := parseHF(data)
	if err != nil {
		return nil, fmt.Errorf("tokenize: %s: %w", path, err)
	}
	t.name = path
	return t, nil
}

func parseHF(data []byte) (*hfTokenizer, error) {
	var f hfJSON
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("not a tokenizer.json: %w", err)
	}
	initClasses()
	t := &hfTokenizer{}
	if err := t.setNormalizer(f.Normalizer); err != nil {
		return nil, err
	}
	if err := t.setPreTokenizer(f.PreTokenizer); err != nil {
		return nil, err
	}
	m := &f.Model
	switch {
	case m.Type != "BPE":
		return nil, fmt.Errorf("unsupported model type %q: only byte-level BPE is supported", m.Type)
	case m.Dropout != nil && *m.Dropout != 0:
		return nil, errors.New("unsupported: BPE dropout")
	case m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "",
		m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "":
		return nil, errors.New("unsupported: BPE continuing_subword_prefix / end_of_word_suffix")
	}
	t.ignoreMerges = m.IgnoreMerges
	t.prefix, t.suffix = f.PostProcessor.specialAround()

	t.vocab = make(map[string]uint32, len(m.Vocab))
	for tok, id := range m.Vocab {
		b, ok := fromByteLevel(tok)
		if !ok {
			return nil, fmt.Errorf("vocabulary entry %q is not byte-level: only byte-level BPE is supported", tok)
		}
		t.vocab[b] = id
		t.maxLen = max(t.maxLen, len(b))
	}
	for b := range 256 {
		id, ok := t.vocab[string([]byte{byte(b)})]
		if !ok {
			return nil, fmt.Errorf("byte 0x%02x has no token: not a byte-level BPE vocabulary", b)
		}
		t.byteID[b] = id
	}
	merges, err := parseMerges(m.Merges)
	if err != nil {
		return nil, err
	}
	t.merges = make(map[uint64]uint64, len(merges))
	for rank, mg := range merges {
		left, right := mg[0], mg[1]
		l, ok1 := m.Vocab[left]
		r, ok2 := m.Vocab[right]
		merged, ok3 := m.Vocab[left+right]
		if !ok1 || !ok2 || !ok3 {
			return nil, fmt.Errorf("merge %d (%q %q) names a token missing from the vocabulary", rank, left, right)
		}
		key := uint64(l)<<32 | uint64(r)
		if _, dup := t.merges[key]; !dup { // the first (lowest-ranked) definition wins
			t.merges[key] = uint64(rank)<<32 | uint64(merged)
		}
	}

	t.direct = t.vocab
	if !t.ignoreMerges {
		t.direct = make(map[string]uint32, len(t.vocab))
		var buf []uint32
		for w, id := range t.vocab {
			if buf = t.merge(buf[:0], w); len(buf) == 1 && buf[0] == id {
				t.direct[w] = id
			}
		}
	}

	for _, a := range f.AddedTokens {
		if a.SingleWord {
			return nil, fmt.Errorf("unsupported: added token %q has single_word", a.Content)
		}
		for _, f := range t.norms {
			if a.Normalized && !f.IsNormalString(a.Content) {
				return nil, fmt.Errorf("unsupported: normalized added token %q changes under normalization", a.Content)
			}
		}
		t.added.add(a.Content, a.ID, a.Lstrip, a.Rstrip)
	}
	return t, nil
}

func (t *hfTokenizer) setNormalizer(n *hfComponent) error {
	if n == nil {
		return nil
	}
	forms := map[string]norm.Form{"NFC": norm.NFC, "NFD": norm.NFD, "NFKC": norm.NFKC, "NFKD": norm.NFKD}
	if f, ok := forms[n.Type]; ok {
		t.norms = append(t.norms, f)
		return nil
	}
	switch n.Type {
	case "Sequence":
		for _, c := range n.Normalizers {
			if err := t.setNormalizer(c); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("unsupported normalizer %q (supported: none, NFC, NFD, NFKC, NFKD, Sequence of those)", n.Type)
}

func (t *hfTokenizer) setPreTokenizer(p *hfComponent) error {
	if p == nil {
		return errors.New("no pre_tokenizer: only byte-level BPE is supported")
	}
	parts := []*hfComponent{p}
	if p.Type == "Sequence" {
		parts = p.Pretokenizers
	}
	byteLevel := false
	for _, c := range parts {
		switch c.Type {
		case "Split":
			if t.split != nil {
				return errors.New("unsupported: more than one Split pre-tokenizer")
			}
			if c.Pattern.Regex == "" || c.Behavior != "Isolated" || c.Invert {
				return fmt.Errorf("unsupported Split pre-tokenizer (pattern %+v, behavior %q, invert %v): only Isolated regex splits are supported",
					c.Pattern, c.Behavior, c.Invert)
			}
			split, ok := hfSplitPatterns[c.Pattern.Regex]
			if !ok {
				return fmt.Errorf("unsupported Split pattern %q (supported: those of Llama 3, Qwen 2/3, o200k, GPT-2)", c.Pattern.Regex)
			}
			t.split = split
		case "ByteLevel":
			if c.AddPrefixSpace {
				return errors.New("unsupported: ByteLevel pre-tokenizer with add_prefix_space")
			}
			if c.UseRegex {
				if t.split != nil {
					return errors.New("unsupported: Split followed by ByteLevel with use_regex")
				}
				t.split = splitGPT2
			}
			byteLevel = true
		default:
			return fmt.Errorf("unsupported pre-tokenizer %q: only byte-level BPE (Split + ByteLevel) is supported", c.Type)
		}
	}
	if !byteLevel {
		return errors.New("no ByteLevel pre-tokenizer: only byte-level BPE is supported")
	}
	if t.split == nil {
		return errors.New("unsupported: ByteLevel pre-tokenizer without a split pattern")
	}
	return nil
}

// parseMerges reads merges written as "left right" strings or as
// [left, right] pairs.
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	var strs []string
	if err := json.Unmarshal(raw, &strs); err == nil {
		out := make([][2]string, len(strs))
		for i, s := range strs {
			l, r, ok := strings.Cut(s, " ")
			if !ok {
				return nil, fmt.Errorf("merge %d: bad merge %q", i, s)
			}
			out[i] = [2]string{l, r}
		}
		return out, nil
	}
	var pairs [][2]string
	if err := json.Unmarshal(raw, &pairs); err != nil {
		return nil, errors.New("merges are neither \"left right\" strings nor [left, right] pairs")
	}
	return pairs, nil
}

// byteLevelRune maps each byte to the printable rune GPT-2's byte-level BPE
// writes it as in vocabularies; byteOfRune is its inverse.
var byteLevelRune, byteOfRune = func() ([256]rune, map[rune]byte) {
	var fwd [256]rune
	inv := make(map[rune]byte, 256)
	n := rune(0)
	for b := range 256 {
		r := rune(b)
		if !(b >= '!' && b <= '~' || b >= 0xa1 && b <= 0xac || b >= 0xae && b <= 0xff) {
			r = 256 + n
			n++
		}
		fwd[b] = r
		inv[r] = byte(b)
	}
	return fwd, inv
}()

func fromByteLevel(tok string) (string, bool) {
	b := make([]byte, 0, len(tok))
	for _, r := range tok {
		c, ok := byteOfRune[r]
		if !ok {
			return "", false
		}
		b = append(b, c)
	}
	return string(b), true
}

func (t *hfTokenizer) Name() string { return t.name }

// Encode appends the ids of text as the model's tokenizer would with
// add_special_tokens=False.
func (t *hfTokenizer) Encode(dst []uint32, text string) []uint32 {
	dst, _ = t.encodeLimit(dst, text, math.MaxInt)
	return dst
}

// encodeLimit is Encode stopping once dst holds more than limit ids.
func (t *hfTokenizer) encodeLimit(dst []uint32, text string, limit int) ([]uint32, bool) {
	if !utf8.ValidString(text) {
		text = string([]rune(text))
	}
	for i := 0; i < len(text); {
		textEnd, tokEnd, id := t.added.next(text, i)
		var ok bool
		if dst, ok = t.encodeText(dst, text[i:textEnd], limit); !ok {
			return dst, false
		}
		if tokEnd > textEnd {
			dst = append(dst, id)
		}
		i = tokEnd
	}
	return dst, len(dst) <= limit
}

func (t *hfTokenizer) specialTokensAround() (prefix, suffix []uint32) { return t.prefix, t.suffix }

func (t *hfTokenizer) nextAdded(s string, i int) (textEnd, tokEnd int, id uint32) {
	return t.added.next(s, i)
}

// encodeText encodes text that holds no added token, stopping once dst
// holds more than limit ids.
func (t *hfTokenizer) encodeText(dst []uint32, s string, limit int) ([]uint32, bool) {
	for _, f := range t.norms {
		if f == norm.NFC && isNFC(s) || f != norm.NFC && f.IsNormalString(s) {
			continue
		}
		s = f.String(s)
	}
	for i := 0; i < len(s); {
		if overLimit(len(dst), len(s)-i, t.maxLen, limit) {
			return dst, false
		}
		end := t.split(s, i)
		for i+wordSlice(s[i:end]) < end { // a word of megabytes: in slices
			k := i + wordSlice(s[i:end])
			dst = t.appendWord(dst, s[i:k])
			if i = k; overLimit(len(dst), len(s)-i, t.maxLen, limit) {
				return dst, false
			}
		}
		dst = t.appendWord(dst, s[i:end])
		i = end
	}
	return dst, len(dst) <= limit
}

// isNFC reports whether s is in Normalization Form C. Text whose runes are
// all below U+0300 (UTF-8 lead bytes below 0xCC) always is; only other text
// is checked in full.
func isNFC(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0xcc {
			return norm.NFC.IsNormalString(s)
		}
	}
	return true
}

// appendWord runs BPE on one pre-tokenized piece: starting from its bytes,
// repeatedly apply the lowest-ranked merge among adjacent pairs (leftmost
// on ties), as Hugging Face tokenizers do. Pieces shorter than 128 bytes do
// not allocate.
func (t *hfTokenizer) appendWord(dst []uint32, w string) []uint32 {
	if len(w) == 1 {
		return append(dst, t.byteID[w[0]])
	}
	if id, ok := t.direct[w]; ok {
		return append(dst, id)
	}
	return t.merge(dst, w)
}

// merge appends the BPE tokens of w, merging from its bytes.
func (t *hfTokenizer) merge(dst []uint32, w string) []uint32 {
	switch {
	case len(w) == 0:
		return dst
	case len(w) >= largePiece:
		return t.mergeLarge(dst, w)
	}
	var symStack [largePiece]uint32
	var rankStack [largePiece]uint64
	return t.mergeQuadratic(dst, w, symStack[:0], rankStack[:0])
}

// mergeQuadratic rescans every pair after each merge: fastest for short
// words. syms and ranks are scratch space of capacity len(w).
func (t *hfTokenizer) mergeQuadratic(dst []uint32, w string, syms []uint32, ranks []uint64) []uint32 {
	for i := 0; i < len(w); i++ {
		syms = append(syms, t.byteID[w[i]])
	}
	ranks = ranks[:len(syms)-1]
	for i := range ranks {
		ranks[i] = t.pairRank(syms[i], syms[i+1])
	}
	for len(ranks) > 0 {
		best, at := uint64(noMerge), -1
		for i, r := range ranks {
			if r < best {
				best, at = r, i
			}
		}
		if at < 0 {
			break
		}
		syms[at] = uint32(best)
		syms = slices.Delete(syms, at+1, at+2)
		ranks = slices.Delete(ranks, at, at+1)
		if at > 0 {
			ranks[at-1] = t.pairRank(syms[at-1], syms[at])
		}
		if at < len(ranks) {
			ranks[at] = t.pairRank(syms[at], syms[at+1])
		}
	}
	return append(dst, syms...)
}

const noMerge = ^uint64(0)

// pairRank returns rank<<32|merged id for the pair, or noMerge.
func (t *hfTokenizer) pairRank(l, r uint32) uint64 {
	if m, ok := t.merges[uint64(l)<<32|uint64(r)]; ok {
		return m
	}
	return noMerge
}

// addedVocab finds added tokens in text: the leftmost match, the longest
// at that position, as Hugging Face's added-vocabulary split. Tokens are
// kept in a byte trie.
type addedVocab struct {
	nodes []trieNode // nodes[0] is the root
	toks  []addedTok
	first [256]bool // bytes a token starts with
}

type trieNode struct {
	edges []byte
	child []int32
	tok   int32 // index in toks of the token ending here, or -1
}

type addedTok struct {
	id             uint32
	lstrip, rstrip bool
}

func (a *addedVocab) add(content string, id uint32, lstrip, rstrip bool) {
	if content == "" {
		return
	}
	if a.nodes == nil {
		a.nodes = []trieNode{{tok: -1}}
	}
	a.first[content[0]] = true
	n := int32(0)
	for i := 0; i < len(content); i++ {
		k := bytes.IndexByte(a.nodes[n].edges, content[i])
		if k < 0 {
			a.nodes = append(a.nodes, trieNode{tok: -1})
			a.nodes[n].edges = append(a.nodes[n].edges, content[i])
			a.nodes[n].child = append(a.nodes[n].child, int32(len(a.nodes)-1))
			k = len(a.nodes[n].edges) - 1
		}
		n = a.nodes[n].child[k]
	}
	if a.nodes[n].tok < 0 {
		a.nodes[n].tok = int32(len(a.toks))
		a.toks = append(a.toks, addedTok{})
	}
	a.toks[a.nodes[n].tok] = addedTok{id: id, lstrip: lstrip, rstrip: rstrip}
}

// longestAt returns the end of the longest added token starting at p, and
// the token's index, or -1.
func (a *addedVocab) longestAt(s string, p int) (end int, tok int32) {
	n, tok := int32(0), int32(-1)
	for k := p; k < len(s); k++ {
		node := &a.nodes[n]
		e := bytes.IndexByte(node.edges, s[k])
		if e < 0 {
			break
		}
		n = node.child[e]
		if t := a.nodes[n].tok; t >= 0 {
			end, tok = k+1, t
		}
	}
	return end, tok
}

// next finds the first added token at or after i: text runs from i to
// textEnd, the token (if tokEnd > textEnd) from textEnd to tokEnd. Without
// a token, textEnd == tokEnd == len(s).
func (a *addedVocab) next(s string, i int) (textEnd, tokEnd int, id uint32) {
	if len(a.toks) == 0 {
		return len(s), len(s), 0
	}
	root := a.nodes[0].edges
	for p := i; p < len(s); p++ {
		if len(root) == 1 { // typically '<': jump to the next one
			k := strings.IndexByte(s[p:], root[0])
			if k < 0 {
				break
			}
			p += k
		} else if !a.first[s[p]] {
			continue
		}
		end, t := a.longestAt(s, p)
		if t < 0 {
			continue
		}
		tok := a.toks[t]
		start := p
		if tok.lstrip {
			start = i + len(strings.TrimRightFunc(s[i:start], unicode.IsSpace))
		}
		if tok.rstrip {
			end = len(s) - len(strings.TrimLeftFunc(s[end:], unicode.IsSpace))
		}
		return start, end, tok.id
	}
	return len(s), len(s), 0
}
