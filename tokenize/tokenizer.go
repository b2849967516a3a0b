package tokenize

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
)

// Tokenizer encodes text into token ids. Implementations are safe for
// concurrent use.
type Tokenizer interface {
	// Name is the encoding's name, e.g. "cl100k_base", or the path of a
	// tokenizer.json.
	Name() string
	// Encode appends the token ids of text. tiktoken encodings encode like
	// tiktoken's encode_ordinary (special-token look-alikes are plain
	// text); a tokenizer.json model like its tokenizer with
	// add_special_tokens=False (added tokens written in the text are
	// recognized, no BOS is added).
	Encode(dst []uint32, text string) []uint32
}

// builtin is a tokenizer loaded once per process on first use.
type builtin struct {
	once sync.Once
	load func() (Tokenizer, error)
	tok  Tokenizer
	err  error
}

var builtins = map[string]*builtin{
	"cl100k_base": {load: func() (Tokenizer, error) { return loadTiktoken("cl100k_base") }},
	"o200k_base":  {load: func() (Tokenizer, error) { return loadTiktoken("o200k_base") }},
}

// Names lists the built-in tokenizers accepted by Get, sorted.
func Names() []string {
	names := make([]string, 0, len(builtins))
	for n := range builtins {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Get returns the built-in tokenizer called name ("cl100k_base",
// "o200k_base"). Its vocabulary is read from files embedded in the binary,
// once per process; nothing is downloaded. Load also accepts tokenizer.json
// files.
func Get(name string) (Tokenizer, error) {
	b, ok := builtins[name]
	if !ok {
		return nil, fmt.Errorf("tokenize: unknown tokenizer %q (known: %s)", name, strings.Join(Names(), ", "))
	}
	b.once.Do(func() { b.tok, b.err = b.load() })
	return b.tok, b.err
}

var (
	loadedMu sync.Mutex
	loaded   = map[string]*builtin{} // tokenizer.json files by absolute path
)

// Load returns the tokenizer named by spec: a built-in name ("cl100k_base",
// "o200k_base"), or the path of a Hugging Face tokenizer.json (or of a
// directory holding one) for a byte-level BPE model. A file is loaded once
// per process.
func Load(spec string) (Tokenizer, error) {
	if _, ok := builtins[spec]; ok {
		return Get(spec)
	}
	if !strings.ContainsAny(spec, `/\`) && !strings.HasSuffix(spec, ".json") {
		return nil, fmt.Errorf("tokenize: unknown tokenizer %q (known: %s, or the path of a tokenizer.json)", spec, strings.Join(Names(), ", "))
	}
	abs, err := filepath.Abs(spec)
	if err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	loadedMu.Lock()
	b, ok := loaded[abs]
	if !ok {
		b = &builtin{load: func() (Tokenizer, error) { return LoadHF(spec) }}
		loaded[abs] = b
	}
	loadedMu.Unlock()
	b.once.Do(func() { b.tok, b.err = b.load() })
	if b.err != nil {
		loadedMu.Lock()
		delete(loaded, abs) // let a fixed file be retried
		loadedMu.Unlock()
	}
	return b.tok, b.err
}
