#!/bin/sh
# Simulation honesty check: replays a slice of the conversation trace through
# a live kvproxy in front of 8 simulated engines (kind: mock, started by
# kvproxy on loopback, KV events over ZMQ) sized like the simulation, then
# runs kvbench sim on the same slice, and prints both tables.
#
#   bench/live.sh [TRACES_DIR] [ENGINE_SPEEDUP] [POLICY] [DURATION] [SPEEDUP] [SIM FLAGS...]
#
# ENGINE_SPEEDUP (default 1) runs the engines that many times faster than
# real time; the replay compresses arrivals to match and reports in engine
# time (-time-scale). The machine must keep up: on 2 shared cores use 1.
# With DUMP=PREFIX set, per-request CSVs go to PREFIX-live.csv and
# PREFIX-sim.csv (kvbench -dump) and the proxy's log to PREFIX-kvproxy.log.
# With SPREAD=SEED both spread each timestamp's requests (-spread-ties).
# The simulation models the hop from kvproxy's decision to the engine's
# queue (kvbench sim -hop-per-token, -hop-jitter) as measured on a 2-core
# machine running this script: 100 ns a prompt token and an exponential
# extra of mean 4.2 ms; HOP_PER_TOKEN_NS and HOP_JITTER_US (real time,
# plain decimal numbers) override them.
set -eu
traces=${1:-../shared/traces}
k=${2:-1}
policy=${3:-kv}
dur=${4:-10m}
base=${5:-3.5} # arrival speedup in engine time, as kvbench sim -speedup
shift $(($# < 5 ? $# : 5))
trace="$traces/mooncake/conversation_trace.jsonl"
for v in "${HOP_PER_TOKEN_NS:-100}" "${HOP_JITTER_US:-4200}"; do
	case $v in
	'' | *[!0-9.]* | *.*.* | .)
		echo "live.sh: HOP_PER_TOKEN_NS and HOP_JITTER_US take plain decimal numbers, not '$v'" >&2
		exit 2
		;;
	esac
done
# The hop in engine time: engines k times faster see it k times longer.
hop_token=$(echo "${HOP_PER_TOKEN_NS:-100} * $k" | bc -l)
hop_jitter=$(echo "${HOP_JITTER_US:-4200} * $k" | bc -l)
tmp=$(mktemp -d)
go build -o "$tmp/kvproxy" ./cmd/kvproxy
go build -o "$tmp/kvbench" ./cmd/kvbench
cfg="$tmp/kvproxy.yaml"
{
	echo "listen: 127.0.0.1:18080"
	echo "log_level: warn"
	echo "models:"
	echo "  - {name: mock, tokenizer: cl100k_base, template: chatml, block_size: 16}"
	echo "backends:"
	for i in 0 1 2 3 4 5 6 7; do
		echo "  - id: mock-$i"
		echo "    url: http://127.0.0.1:1910$i"
		echo "    model: mock"
		echo "    kind: mock"
		echo "    mock: {cache_blocks: 30000, speedup: $k}"
		echo "    kv_events: {mode: zmq, endpoint: \"tcp://127.0.0.1:1510$i\", replay: \"tcp://127.0.0.1:1520$i\"}"
	done
	echo "router: {policy: $policy}"
	echo "limits: {max_request_body_bytes: 67108864, max_prompt_tokens: 200000, stream_idle_timeout: 10m}"
} > "$cfg"
"$tmp/kvproxy" -config "$cfg" > "$tmp/kvproxy.log" 2>&1 &
proxy=$!
dump=${DUMP:-}
trap 'kill $proxy 2>/dev/null; wait $proxy 2>/dev/null; [ -z "$dump" ] || cp "$tmp/kvproxy.log" "$dump-kvproxy.log"; rm -rf "$tmp"' EXIT
for i in $(seq 50); do
	curl -sf http://127.0.0.1:18080/v1/models > /dev/null && break
	sleep 0.2
done
speedup=$(echo "$base * $k" | bc -l)
echo "live ($policy, engines at ${k}x, engine time):"
"$tmp/kvbench" replay -url http://127.0.0.1:18080 -model mock -trace "$trace" \
	-duration "$dur" -speedup "$speedup" -time-scale "$k" -label "live-$policy" \
	${dump:+-dump "$dump-live.csv"} ${SPREAD:+-spread-ties "$SPREAD"}
echo "sim ($policy):"
"$tmp/kvbench" sim -trace "$trace" -duration "$dur" -speedup "$base" -policies "$policy" \
	-hop-per-token "${hop_token}ns" -hop-jitter "${hop_jitter}us" \
	${dump:+-dump "$dump-sim.csv"} ${SPREAD:+-spread-ties "$SPREAD"} "$@"
