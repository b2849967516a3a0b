#!/bin/sh
# Event mode against approximate mode, with engine caches smaller than the
# working set: replays the same slice of the Mooncake conversation trace
# through kvproxy in front of simulated engines (kind: mock) whose caches
# hold CACHE_BLOCKS blocks (default 12,000: 192k tokens) each, far less than
# the trace's working set, once with the router following the
# engines' KV events over ZMQ and once guessing from its own decisions, and
# prints both reports (hit_rate = cached prompt tokens / prompt tokens, as
# the engines report them).
#
#   bench/scripts/events_vs_approx.sh [TRACE] [DURATION] [ENGINE_SPEEDUP] [ENGINES] [ARRIVAL_SPEEDUP] [CACHE_BLOCKS]
#
# ARRIVAL_SPEEDUP is in engine time (as kvbench sim -speedup); the default
# loads 4 engines as the reference 8 are loaded at 3.5.
set -eu
trace=${1:-../shared/traces/mooncake/conversation_trace.jsonl}
dur=${2:-3m}
k=${3:-1}
n=${4:-4}
base=${5:-1.75}
blocks=${6:-12000}
tmp=$(mktemp -d)
go build -o "$tmp/kvproxy" ./cmd/kvproxy
go build -o "$tmp/kvbench" ./cmd/kvbench
trap 'kill $proxy 2>/dev/null; wait $proxy 2>/dev/null; rm -rf "$tmp"' EXIT
proxy=
for mode in zmq none; do
	cfg="$tmp/$mode.yaml"
	{
		echo "listen: 127.0.0.1:18081"
		echo "log_level: warn"
		echo "models: [{name: mock, tokenizer: cl100k_base, template: chatml, block_size: 16}]"
		echo "backends:"
		for i in $(seq 0 $((n - 1))); do
			echo "  - id: mock-$i"
			echo "    url: http://127.0.0.1:1920$i"
			echo "    model: mock"
			echo "    kind: mock"
			echo "    mock: {cache_blocks: ${blocks}, speedup: $k}"
			if [ $mode = zmq ]; then
				echo "    kv_events: {mode: zmq, endpoint: \"tcp://127.0.0.1:1530$i\", replay: \"tcp://127.0.0.1:1540$i\"}"
			fi
		done
		echo "router: {policy: kv}"
		echo "limits: {max_request_body_bytes: 67108864, max_prompt_tokens: 200000, stream_idle_timeout: 10m}"
	} > "$cfg"
	"$tmp/kvproxy" -config "$cfg" > "$tmp/$mode.log" 2>&1 &
	proxy=$!
	for i in $(seq 50); do
		curl -sf http://127.0.0.1:18081/v1/models > /dev/null && break
		sleep 0.2
	done
	echo "== kv_events: $mode"
	"$tmp/kvbench" replay -url http://127.0.0.1:18081 -model mock -trace "$trace" \
		-duration "$dur" -speedup "$(echo "$base * $k" | bc -l)" -time-scale "$k" -label "kv-$mode"
	kill $proxy
	wait $proxy 2>/dev/null || true
done
