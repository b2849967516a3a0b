// Package tokenize turns prompts into the token ids the serving engine would
// compute: chat templates render messages, tokenizers encode text, and an
// Encoder caches the tokens of every rendered message so that turn N+1 of a
// conversation only tokenizes what is new.
//
// It owns:
//   - tiktoken encodings (cl100k_base, o200k_base), read from files embedded
//     in the binary, with hand-written pre-tokenizers for their split
//     patterns and an allocation-free BPE merge loop; token for token
//     identical to pkoukk/tiktoken-go (fuzzed against its regexes) and to
//     OpenAI's tiktoken (reference test);
//   - Hugging Face tokenizer.json byte-level BPE models (Llama 3, Qwen 2/3,
//     GPT-2 style), encoding like the model's tokenizer with
//     add_special_tokens=False; anything it cannot reproduce exactly is a
//     load error naming the feature;
//   - chat templates: built-in chatml, llama3 and raw, and a model's own
//     Jinja chat_template from tokenizer_config.json (the subset of Jinja
//     those templates use, rendered as transformers renders them);
//   - Encoder: tokenizer + template + a bounded, sharded per-message cache.
//
// Entry points: Load(spec) and LoadTemplate(spec) accept a built-in name or
// a path; NewEncoder combines them.
//
// It never needs token → text, never touches the network, and knows nothing
// of HTTP, routing, block hashing or engines.
package tokenize
