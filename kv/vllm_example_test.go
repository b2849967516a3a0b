package kv_test

import (
	"fmt"

	"github.com/kvproxy/kvproxy/kv"
)

// A vLLM KV event batch round trip: what a publisher sends, what a
// subscriber gets back.
func ExampleVLLMDecoder() {
	tokens := make([]uint32, 32)
	for i := range tokens {
		tokens[i] = uint32(100 + i)
	}
	payload := kv.AppendVLLMBatch(nil, 1700000000.25, []kv.Event{
		{Kind: kv.BlockStored, EngineHashes: []uint64{11, 12}, Tokens: tokens, BlockSize: 16},
		{Kind: kv.BlockRemoved, EngineHashes: []uint64{12}, Tier: kv.TierDevice},
	}, 1, kv.VLLMArrays)

	var d kv.VLLMDecoder
	ts, events, rank, err := d.Decode(payload)
	if err != nil {
		panic(err)
	}
	fmt.Println(ts, rank, len(events))
	for _, e := range events {
		// The router re-hashes stored blocks from their token ids.
		own := kv.HashBlocks(nil, e.Tokens, e.BlockSize, kv.NewNamespace(e.LoRAName))
		fmt.Println(e.Kind, e.EngineHashes, e.Tier, len(own))
	}
	// Output:
	// 1.70000000025e+09 1 2
	// 1 [11 12] device 2
	// 2 [12] device 0
}
