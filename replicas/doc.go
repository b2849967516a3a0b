// Package replicas shares the load each kvproxy replica puts on the engines
// with the other replicas, over one NATS core subject: several replicas
// behind an L4 balancer then weigh each other's in-flight requests and do
// not pile onto the same engine (as Dynamo's replica sync does). Their
// cache indexes need no sharing: each subscribes to every engine's KV
// events itself.
//
// It owns the wire format and the peers' reports, and knows nothing of
// routing: it publishes what its Local function returns, and hands the sum
// of what the other replicas report to its Apply function. A replica that
// stops reporting (gone, or cut off from NATS) drops out after three
// intervals; with NATS unreachable every replica routes on its own load.
package replicas
