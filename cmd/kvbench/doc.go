// Command kvbench measures kvproxy's routing.
//
//	kvbench sim    -trace FILE [-format mooncake|azure|multiturn] [flags]
//	kvbench replay -url http://127.0.0.1:8080 -trace FILE [flags]
//
// sim runs the workload through a simulated fleet (mockengine's model) on a
// virtual clock with the real router deciding, once per policy; replay sends
// it to a live kvproxy. Both print a table, or with -json one object
// {"results":[...]}. -plot DIR writes PNG charts (TTFT CDF, hit rate).
//
// Traces: Mooncake JSONL (timestamp ms, input_length, output_length,
// hash_ids; arrivals start at the earliest timestamp) and Azure CSV
// (TIMESTAMP, ContextTokens, GeneratedTokens), or the generated multiturn
// workload. -spread-ties spreads requests that share a timestamp. replay
// -mode completions sends token ids and keeps the trace's lengths exactly;
// -mode chat sends text, which a tokenizer makes longer.
//
// bench/charts.sh regenerates docs/img from the traces; bench/live.sh
// compares a live kvproxy in front of simulated engines with the simulator.
//
// kvbench owns flags and output only; workloads, the simulator, the replay
// client and the charts live in package bench. It knows nothing of the
// router's internals.
package main
