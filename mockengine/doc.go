// Package mockengine is a simulated vLLM engine, good enough to test and
// benchmark KV-cache-aware routing honestly.
//
// It has two layers:
//
//   - Model: a deterministic engine core with no HTTP and no wall clock. It
//     keeps a block-based prefix cache of fixed capacity (LRU eviction of
//     unreferenced blocks), an optional host (CPU) tier, schedules with
//     continuous batching and chunked prefill, and says how long each step
//     takes using Dynamo's mocker fit (StepTime). The fleet simulator drives
//     it on a virtual clock.
//   - Engine: an OpenAI-compatible HTTP server around one Model, stepping it
//     in real time (step duration / Speedup), with vLLM's /metrics names, a
//     /debug/cache view of the resident blocks and vLLM's
//     /reset_prefix_cache.
//
// Behaviour, and where it follows vLLM:
//   - Prefix hits are whole blocks, and at least one prompt token is always
//     computed. cached_tokens is fixed at a request's first admission.
//   - Full blocks are cached as soon as they are computed, output blocks
//     included, so a follow-up turn that quotes the answer hits them.
//     Finished sequences release their blocks tail first, so the shared head
//     of a prompt outlives its tail.
//   - A running sequence that cannot get a block preempts the newest running
//     sequence (recompute, back to the front of the queue); no admission in
//     a step that preempted.
//   - A mixed step (prefill chunk plus decodes) costs prefill + decode time.
//   - cache_salt seeds block 0 of the engine's hashes: different salts never
//     share blocks.
//   - Evicted device blocks move to the host tier when it is on; a hit there
//     costs HostLoadPerBlock per block instead of recomputation.
//   - POST /v1/responses (the Responses API) renders its input as the chat
//     messages vLLM builds from it and runs them as a chat request would;
//     answers are kept (a bounded store) for previous_response_id and
//     GET /v1/responses/{id}, on the engine that made them only.
//   - POST /v1/messages (Anthropic's Messages API) converts its request into
//     the chat request vLLM makes of it and runs that, answering in vLLM's
//     Anthropic shapes (a stream ends with data: [DONE], as vLLM's does);
//     usage adds cache_read_input_tokens. POST /v1/messages/count_tokens
//     counts the same prompt without generating.
//   - A request whose tool_choice forces a call (chat "required" or a named
//     function, the Responses API's likewise, Messages' any or tool) is
//     answered with one call of that tool, in vLLM's shapes for each API,
//     streamed or not; its arguments, made up from the tool's JSON schema
//     and the same for the same prompt, are the output tokens.
//
// The engine hashes blocks in its own namespace, deliberately different from
// the router's, because the router must never trust engine hashes (DESIGN.md
// §3); events carry token ids for the router to rehash. Only /debug/cache
// also reports router-scheme hashes, for comparisons.
//
// mockengine must not know about the router or the proxy. The model and
// server import only kv and tokenize; publisher.go adds the one transport a
// simulated vLLM must speak, vLLM's ZMQ event publisher (zmq4), attached
// through Config.OnEvents or PublishEvents.
package mockengine
