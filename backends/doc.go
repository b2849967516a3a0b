// Package backends owns the engine side of kvproxy: HTTP connections to each
// engine (with per-request abort), health probes, metrics scrapes and KV event
// feeds. It turns sockets into messages; routing decisions belong to package
// router and request handling to package proxy.
package backends
