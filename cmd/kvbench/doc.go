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
// bench/charts.sh regenerates docs/img from the traces; bench/live.sh
// compares a live kvproxy in front of simulated engines with the simulator.
//
// kvbench owns flags and output only; workloads, the simulator, the replay
// client and the charts live in package bench. It knows nothing of the
// router's internals.
package main
