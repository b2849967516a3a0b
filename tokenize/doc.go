// Package tokenize turns prompts into token ids the way the serving engine
// would: chat templates render messages, tokenizers encode text, and an
// Encoder caches the tokens of every rendered message so that turn N+1 of a
// conversation only tokenizes what is new.
//
// It owns tokenizers (tiktoken encodings, loaded offline from embedded
// files), chat templates and the per-message token cache. It never needs
// token → text, never touches the network, and knows nothing of HTTP,
// routing, block hashing or engines.
package tokenize
