package proxy

import "bytes"

// tokenUsage is what an engine reported it computed for a request, from
// the usage object of its answer; -1 where it said nothing.
type tokenUsage struct {
	prompt, completion, cached int
}

var (
	usageKey      = []byte(`"usage":`)
	promptKey     = []byte(`"prompt_tokens":`)
	completionKey = []byte(`"completion_tokens":`)
	cachedKey     = []byte(`"cached_tokens":`)
	// The Responses and Anthropic APIs' names.
	inputKey         = []byte(`"input_tokens":`)
	outputKey        = []byte(`"output_tokens":`)
	cacheReadKey     = []byte(`"cache_read_input_tokens":`)
	cacheCreationKey = []byte(`"cache_creation_input_tokens":`)
)

// read fills u from the usage object in an engine answer or stream chunk,
// without decoding it, keeping what is already known where it has none
// ("usage":null in vLLM's chunks). The usage object comes after the
// choices, so the search starts at its key's last occurrence; keys inside
// generated text are escaped and cannot match.
func (u *tokenUsage) read(b []byte) {
	i := bytes.LastIndex(b, usageKey)
	if i < 0 {
		return
	}
	b = b[i+len(usageKey):]
	if n := intAfter(b, promptKey); n >= 0 {
		u.prompt = n
	} else if n := intAfter(b, inputKey); n >= 0 {
		u.prompt = n
	}
	if n := intAfter(b, completionKey); n >= 0 {
		u.completion = n
	} else if n := intAfter(b, outputKey); n >= 0 {
		u.completion = n
	}
	if n := intAfter(b, cachedKey); n >= 0 {
		u.cached = n
	} else if n := intAfter(b, cacheReadKey); n >= 0 {
		// Anthropic's meaning, which vLLM's Messages endpoint reports:
		// input_tokens are the prompt tokens neither read from the cache
		// nor written to it.
		u.cached = n
		if in := intAfter(b, inputKey); in >= 0 {
			u.prompt = in + n + max(intAfter(b, cacheCreationKey), 0)
		}
	}
}

// intAfter is the non-negative integer after key's first occurrence in b;
// -1 when there is none.
func intAfter(b, key []byte) int {
	i := bytes.Index(b, key)
	if i < 0 {
		return -1
	}
	b = bytes.TrimLeft(b[i+len(key):], " ")
	n, j := 0, 0
	for j < len(b) && j < 12 && b[j] >= '0' && b[j] <= '9' {
		n = n*10 + int(b[j]-'0')
		j++
	}
	if j == 0 {
		return -1
	}
	return n
}
