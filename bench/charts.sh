#!/bin/sh
# Regenerates the simulation charts and their JSON tables under docs/img/.
# Run from the repository root; the traces directory defaults to ../shared/traces:
#
#   bench/charts.sh [TRACES_DIR]
#
# The simulations are deterministic (same seed, same numbers): about 3 minutes on 2 idle
# cores. It also measures the proxy overhead against nginx (installed from Debian's packages
# when missing and run as root; about 4 minutes, not
# deterministic: alternating configurations, ratios measured in one run).
set -eu
traces=${1:-../shared/traces}
out=docs/img
bin=$(mktemp -d)/kvbench
go build -o "$bin" ./cmd/kvbench
mkdir -p "$out"

# Headline: the Mooncake conversation trace on the reference fleet
# (8 engines × 30,000 blocks of 16 tokens), default speedup 3.5 (round_robin near saturation).
"$bin" sim -trace "$traces/mooncake/conversation_trace.jsonl" -name conversation \
	-json -plot "$out" > "$out/conversation.json"

# The same with the requests of each timestamp spread over the ~3 s to the next
# one (Poisson arrivals, seed 1) instead of arriving as one burst.
"$bin" sim -trace "$traces/mooncake/conversation_trace.jsonl" -name conversation-spread \
	-spread-ties 1 -json -plot "$out" > "$out/conversation-spread.json"

# No-reuse control: Azure conversation trace (unique prompts), speedup 22 (round_robin near saturation).
"$bin" sim -trace "$traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv" -name azure-conv \
	-speedup 22 -json -plot "$out" > "$out/azure-conv.json"

# Heterogeneous fleet: 4 engines at full speed, 4 at half speed (75% of the
# capacity, so arrivals are scaled to 2.6 instead of 3.5). kv_fixed is kv
# without online calibration of its coefficients.
"$bin" sim -trace "$traces/mooncake/conversation_trace.jsonl" -name conversation-hetero \
	-hetero 0.5 -speedup 2.6 -policies kv,kv_fixed,kv_dynamo,least_load,round_robin \
	-json -plot "$out" > "$out/conversation-hetero.json"
# Generated multi-turn chat: 1,600 conversations (8 shared system prompts of
# 2,000 tokens, ~6 turns of 400-token questions and 250-token answers, 10 s
# between turns), 16 new conversations a second: round_robin near saturation.
"$bin" sim -format multiturn -name multiturn -conversations 1600 -rate 16 -think 10s -speedup 1 \
	-json -plot "$out" > "$out/multiturn.json"
rm -f "$bin"

# Proxy overhead against direct access and nginx, installed from Debian's
# packages when it is missing (as root, with apt-get).
if ! command -v nginx > /dev/null 2>&1 && command -v apt-get > /dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
	apt-get install -y nginx-light > /dev/null 2>&1 || { apt-get update > /dev/null 2>&1 && apt-get install -y nginx-light > /dev/null 2>&1; } || true
fi
if command -v nginx > /dev/null 2>&1; then
	go run ./cmd/kvoverhead -eventloop -png "$out/overhead.png" > "$out/overhead.txt"
	go run ./cmd/kvoverhead -eventloop -speedup 10 -png "$out/overhead-paced.png" > "$out/overhead-paced.txt"
else
	echo "charts.sh: nginx not found; overhead charts not regenerated (apt-get install -y nginx-light)" >&2
fi
