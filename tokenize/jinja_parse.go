package tokenize

import (
	"fmt"
	"strconv"
)

type jnode interface{}

type (
	jText   string
	jOutput struct{ e jexpr }
	jIf     struct {
		conds  []jexpr
		bodies [][]jnode
		els    []jnode
	}
	jFor struct {
		vars []string
		iter jexpr
		cond jexpr // optional "if" filter
		body []jnode
		els  []jnode
	}
	jLoopControl string // "break" or "continue"
	jSet         struct {
		name, attr string // name.attr = e when attr != ""
		e          jexpr
	}
)

type jexpr interface{}

type (
	jLit  struct{ v any }
	jVar  struct{ name string }
	jAttr struct {
		x    jexpr
		name string
	}
	jIndex struct{ x, i jexpr }
	jSlice struct{ x, lo, hi, step jexpr }
	jCall  struct {
		fn     jexpr
		args   []jexpr
		kwargs map[string]jexpr
	}
	jFilter struct {
		x      jexpr
		name   string
		args   []jexpr
		kwargs map[string]jexpr
	}
	jTest struct {
		x    jexpr
		name string
		neg  bool
		args []jexpr
	}
	jSum struct{ ops []jexpr } // a + b + c ..., left to right
	jBin struct {
		op   string
		l, r jexpr
	}
	jNot  struct{ x jexpr }
	jNeg  struct{ x jexpr }
	jCond struct{ cond, a, b jexpr }
	jList struct{ items []jexpr }
	jDict struct{ keys, vals []jexpr }
)

type jparser struct {
	toks []jtok
	p    int
}

func (p *jparser) peek() jtok { return p.toks[p.p] }
func (p *jparser) next() jtok { t := p.toks[p.p]; p.p++; return t }

func (p *jparser) errf(format string, args ...any) error {
	return fmt.Errorf("chat template offset %d: %s", p.peek().pos, fmt.Sprintf(format, args...))
}

func (p *jparser) isOp(s string) bool {
	t := p.peek()
	return t.kind == jtOp && t.s == s
}

func (p *jparser) isName(s string) bool {
	t := p.peek()
	return t.kind == jtName && t.s == s
}

func (p *jparser) expectOp(s string) error {
	if !p.isOp(s) {
		return p.errf("expected %q", s)
	}
	p.p++
	return nil
}

func (p *jparser) expectName() (string, error) {
	t := p.peek()
	if t.kind != jtName {
		return "", p.errf("expected a name")
	}
	p.p++
	return t.s, nil
}

func (p *jparser) expectKind(k jtokKind, what string) error {
	if p.peek().kind != k {
		return p.errf("expected %s", what)
	}
	p.p++
	return nil
}

func jinjaParse(src string) ([]jnode, error) {
	toks, err := jinjaLex(src)
	if err != nil {
		return nil, fmt.Errorf("chat template: %w", err)
	}
	p := &jparser{toks: toks}
	body, end, err := p.parseBody()
	if err != nil {
		return nil, err
	}
	if end != "" {
		return nil, p.errf("unexpected {%% %s %%}", end)
	}
	return body, nil
}

// parseBody parses nodes up to EOF or a block tag that ends the enclosing
// statement (returned, with the parser positioned after the tag name).
func (p *jparser) parseBody() ([]jnode, string, error) {
	var body []jnode
	for {
		t := p.next()
		switch t.kind {
		case jtEOF:
			p.p--
			return body, "", nil
		case jtText:
			body = append(body, jText(t.s))
		case jtOutputOpen:
			e, err := p.parseExpr()
			if err != nil {
				return nil, "", err
			}
			if err := p.expectKind(jtOutputClose, "}}"); err != nil {
				return nil, "", err
			}
			body = append(body, jOutput{e})
		case jtBlockOpen:
			name, err := p.expectName()
			if err != nil {
				return nil, "", err
			}
			switch name {
			case "if":
				n, err := p.parseIf()
				if err != nil {
					return nil, "", err
				}
				body = append(body, n)
			case "for":
				n, err := p.parseFor()
				if err != nil {
					return nil, "", err
				}
				body = append(body, n)
			case "set":
				n, err := p.parseSet()
				if err != nil {
					return nil, "", err
				}
				body = append(body, n)
			case "break", "continue": // transformers enables Jinja's loopcontrols
				if err := p.expectKind(jtBlockClose, "%}"); err != nil {
					return nil, "", err
				}
				body = append(body, jLoopControl(name))
			case "elif", "else", "endif", "endfor":
				return body, name, nil
			default:
				return nil, "", fmt.Errorf("chat template offset %d: unsupported tag {%% %s %%}", t.pos, name)
			}
		default:
			return nil, "", fmt.Errorf("chat template offset %d: unexpected token", t.pos)
		}
	}
}

func (p *jparser) parseIf() (jnode, error) {
	n := &jIf{}
	for {
		cond, err := p.parseExpr()
		if err != nil {
			return nil, err
		}
		if err := p.expectKind(jtBlockClose, "%}"); err != nil {
			return nil, err
		}
		body, end, err := p.parseBody()
		if err != nil {
			return nil, err
		}
		n.conds, n.bodies = append(n.conds, cond), append(n.bodies, body)
		switch end {
		case "elif":
			continue
		case "else":
			if err := p.expectKind(jtBlockClose, "%}"); err != nil {
				return nil, err
			}
			els, end, err := p.parseBody()
			if err != nil {
				return nil, err
			}
			if end != "endif" {
				return nil, p.errf("expected {%% endif %%}")
			}
			n.els = els
			return n, p.expectKind(jtBlockClose, "%}")
		case "endif":
			return n, p.expectKind(jtBlockClose, "%}")
		default:
			return nil, p.errf("expected {%% endif %%}")
		}
	}
}

func (p *jparser) parseFor() (jnode, error) {
	n := &jFor{}
	for {
		v, err := p.expectName()
		if err != nil {
			return nil, err
		}
		n.vars = append(n.vars, v)
		if !p.isOp(",") {
			break
		}
		p.p++
	}
	if !p.isName("in") {
		return nil, p.errf("expected 'in'")
	}
	p.p++
	iter, err := p.parseOr() // not parseExpr: "if" here filters the loop
	if err != nil {
		return nil, err
	}
	n.iter = iter
	if p.isName("if") {
		p.p++
		if n.cond, err = p.parseOr(); err != nil {
			return nil, err
		}
	}
	if err := p.expectKind(jtBlockClose, "%}"); err != nil {
		return nil, err
	}
	body, end, err := p.parseBody()
	if err != nil {
		return nil, err
	}
	n.body = body
	if end == "else" {
		if err := p.expectKind(jtBlockClose, "%}"); err != nil {
			return nil, err
		}
		if n.els, end, err = p.parseBody(); err != nil {
			return nil, err
		}
	}
	if end != "endfor" {
		return nil, p.errf("expected {%% endfor %%}")
	}
	return n, p.expectKind(jtBlockClose, "%}")
}

func (p *jparser) parseSet() (jnode, error) {
	name, err := p.expectName()
	if err != nil {
		return nil, err
	}
	n := &jSet{name: name}
	if p.isOp(".") {
		p.p++
		if n.attr, err = p.expectName(); err != nil {
			return nil, err
		}
	}
	if !p.isOp("=") {
		return nil, p.errf("unsupported: {%% set %%} blocks (only {%% set x = expr %%})")
	}
	p.p++
	if n.e, err = p.parseExpr(); err != nil {
		return nil, err
	}
	return n, p.expectKind(jtBlockClose, "%}")
}

// Expressions, lowest precedence first.

func (p *jparser) parseExpr() (jexpr, error) {
	a, err := p.parseOr()
	if err != nil {
		return nil, err
	}
	if !p.isName("if") {
		return a, nil
	}
	p.p++
	cond, err := p.parseOr()
	if err != nil {
		return nil, err
	}
	var b jexpr = jLit{undefined}
	if p.isName("else") {
		p.p++
		if b, err = p.parseExpr(); err != nil {
			return nil, err
		}
	}
	return jCond{cond, a, b}, nil
}

func (p *jparser) parseOr() (jexpr, error) {
	l, err := p.parseAnd()
	for err == nil && p.isName("or") {
		p.p++
		var r jexpr
		r, err = p.parseAnd()
		l = jBin{"or", l, r}
	}
	return l, err
}

func (p *jparser) parseAnd() (jexpr, error) {
	l, err := p.parseNot()
	for err == nil && p.isName("and") {
		p.p++
		var r jexpr
		r, err = p.parseNot()
		l = jBin{"and", l, r}
	}
	return l, err
}

func (p *jparser) parseNot() (jexpr, error) {
	if p.isName("not") {
		p.p++
		x, err := p.parseNot()
		return jNot{x}, err
	}
	return p.parseCompare()
}

func (p *jparser) parseCompare() (jexpr, error) {
	l, err := p.parseAdd()
	for err == nil {
		t := p.peek()
		op := ""
		switch {
		case t.kind == jtOp && (t.s == "==" || t.s == "!=" || t.s == "<" || t.s == ">" || t.s == "<=" || t.s == ">="):
			op = t.s
		case t.kind == jtName && t.s == "in":
			op = "in"
		case t.kind == jtName && t.s == "not" && p.toks[p.p+1].kind == jtName && p.toks[p.p+1].s == "in":
			op = "not in"
			p.p++
		default:
			return l, nil
		}
		p.p++
		var r jexpr
		r, err = p.parseAdd()
		l = jBin{op, l, r}
	}
	return l, err
}

func (p *jparser) parseAdd() (jexpr, error) {
	l, err := p.parseConcat()
	for err == nil && (p.isOp("+") || p.isOp("-")) {
		op := p.next().s
		var r jexpr
		r, err = p.parseConcat()
		switch s, ok := l.(jSum); {
		case op == "-":
			l = jBin{op, l, r}
		case ok:
			l = jSum{append(s.ops, r)}
		default:
			l = jSum{[]jexpr{l, r}}
		}
	}
	return l, err
}

func (p *jparser) parseConcat() (jexpr, error) {
	l, err := p.parseMul()
	for err == nil && p.isOp("~") {
		p.p++
		var r jexpr
		r, err = p.parseMul()
		l = jBin{"~", l, r}
	}
	return l, err
}

func (p *jparser) parseMul() (jexpr, error) {
	l, err := p.parseUnary()
	for err == nil && (p.isOp("*") || p.isOp("/") || p.isOp("//") || p.isOp("%")) {
		op := p.next().s
		var r jexpr
		r, err = p.parseUnary()
		l = jBin{op, l, r}
	}
	return l, err
}

func (p *jparser) parseUnary() (jexpr, error) {
	if p.isOp("-") {
		p.p++
		x, err := p.parseUnary()
		return jNeg{x}, err
	}
	return p.parsePostfix()
}

func (p *jparser) parsePostfix() (jexpr, error) {
	x, err := p.parsePrimary()
	for err == nil {
		switch {
		case p.isOp("."):
			p.p++
			var name string
			if name, err = p.expectName(); err == nil {
				x = jAttr{x, name}
			}
		case p.isOp("["):
			p.p++
			x, err = p.parseSubscript(x)
		case p.isOp("("):
			p.p++
			var c *jCall
			if c, err = p.parseArgs(); err == nil {
				c.fn = x
				x = *c
			}
		case p.isOp("|"):
			p.p++
			var name string
			if name, err = p.expectName(); err != nil {
				break
			}
			if !jFilters[name] {
				err = p.errf("unsupported filter %q", name)
				break
			}
			f := jFilter{x: x, name: name}
			if p.isOp("(") {
				p.p++
				var c *jCall
				if c, err = p.parseArgs(); err == nil {
					f.args, f.kwargs = c.args, c.kwargs
				}
			}
			x = f
		case p.isName("is"):
			p.p++
			t := jTest{x: x}
			if p.isName("not") {
				p.p++
				t.neg = true
			}
			if t.name, err = p.expectName(); err != nil {
				break
			}
			if !jTests[t.name] {
				err = p.errf("unsupported test %q", t.name)
				break
			}
			if p.isOp("(") {
				p.p++
				var c *jCall
				if c, err = p.parseArgs(); err == nil {
					t.args = c.args
				}
			} else if k := p.peek().kind; k == jtString || k == jtInt || k == jtFloat {
				var a jexpr
				if a, err = p.parsePrimary(); err == nil {
					t.args = []jexpr{a}
				}
			}
			x = t
		default:
			return x, nil
		}
	}
	return nil, err
}

func (p *jparser) parseSubscript(x jexpr) (jexpr, error) {
	var parts [3]jexpr
	n, colons := 0, 0
	for {
		if p.isOp("]") {
			p.p++
			break
		}
		if p.isOp(":") {
			p.p++
			colons++
			n++
			if n > 2 {
				return nil, p.errf("bad slice")
			}
			continue
		}
		e, err := p.parseExpr()
		if err != nil {
			return nil, err
		}
		parts[n] = e
	}
	if colons == 0 {
		if parts[0] == nil {
			return nil, p.errf("empty subscript")
		}
		return jIndex{x, parts[0]}, nil
	}
	return jSlice{x, parts[0], parts[1], parts[2]}, nil
}

// parseArgs parses call arguments after "(".
func (p *jparser) parseArgs() (*jCall, error) {
	c := &jCall{}
	for !p.isOp(")") {
		if t := p.peek(); t.kind == jtName && p.toks[p.p+1].kind == jtOp && p.toks[p.p+1].s == "=" {
			p.p += 2
			e, err := p.parseExpr()
			if err != nil {
				return nil, err
			}
			if c.kwargs == nil {
				c.kwargs = map[string]jexpr{}
			}
			c.kwargs[t.s] = e
		} else {
			e, err := p.parseExpr()
			if err != nil {
				return nil, err
			}
			c.args = append(c.args, e)
		}
		if !p.isOp(",") {
			break
		}
		p.p++
	}
	return c, p.expectOp(")")
}

func (p *jparser) parsePrimary() (jexpr, error) {
	t := p.next()
	switch t.kind {
	case jtString:
		s := t.s
		for p.peek().kind == jtString { // adjacent literals concatenate
			s += p.next().s
		}
		return jLit{s}, nil
	case jtInt:
		v, err := strconv.ParseInt(t.s, 10, 64)
		return jLit{v}, err
	case jtFloat:
		v, err := strconv.ParseFloat(t.s, 64)
		return jLit{v}, err
	case jtName:
		switch t.s {
		case "true", "True":
			return jLit{true}, nil
		case "false", "False":
			return jLit{false}, nil
		case "none", "None":
			return jLit{nil}, nil
		}
		return jVar{t.s}, nil
	case jtOp:
		switch t.s {
		case "(":
			e, err := p.parseExpr()
			if err != nil {
				return nil, err
			}
			if p.isOp(",") { // a tuple: treat as a list
				l := jList{items: []jexpr{e}}
				for p.isOp(",") {
					p.p++
					if p.isOp(")") {
						break
					}
					it, err := p.parseExpr()
					if err != nil {
						return nil, err
					}
					l.items = append(l.items, it)
				}
				e = l
			}
			return e, p.expectOp(")")
		case "[":
			l := jList{}
			for !p.isOp("]") {
				e, err := p.parseExpr()
				if err != nil {
					return nil, err
				}
				l.items = append(l.items, e)
				if !p.isOp(",") {
					break
				}
				p.p++
			}
			return l, p.expectOp("]")
		case "{":
			d := jDict{}
			for !p.isOp("}") {
				k, err := p.parseExpr()
				if err != nil {
					return nil, err
				}
				if err := p.expectOp(":"); err != nil {
					return nil, err
				}
				v, err := p.parseExpr()
				if err != nil {
					return nil, err
				}
				d.keys, d.vals = append(d.keys, k), append(d.vals, v)
				if !p.isOp(",") {
					break
				}
				p.p++
			}
			return d, p.expectOp("}")
		}
	}
	p.p--
	return nil, p.errf("unexpected %q in expression", t.s)
}
