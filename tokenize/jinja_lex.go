package tokenize

import (
	"fmt"
	"regexp"
	"strings"
)

// This file and jinja_*.go implement the subset of Jinja that Hugging Face
// chat templates use (Llama 3, Qwen 2/3 and the like): text, {{ }}, {% if
// / elif / else / for / set %}, whitespace control, trim_blocks and
// lstrip_blocks as transformers applies them, Python-like values, the common
// filters, tests and string methods. Anything else is a parse error naming
// it, never silently different output.

type jtokKind uint8

const (
	jtText jtokKind = iota
	jtName
	jtString
	jtInt
	jtFloat
	jtOp
	jtOutputOpen  // {{
	jtOutputClose // }}
	jtBlockOpen   // {%
	jtBlockClose  // %}
	jtEOF
)

type jtok struct {
	kind jtokKind
	s    string
	pos  int
}

var (
	jLstrip = regexp.MustCompile(`(?m)^[ \t]*(\{[#%-])`)
	jTrim   = regexp.MustCompile(`([#%-]\})\n`)
	jGenTag = regexp.MustCompile(`(?s)(\s*)\{%(-?)\s*(?:end)?generation\s*(-?)%\}(\s*)`)
)

// jinjaPreprocess applies lstrip_blocks and trim_blocks and drops a final
// newline, as transformers does before parsing a chat template.
func jinjaPreprocess(src string) string {
	src = strings.TrimSuffix(src, "\n")
	src = jLstrip.ReplaceAllString(src, "$1")
	src = jTrim.ReplaceAllString(src, "$1")
	return jGenTag.ReplaceAllStringFunc(src, func(m string) string {
		g := jGenTag.FindStringSubmatch(m)
		out := ""
		if g[2] == "" {
			out += g[1]
		}
		if g[3] == "" {
			out += g[4]
		}
		return out
	})
}

func jinjaLex(src string) ([]jtok, error) {
	src = jinjaPreprocess(src)
	var toks []jtok
	i := 0
	stripNext := false
	for i < len(src) {
		// Text up to the next tag.
		j := i
		for j < len(src) {
			k := strings.IndexByte(src[j:], '{')
			if k < 0 {
				j = len(src)
				break
			}
			j += k
			if j+1 < len(src) && (src[j+1] == '{' || src[j+1] == '%' || src[j+1] == '#') {
				break
			}
			j++
		}
		text := src[i:j]
		if stripNext {
			text = strings.TrimLeft(text, " \t\n\r")
			stripNext = false
		}
		if j < len(src) && j+2 < len(src) && src[j+2] == '-' {
			text = strings.TrimRight(text, " \t\n\r")
		}
		if text != "" {
			toks = append(toks, jtok{kind: jtText, s: text, pos: i})
		}
		if j >= len(src) {
			break
		}
		open := src[j+1]
		i = j + 2
		if i < len(src) && (src[i] == '-' || src[i] == '+') {
			i++
		}
		if open == '#' {
			end := strings.Index(src[i:], "#}")
			if end < 0 {
				return nil, fmt.Errorf("unclosed comment at offset %d", j)
			}
			stripNext = end > 0 && src[i+end-1] == '-'
			i += end + 2
			continue
		}
		closeTok := jtOutputClose
		openTok := jtOutputOpen
		if open == '%' {
			openTok, closeTok = jtBlockOpen, jtBlockClose
		}
		toks = append(toks, jtok{kind: openTok, pos: j})
		var err error
		toks, i, stripNext, err = lexTag(src, i, toks, closeTok)
		if err != nil {
			return nil, err
		}
	}
	return append(toks, jtok{kind: jtEOF, pos: len(src)}), nil
}

var jOps = []string{"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|", "="}

// lexTag lexes the inside of {{ }} or {% %} from i, up to and including the
// closing delimiter.
func lexTag(src string, i int, toks []jtok, closeTok jtokKind) ([]jtok, int, bool, error) {
	closer := "}}"
	if closeTok == jtBlockClose {
		closer = "%}"
	}
	depth := 0
	for i < len(src) {
		c := src[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case depth == 0 && strings.HasPrefix(src[i:], "-"+closer):
			return append(toks, jtok{kind: closeTok, pos: i}), i + 3, true, nil
		case depth == 0 && strings.HasPrefix(src[i:], closer):
			return append(toks, jtok{kind: closeTok, pos: i}), i + 2, false, nil
		case c == '\'' || c == '"':
			s, n, err := lexString(src[i:])
			if err != nil {
				return nil, 0, false, fmt.Errorf("offset %d: %w", i, err)
			}
			toks = append(toks, jtok{kind: jtString, s: s, pos: i})
			i += n
		case c >= '0' && c <= '9':
			j := i
			for j < len(src) && src[j] >= '0' && src[j] <= '9' {
				j++
			}
			kind := jtInt
			if j+1 < len(src) && src[j] == '.' && src[j+1] >= '0' && src[j+1] <= '9' {
				kind = jtFloat
				for j++; j < len(src) && src[j] >= '0' && src[j] <= '9'; j++ {
				}
			}
			toks = append(toks, jtok{kind: kind, s: src[i:j], pos: i})
			i = j
		case c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z':
			j := i
			for j < len(src) && (src[j] == '_' || src[j] >= 'a' && src[j] <= 'z' || src[j] >= 'A' && src[j] <= 'Z' || src[j] >= '0' && src[j] <= '9') {
				j++
			}
			toks = append(toks, jtok{kind: jtName, s: src[i:j], pos: i})
			i = j
		default:
			op := ""
			for _, o := range jOps {
				if strings.HasPrefix(src[i:], o) {
					op = o
					break
				}
			}
			if op == "" {
				return nil, 0, false, fmt.Errorf("offset %d: unexpected character %q", i, c)
			}
			switch op {
			case "(", "[", "{":
				depth++
			case ")", "]", "}":
				depth--
			}
			toks = append(toks, jtok{kind: jtOp, s: op, pos: i})
			i += len(op)
		}
	}
	return nil, 0, false, fmt.Errorf("unclosed tag: missing %q", closer)
}

func lexString(s string) (string, int, error) {
	q := s[0]
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		c := s[i]
		switch {
		case c == q:
			return b.String(), i + 1, nil
		case c == '\\' && i+1 < len(s):
			i++
			switch s[i] {
			case 'n':
				b.WriteByte('\n')
			case 't':
				b.WriteByte('\t')
			case 'r':
				b.WriteByte('\r')
			case '\\', '\'', '"':
				b.WriteByte(s[i])
			default:
				b.WriteByte('\\')
				b.WriteByte(s[i])
			}
		default:
			b.WriteByte(c)
		}
	}
	return "", 0, fmt.Errorf("unterminated string")
}
