package proxy

import (
	"bytes"
	"math"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// Engines written in Python build parts of a prompt with Python's own
// serializer: vLLM's Anthropic endpoint passes a tool call's input to the
// chat template as json.dumps(input). kvproxy writes it the same way, so
// that the prompt it hashes is the engine's.

// appendPyDumps appends json.dumps(raw), raw valid JSON, with Python's
// defaults: separators ", " and ": ", ensure_ascii, members in their order.
func appendPyDumps(dst, raw []byte) []byte {
	i := skipSpace(raw, 0)
	if i >= len(raw) {
		return dst
	}
	switch c := raw[i]; c {
	case '{':
		dst = append(dst, '{')
		n := 0
		for m := (members{b: raw[i:]}); m.next(); n++ {
			if n > 0 {
				dst = append(dst, ", "...)
			}
			dst = appendPyString(dst, unescaped(m.key))
			dst = append(dst, ": "...)
			dst = appendPyDumps(dst, m.value)
		}
		return append(dst, '}')
	case '[':
		dst = append(dst, '[')
		n := 0
		for e := (elements{b: raw[i:]}); e.next(); n++ {
			if n > 0 {
				dst = append(dst, ", "...)
			}
			dst = appendPyDumps(dst, e.value)
		}
		return append(dst, ']')
	case '"':
		end, _ := skipValue(raw, i)
		return appendPyString(dst, unescaped(raw[i+1:end-1]))
	case 't', 'f', 'n':
		end, _ := skipValue(raw, i)
		return append(dst, raw[i:end]...)
	}
	end, _ := skipValue(raw, i)
	return appendPyNumber(dst, raw[i:end])
}

// unescaped is a JSON string's content decoded: its own bytes when it has
// no escape.
func unescaped(s []byte) []byte {
	if bytes.IndexByte(s, '\\') < 0 {
		return s
	}
	return appendUnquoted(nil, s)
}

// appendPyNumber writes a JSON number as Python does after json.loads: an
// integer as it is (-0 is 0), any other as repr(float).
func appendPyNumber(dst, num []byte) []byte {
	isInt := true
	for _, c := range num {
		if c == '.' || c == 'e' || c == 'E' {
			isInt = false
		}
	}
	if isInt {
		if string(num) == "-0" {
			return append(dst, '0')
		}
		return append(dst, num...)
	}
	f, err := strconv.ParseFloat(string(num), 64)
	if err != nil || math.IsInf(f, 0) {
		return append(dst, num...) // out of a float's range: Python's inf, never sent
	}
	return appendPyFloat(dst, f)
}

// appendPyFloat writes repr(f): the shortest digits, fixed notation when the
// decimal exponent is from -4 to 15 (with at least one decimal), else
// scientific with a two-digit exponent at least.
func appendPyFloat(dst []byte, f float64) []byte {
	e := strconv.AppendFloat(nil, f, 'e', -1, 64)
	k := len(e) - 1
	for e[k] != 'e' {
		k--
	}
	exp, _ := strconv.Atoi(string(e[k+1:]))
	if exp < -4 || exp > 15 {
		return append(dst, e...) // Go writes e+16, e-05: as Python does
	}
	start := len(dst)
	dst = strconv.AppendFloat(dst, f, 'f', -1, 64)
	for _, c := range dst[start:] {
		if c == '.' {
			return dst
		}
	}
	return append(dst, ".0"...)
}

// appendPyString writes s as json.dumps (ensure_ascii) writes it.
func appendPyString(dst, s []byte) []byte {
	dst = append(dst, '"')
	for len(s) > 0 {
		r, n := utf8.DecodeRune(s)
		s = s[n:]
		switch {
		case r == '"' || r == '\\':
			dst = append(dst, '\\', byte(r))
		case r == '\n':
			dst = append(dst, `\n`...)
		case r == '\r':
			dst = append(dst, `\r`...)
		case r == '\t':
			dst = append(dst, `\t`...)
		case r == '\b':
			dst = append(dst, `\b`...)
		case r == '\f':
			dst = append(dst, `\f`...)
		case r < 0x20 || r >= 0x7f:
			if r > 0xffff {
				r1, r2 := utf16.EncodeRune(r)
				dst = appendU4(dst, r1)
				dst = appendU4(dst, r2)
			} else {
				dst = appendU4(dst, r)
			}
		default:
			dst = append(dst, byte(r))
		}
	}
	return append(dst, '"')
}

// appendU4 writes \u.... with lowercase hex digits.
func appendU4(dst []byte, r rune) []byte {
	const hex = "0123456789abcdef"
	return append(dst, '\\', 'u', hex[r>>12&0xf], hex[r>>8&0xf], hex[r>>4&0xf], hex[r&0xf])
}
