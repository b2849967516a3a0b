// Package bench measures routing: it loads request traces (Mooncake JSONL,
// Azure CSV, a generated multi-turn chat workload), synthesizes their token
// ids deterministically, simulates a fleet of engines on a virtual clock with
// the real router making every decision, replays workloads against a live
// kvproxy over HTTP, and writes reports and charts.
//
// It owns workloads, the simulator's event loop, the replay client and the
// report format. It must not know how the router scores workers or how the
// mock engine times a step: it drives their public APIs and reads the clock.
package bench
