package mockengine_test

import (
	"fmt"
	"time"

	"github.com/kvproxy/kvproxy/mockengine"
)

// A Model runs on whatever clock its caller keeps: here a virtual one, as the
// fleet simulator does. Each Step says how long it takes and which sequences
// produced a token.
func ExampleModel() {
	m := mockengine.NewModel(mockengine.ModelConfig{BlockSize: 16, CacheBlocks: 1000})
	prompt := make([]uint32, 200)
	for i := range prompt {
		prompt[i] = uint32(1000 + i)
	}
	var now time.Duration
	for id := uint64(1); id <= 2; id++ {
		if err := m.Add(&mockengine.Seq{ID: id, Prompt: prompt, MaxTokens: 3}); err != nil {
			panic(err)
		}
		for !m.Idle() {
			d, out := m.Step()
			now += d
			for _, r := range out {
				if r.Generated == 1 {
					fmt.Printf("seq %d: first token at %v, %d prompt tokens cached\n", r.Seq.ID, now.Round(time.Millisecond), r.CachedTokens)
				}
				if r.Finished {
					fmt.Printf("seq %d: done at %v\n", r.Seq.ID, now.Round(time.Millisecond))
				}
			}
		}
	}
	// Output:
	// seq 1: first token at 20ms, 0 prompt tokens cached
	// seq 1: done at 32ms
	// seq 2: first token at 49ms, 192 prompt tokens cached
	// seq 2: done at 62ms
}
