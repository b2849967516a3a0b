package proxy

import (
	"bytes"
	"math"
	"strconv"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// Engines written in Python build parts of a prompt with Python's own
// serializers: vLLM's Anthropic endpoint passes a tool call's input to the
// chat template as json.dumps(input), and a tool result given as a list of
// blocks as str(content). kvproxy writes them the same way, so that the
// prompt it hashes is the engine's. raw is valid JSON.

// appendPyDumps appends json.dumps(raw) with Python's defaults: separators
// ", " and ": ", ensure_ascii, members in their order.
func appendPyDumps(dst, raw []byte) []byte {
	return appendPy(dst, raw, false)
}

// appendPyRepr appends str(v) of raw decoded by Python's json: single-quoted
// strings, True, False and None.
func appendPyRepr(dst, raw []byte) []byte {
	return appendPy(dst, raw, true)
}

func appendPy(dst, raw []byte, repr bool) []byte {
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
			dst = appendPyString(dst, unescaped(m.key), repr)
			dst = append(dst, ": "...)
			dst = appendPy(dst, m.value, repr)
		}
		return append(dst, '}')
	case '[':
		dst = append(dst, '[')
		n := 0
		for e := (elements{b: raw[i:]}); e.next(); n++ {
			if n > 0 {
				dst = append(dst, ", "...)
			}
			dst = appendPy(dst, e.value, repr)
		}
		return append(dst, ']')
	case '"':
		end, _ := skipValue(raw, i)
		return appendPyString(dst, unescaped(raw[i+1:end-1]), repr)
	case 't', 'f', 'n':
		if !repr {
			end, _ := skipValue(raw, i)
			return append(dst, raw[i:end]...)
		}
		switch c {
		case 't':
			return append(dst, "True"...)
		case 'f':
			return append(dst, "False"...)
		}
		return append(dst, "None"...)
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

// appendPyString writes s as json.dumps (ensure_ascii) or repr writes it.
func appendPyString(dst, s []byte, repr bool) []byte {
	if !repr {
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
					dst = appendU4(dst, 'u', r1)
					dst = appendU4(dst, 'u', r2)
				} else {
					dst = appendU4(dst, 'u', r)
				}
			default:
				dst = append(dst, byte(r))
			}
		}
		return append(dst, '"')
	}
	// repr: single quotes unless the string has one and no double quote.
	q := byte('\'')
	hasSingle, hasDouble := false, false
	for _, c := range s {
		hasSingle = hasSingle || c == '\''
		hasDouble = hasDouble || c == '"'
	}
	if hasSingle && !hasDouble {
		q = '"'
	}
	dst = append(dst, q)
	for len(s) > 0 {
		r, n := utf8.DecodeRune(s)
		s = s[n:]
		switch {
		case r == rune(q) || r == '\\':
			dst = append(dst, '\\', byte(r))
		case r == '\n':
			dst = append(dst, `\n`...)
		case r == '\r':
			dst = append(dst, `\r`...)
		case r == '\t':
			dst = append(dst, `\t`...)
		case r < 0x20 || r == 0x7f:
			dst = appendU4(dst, 'x', r)
		case r < 0x80 || unicode.IsPrint(r):
			dst = utf8.AppendRune(dst, r)
		case r <= 0xff:
			dst = appendU4(dst, 'x', r)
		case r <= 0xffff:
			dst = appendU4(dst, 'u', r)
		default:
			dst = appendU4(dst, 'U', r)
		}
	}
	return append(dst, q)
}

// appendU4 writes \x.., \u.... or \U........ with lowercase hex digits.
func appendU4(dst []byte, kind byte, r rune) []byte {
	width := 8
	switch kind {
	case 'x':
		width = 2
	case 'u':
		width = 4
	}
	dst = append(dst, '\\', kind)
	h := strconv.FormatInt(int64(r), 16)
	for i := len(h); i < width; i++ {
		dst = append(dst, '0')
	}
	return append(dst, h...)
}
