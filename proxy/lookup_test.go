package proxy

import (
	"encoding/json"
	"testing"
)

// TestBlockHashTakesEscapedStrings: a block hash is read as its JSON value:
// "\u0031" is the string "1" (it was refused, the escape read as digits).
func TestBlockHashTakesEscapedStrings(t *testing.T) {
	for in, want := range map[string]blockHash{`"1"`: 1, `"\u0031\u0032"`: 12, `18446744073709551615`: 1<<64 - 1, `"18446744073709551615"`: 1<<64 - 1} {
		var h blockHash
		if err := json.Unmarshal([]byte(in), &h); err != nil || h != want {
			t.Errorf("%s: %d %v, want %d", in, h, err, want)
		}
	}
	for _, in := range []string{`"+1"`, `" 1"`, `""`, `"18446744073709551616"`, `-1`, `1.5`, `null`} {
		var h blockHash
		if err := json.Unmarshal([]byte(in), &h); err == nil {
			t.Errorf("%s: accepted as %d", in, h)
		}
	}
}
