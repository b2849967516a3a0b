package proxy

import (
	"encoding/json"
	"testing"
)

func FuzzAppendJSONQuotedIsMarshal(f *testing.F) {
	for _, s := range []string{"", "plain", "a\"b\\c", "<>&", "\u2028\u2029", "\x00\x1f\x7f", "é😀", "\xff\xfe", "tab\there\nnl\r\b\f"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want, _ := json.Marshal(s)
		if got := appendJSONQuoted(nil, s); string(got) != string(want) {
			t.Fatalf("%q: %s, json.Marshal %s", s, got, want)
		}
	})
}
