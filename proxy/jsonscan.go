package proxy

import (
	"bytes"
	"errors"
	"unicode/utf16"
	"unicode/utf8"
)

// Scanning of JSON that json.Valid has accepted: these helpers find value
// boundaries and decode strings without allocating, and do not check the
// syntax again.

var errNotObject = errors.New("not a JSON object")

// members walks the members of a JSON object:
//
//	for m := (members{b: obj}); m.next(); { ... m.key, m.value ... }
//
// key is the member name's raw bytes without the quotes (escapes not
// decoded: compare with keyIs), value the raw value, member the whole
// `"key": value`. err is set when b is not an object.
type members struct {
	b                  []byte
	i                  int
	started            bool
	key, value, member []byte
	err                error
}

func (m *members) next() bool {
	b, i := m.b, m.i
	if !m.started {
		m.started = true
		i = skipSpace(b, 0)
		if i >= len(b) || b[i] != '{' {
			m.err = errNotObject
			return false
		}
		if i = skipSpace(b, i+1); i < len(b) && b[i] == '}' {
			m.i = len(b)
			return false
		}
	} else {
		if i = skipSpace(b, i); i >= len(b) || b[i] != ',' {
			if i >= len(b) || b[i] != '}' {
				m.err = errNotObject
			}
			m.i = len(b)
			return false
		}
		i = skipSpace(b, i+1)
	}
	start := i
	end, err := skipValue(b, i) // the key, a string
	if err != nil || b[start] != '"' {
		m.err = errNotObject
		return false
	}
	m.key = b[start+1 : end-1]
	if i = skipSpace(b, end); i >= len(b) || b[i] != ':' {
		m.err = errNotObject
		return false
	}
	i = skipSpace(b, i+1)
	if end, err = skipValue(b, i); err != nil {
		m.err = err
		return false
	}
	m.value, m.member, m.i = b[i:end], b[start:end], end
	return true
}

// elements walks the elements of a JSON array, each in value.
type elements struct {
	b       []byte
	i       int
	started bool
	value   []byte
}

func (e *elements) next() bool {
	b, i := e.b, e.i
	if !e.started {
		e.started = true
		if i = skipSpace(b, 0); i >= len(b) || b[i] != '[' {
			return false
		}
		if i = skipSpace(b, i+1); i < len(b) && b[i] == ']' {
			return false
		}
	} else {
		if i = skipSpace(b, i); i >= len(b) || b[i] != ',' {
			return false
		}
		i = skipSpace(b, i+1)
	}
	end, err := skipValue(b, i)
	if err != nil {
		return false
	}
	e.value, e.i = b[i:end], end
	return true
}

// keyIs reports whether the raw member name key (as members gives it)
// names the field name, matched as the engines' parsers (Python's json and
// pydantic) match names: exactly, after decoding escapes. name must be ASCII.
func keyIs(key []byte, name string) bool {
	if string(key) == name {
		return true
	}
	// Only an escape can make a longer key equal name; 6: every rune escaped.
	if len(key) <= len(name) || len(key) > 6*len(name) || bytes.IndexByte(key, '\\') < 0 {
		return false
	}
	var buf [128]byte
	return string(appendUnquoted(buf[:0], key)) == name
}

// plainString reports whether the contents of a JSON string (without
// quotes) decode to themselves: no escapes, valid UTF-8.
func plainString(s []byte) bool {
	return bytes.IndexByte(s, '\\') < 0 && utf8.Valid(s)
}

// appendJSONString appends the decoded value of the JSON string token tok
// (quotes included).
func appendJSONString(dst, tok []byte) []byte {
	return appendUnquoted(dst, tok[1:len(tok)-1])
}

// appendUnquoted appends the decoded contents s of a valid JSON string, as
// encoding/json decodes them: invalid UTF-8 bytes and unpaired surrogate
// escapes become U+FFFD.
func appendUnquoted(dst, s []byte) []byte {
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == '\\':
			i++
			switch s[i] {
			case 'b':
				dst = append(dst, '\b')
			case 'f':
				dst = append(dst, '\f')
			case 'n':
				dst = append(dst, '\n')
			case 'r':
				dst = append(dst, '\r')
			case 't':
				dst = append(dst, '\t')
			case 'u':
				r := hex4(s[i+1:])
				i += 4
				if utf16.IsSurrogate(r) {
					r2 := rune(-1)
					if i+6 < len(s) && s[i+1] == '\\' && s[i+2] == 'u' {
						r2 = hex4(s[i+3:])
					}
					if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
						r = dec
						i += 6
					} else {
						r = utf8.RuneError
					}
				}
				dst = utf8.AppendRune(dst, r)
			default: // " \ /
				dst = append(dst, s[i])
			}
			i++
		case c < utf8.RuneSelf:
			dst = append(dst, c)
			i++
		default:
			r, n := utf8.DecodeRune(s[i:])
			if r == utf8.RuneError && n == 1 {
				dst = utf8.AppendRune(dst, utf8.RuneError)
			} else {
				dst = append(dst, s[i:i+n]...)
			}
			i += n
		}
	}
	return dst
}

// hex4 is the value of the four hex digits at the start of s; U+FFFD when
// s is shorter (an engine's text is not validated: the fuzzing trial read
// past the slice).
func hex4(s []byte) rune {
	if len(s) < 4 {
		return utf8.RuneError
	}
	var r rune
	for _, c := range s[:4] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		default:
			c -= 'A' - 10
		}
		r = r<<4 | rune(c)
	}
	return r
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipValue returns the end of the JSON value starting at b[i].
func skipValue(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, errNotObject
	}
	switch b[i] {
	case '"':
		// Most strings in a request (names, roles) are short: walk them.
		j := i + 1
		for end := min(j+32, len(b)); j < end; j++ {
			switch b[j] {
			case '\\':
				j++
			case '"':
				return j + 1, nil
			}
		}
		for {
			if j >= len(b) {
				return 0, errNotObject
			}
			k := bytes.IndexByte(b[j:], '"')
			if k < 0 {
				return 0, errNotObject
			}
			j += k
			// The quote ends the string unless an odd run of backslashes
			// escapes it.
			n := 0
			for b[j-1-n] == '\\' {
				n++
			}
			if n%2 == 0 {
				return j + 1, nil
			}
			j++
		}
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				end, err := skipValue(b, j)
				if err != nil {
					return 0, err
				}
				j = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, errNotObject
	default: // number, true, false, null
		j := i
		for j < len(b) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ' ' && b[j] != '\t' && b[j] != '\n' && b[j] != '\r' {
			j++
		}
		if j == i {
			return 0, errNotObject
		}
		return j, nil
	}
}
