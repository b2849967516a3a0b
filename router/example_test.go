package router_test

import (
	"fmt"
	"time"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

// One request's life: route, first token, output blocks, end.
func Example() {
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		panic(err)
	}
	r.AddWorker("gpu-a")
	r.AddWorker("gpu-b")

	tokens := make([]uint32, 100) // a tokenized prompt
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	req := &router.Request{Hashes: kv.HashBlocks(nil, tokens, 16, 0), PromptTokens: len(tokens)}

	dry, _ := r.Select(req) // a dry run changes nothing
	d, active, err := r.Route(req)
	if err != nil {
		panic(err)
	}
	fmt.Println("same worker as the dry run:", dry.Worker == d.Worker)
	fmt.Println("blocks:", d.Total, "cached:", d.Overlap)

	active.PrefillDone() // first token arrived
	active.ObserveTTFT(40 * time.Millisecond)
	active.OutputBlock() // 16 more output tokens
	active.Free()        // stream ended; exactly once, idempotent

	again, _ := r.Select(req)
	fmt.Println("next time cached:", again.Overlap, "on the same worker:", again.Worker == d.Worker)
	fmt.Println("idle:", r.Idle())
	// Output:
	// same worker as the dry run: true
	// blocks: 6 cached: 0
	// next time cached: 6 on the same worker: true
	// idle: true
}
