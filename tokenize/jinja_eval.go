package tokenize

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"
)

// Values: nil (none), jUndefined, bool, int64, jBigInt, float64, string,
// []any, *jDictV, *jLoop, jMethod, jFunc.

// jBigInt is a whole number beyond int64 from JSON (a tool's schema, a
// call's arguments), kept as its digits: Python's are exact, and printing
// one is all a chat template does with it.
type jBigInt string

type jUndefined struct{}

var undefined = jUndefined{}

// jDictV is a dict keeping insertion order (for tojson and iteration).
// Only a namespace() can be changed by a template ({% set ns.x = ... %}),
// as in Jinja, so dicts decoded from a request's JSON can be shared by
// renders (jsonCache).
type jDictV struct {
	keys      []string
	m         map[string]any
	namespace bool

	// A frozen dict is shared by renders: tojson keeps what it wrote.
	frozen bool
	json   atomic.Pointer[jsonText]
}

type jsonText struct {
	indent int
	text   string
}

// jFreeze marks the dicts in v as shared by renders.
func jFreeze(v any) {
	switch v := v.(type) {
	case []any:
		for _, x := range v {
			jFreeze(x)
		}
	case *jDictV:
		v.frozen = true
		for _, x := range v.m {
			jFreeze(x)
		}
	}
}

func newDict() *jDictV { return &jDictV{m: map[string]any{}} }

func (d *jDictV) set(k string, v any) {
	if _, ok := d.m[k]; !ok {
		d.keys = append(d.keys, k)
	}
	d.m[k] = v
}

func (d *jDictV) get(k string) any {
	if v, ok := d.m[k]; ok {
		return v
	}
	return undefined
}

type jLoop struct {
	index0, length int
	items          []any
}

type jMethod struct {
	recv any
	name string
}

type jFunc string

// errRaised is raise_exception's error.
type errRaised struct{ msg string }

func (e errRaised) Error() string { return "chat template: " + e.msg }

type jrender struct {
	out    strings.Builder
	scopes []map[string]any
	stack  []any // operands being summed
}

func (r *jrender) lookup(name string) any {
	for i := len(r.scopes) - 1; i >= 0; i-- {
		if v, ok := r.scopes[i][name]; ok {
			return v
		}
	}
	switch name {
	case "raise_exception", "namespace", "range", "strftime_now":
		return jFunc(name)
	}
	return undefined
}

func (r *jrender) exec(nodes []jnode) error {
	for _, n := range nodes {
		switch n := n.(type) {
		case jText:
			r.out.WriteString(string(n))
		case jOutput:
			if s, ok := n.e.(jSum); ok {
				if err := r.writeSum(s); err != nil {
					return err
				}
				break
			}
			v, err := r.eval(n.e)
			if err != nil {
				return err
			}
			r.out.WriteString(jStr(v))
		case *jIf:
			done := false
			for i, c := range n.conds {
				v, err := r.eval(c)
				if err != nil {
					return err
				}
				if jTruthy(v) {
					if err := r.exec(n.bodies[i]); err != nil {
						return err
					}
					done = true
					break
				}
			}
			if !done {
				if err := r.exec(n.els); err != nil {
					return err
				}
			}
		case *jFor:
			if err := r.execFor(n); err != nil {
				return err
			}
		case jLoopControl:
			if n == "break" {
				return errBreak
			}
			return errContinue
		case *jSet:
			v, err := r.eval(n.e)
			if err != nil {
				return err
			}
			if n.attr == "" {
				r.scopes[len(r.scopes)-1][n.name] = v
				break
			}
			d, ok := r.lookup(n.name).(*jDictV)
			if !ok || !d.namespace {
				return fmt.Errorf("chat template: cannot set attribute %s.%s of a non-namespace object", n.name, n.attr)
			}
			d.set(n.attr, v)
		}
	}
	return nil
}

func (r *jrender) execFor(n *jFor) error {
	it, err := r.eval(n.iter)
	if err != nil {
		return err
	}
	items, err := jIterate(it)
	if err != nil {
		return err
	}
	if n.cond != nil { // {% for x in xs if cond %}: filter first, loop.* counts the kept items
		var kept []any
		for _, item := range items {
			scope := map[string]any{}
			r.scopes = append(r.scopes, scope)
			bindLoopVars(scope, n.vars, item)
			v, err := r.eval(n.cond)
			r.scopes = r.scopes[:len(r.scopes)-1]
			if err != nil {
				return err
			}
			if jTruthy(v) {
				kept = append(kept, item)
			}
		}
		items = kept
	}
	if len(items) == 0 {
		return r.exec(n.els)
	}
	loop := &jLoop{length: len(items), items: items}
	scope := map[string]any{"loop": loop}
	r.scopes = append(r.scopes, scope)
	defer func() { r.scopes = r.scopes[:len(r.scopes)-1] }()
	for i, item := range items {
		loop.index0 = i
		bindLoopVars(scope, n.vars, item)
		if err := r.exec(n.body); err == errBreak {
			break
		} else if err != nil && err != errContinue {
			return err
		}
	}
	return nil
}

// Bounds of what a chat template may build: a configured template is
// trusted, but a hostile one hung the renderer or took 400 MB (the fuzzing
// trial). maxRange is Jinja2's sandbox's MAX_RANGE, which transformers
// renders templates in; maxRepeat is far past any prompt (a template that
// doubles a string in a loop still gets past it).
const (
	maxRange  = 100_000
	maxRepeat = 16 << 20
)

// errBreak and errContinue carry {% break %} and {% continue %} to the
// enclosing loop.
var (
	errBreak    = errors.New("chat template: {% break %} outside a loop")
	errContinue = errors.New("chat template: {% continue %} outside a loop")
)

func bindLoopVars(scope map[string]any, vars []string, item any) {
	if len(vars) == 1 {
		scope[vars[0]] = item
		return
	}
	l, _ := item.([]any)
	for i, v := range vars {
		if i < len(l) {
			scope[v] = l[i]
		} else {
			scope[v] = undefined
		}
	}
}

func jIterate(v any) ([]any, error) {
	if m, ok := v.(*jMsg); ok {
		v = msgDict(m)
	}
	switch v := v.(type) {
	case []any:
		return v, nil
	case *jDictV:
		out := make([]any, len(v.keys))
		for i, k := range v.keys {
			out[i] = k
		}
		return out, nil
	case string:
		out := make([]any, 0, len(v))
		for _, c := range v {
			out = append(out, string(c))
		}
		return out, nil
	case jUndefined, nil:
		return nil, nil
	}
	return nil, fmt.Errorf("chat template: cannot iterate over %s", jTypeName(v))
}

func (r *jrender) eval(e jexpr) (any, error) {
	switch e := e.(type) {
	case jLit:
		return e.v, nil
	case jVar:
		return r.lookup(e.name), nil
	case jAttr:
		x, err := r.eval(e.x)
		if err != nil {
			return nil, err
		}
		return jGetAttr(x, e.name), nil
	case jIndex:
		x, err := r.eval(e.x)
		if err != nil {
			return nil, err
		}
		i, err := r.eval(e.i)
		if err != nil {
			return nil, err
		}
		return jGetItem(x, i), nil
	case jSlice:
		return r.evalSlice(e)
	case jCall:
		return r.evalCall(e)
	case jFilter:
		x, err := r.eval(e.x)
		if err != nil {
			return nil, err
		}
		args, err := r.evalList(e.args)
		if err != nil {
			return nil, err
		}
		var kwargs map[string]any
		for k, ke := range e.kwargs {
			if kwargs == nil {
				kwargs = map[string]any{}
			}
			if kwargs[k], err = r.eval(ke); err != nil {
				return nil, err
			}
		}
		return jApplyFilter(e.name, x, args, kwargs)
	case jTest:
		x, err := r.eval(e.x)
		if err != nil {
			return nil, err
		}
		args, err := r.evalList(e.args)
		if err != nil {
			return nil, err
		}
		ok, err := jApplyTest(e.name, x, args)
		return ok != e.neg, err
	case jNot:
		x, err := r.eval(e.x)
		return !jTruthy(x), err
	case jNeg:
		x, err := r.eval(e.x)
		if err != nil {
			return nil, err
		}
		return jArith("-", int64(0), x)
	case jCond:
		c, err := r.eval(e.cond)
		if err != nil {
			return nil, err
		}
		if jTruthy(c) {
			return r.eval(e.a)
		}
		return r.eval(e.b)
	case jList:
		return r.evalList(e.items)
	case jDict:
		d := newDict()
		for i := range e.keys {
			k, err := r.eval(e.keys[i])
			if err != nil {
				return nil, err
			}
			v, err := r.eval(e.vals[i])
			if err != nil {
				return nil, err
			}
			d.set(jStr(k), v)
		}
		return d, nil
	case jBin:
		return r.evalBin(e)
	case jSum:
		return r.evalSum(e)
	}
	return nil, fmt.Errorf("chat template: cannot evaluate %T", e)
}

func (r *jrender) evalList(es []jexpr) ([]any, error) {
	out := make([]any, 0, len(es))
	for _, e := range es {
		v, err := r.eval(e)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// sumOperands evaluates the operands of a + b + c ... onto r.stack from
// start; the caller truncates r.stack back to start when done.
func (r *jrender) sumOperands(e jSum) (start int, err error) {
	start = len(r.stack)
	for _, op := range e.ops {
		v, err := r.eval(op)
		if err != nil {
			r.stack = r.stack[:start]
			return start, err
		}
		r.stack = append(r.stack, v)
	}
	return start, nil
}

func allStrings(vals []any) bool {
	for _, v := range vals {
		if _, ok := v.(string); !ok {
			return false
		}
	}
	return true
}

// sum adds evaluated operands as Python does, concatenating strings at once.
func sum(vals []any) (any, error) {
	if allStrings(vals) {
		n := 0
		for _, v := range vals {
			n += len(v.(string))
		}
		var b strings.Builder
		b.Grow(n)
		for _, v := range vals {
			b.WriteString(v.(string))
		}
		return b.String(), nil
	}
	acc := vals[0]
	for _, v := range vals[1:] {
		var err error
		if acc, err = jArith("+", acc, v); err != nil {
			return nil, err
		}
	}
	return acc, nil
}

func (r *jrender) evalSum(e jSum) (any, error) {
	start, err := r.sumOperands(e)
	if err != nil {
		return nil, err
	}
	v, err := sum(r.stack[start:])
	clear(r.stack[start:])
	r.stack = r.stack[:start]
	return v, err
}

// writeSum outputs {{ a + b + c ... }} without building the string.
func (r *jrender) writeSum(e jSum) error {
	start, err := r.sumOperands(e)
	if err != nil {
		return err
	}
	vals := r.stack[start:]
	if allStrings(vals) {
		for _, v := range vals {
			r.out.WriteString(v.(string))
		}
	} else {
		v, err := sum(vals)
		if err != nil {
			return err
		}
		r.out.WriteString(jStr(v))
	}
	clear(vals)
	r.stack = r.stack[:start]
	return nil
}

func (r *jrender) evalBin(e jBin) (any, error) {
	l, err := r.eval(e.l)
	if err != nil {
		return nil, err
	}
	switch e.op { // short-circuit, returning operands as Python does
	case "and":
		if !jTruthy(l) {
			return l, nil
		}
		return r.eval(e.r)
	case "or":
		if jTruthy(l) {
			return l, nil
		}
		return r.eval(e.r)
	}
	rv, err := r.eval(e.r)
	if err != nil {
		return nil, err
	}
	switch e.op {
	case "~":
		return jStr(l) + jStr(rv), nil
	case "==":
		return jEqual(l, rv), nil
	case "!=":
		return !jEqual(l, rv), nil
	case "in":
		return jContains(rv, l)
	case "not in":
		ok, err := jContains(rv, l)
		return !ok, err
	case "<", ">", "<=", ">=":
		c, err := jCompare(l, rv)
		if err != nil {
			return nil, err
		}
		switch e.op {
		case "<":
			return c < 0, nil
		case ">":
			return c > 0, nil
		case "<=":
			return c <= 0, nil
		}
		return c >= 0, nil
	}
	return jArith(e.op, l, rv)
}

func (r *jrender) evalSlice(e jSlice) (any, error) {
	x, err := r.eval(e.x)
	if err != nil {
		return nil, err
	}
	var bounds [3]*int64
	for i, b := range []jexpr{e.lo, e.hi, e.step} {
		if b == nil {
			continue
		}
		v, err := r.eval(b)
		if err != nil {
			return nil, err
		}
		n, ok := v.(int64)
		if !ok {
			return nil, errors.New("chat template: slice bounds must be integers")
		}
		bounds[i] = &n
	}
	var n int
	switch x := x.(type) {
	case []any:
		n = len(x)
	case string:
		n = len([]rune(x))
	default:
		return nil, fmt.Errorf("chat template: cannot slice %s", jTypeName(x))
	}
	idx := pySliceIndices(n, bounds[0], bounds[1], bounds[2])
	switch x := x.(type) {
	case []any:
		out := make([]any, len(idx))
		for i, j := range idx {
			out[i] = x[j]
		}
		return out, nil
	case string:
		rs := []rune(x)
		out := make([]rune, len(idx))
		for i, j := range idx {
			out[i] = rs[j]
		}
		return string(out), nil
	}
	return nil, nil
}

// pySliceIndices returns the indices of Python's x[lo:hi:step] for len n.
func pySliceIndices(n int, lo, hi, step *int64) []int {
	st := 1
	if step != nil {
		st = int(*step)
	}
	if st == 0 {
		return nil
	}
	clamp := func(p *int64, def int) int {
		if p == nil {
			return def
		}
		v := int(*p)
		if v < 0 {
			v += n
		}
		if st > 0 {
			return max(0, min(v, n))
		}
		return max(-1, min(v, n-1))
	}
	var out []int
	if st > 0 {
		for i := clamp(lo, 0); i < clamp(hi, n); i += st {
			out = append(out, i)
		}
	} else {
		for i := clamp(lo, n-1); i > clamp(hi, -1); i += st {
			out = append(out, i)
		}
	}
	return out
}

func (r *jrender) evalCall(c jCall) (any, error) {
	fn, err := r.eval(c.fn)
	if err != nil {
		return nil, err
	}
	args, err := r.evalList(c.args)
	if err != nil {
		return nil, err
	}
	kwargs := map[string]any{}
	for k, e := range c.kwargs {
		if kwargs[k], err = r.eval(e); err != nil {
			return nil, err
		}
	}
	switch fn := fn.(type) {
	case jFunc:
		return jCallFunc(string(fn), args, kwargs)
	case jMethod:
		return jCallMethod(fn.recv, fn.name, args)
	}
	return nil, fmt.Errorf("chat template: %s is not callable", jTypeName(fn))
}

func jCallFunc(name string, args []any, kwargs map[string]any) (any, error) {
	switch name {
	case "raise_exception":
		msg := ""
		if len(args) > 0 {
			msg = jStr(args[0])
		}
		return nil, errRaised{msg}
	case "namespace":
		d := newDict()
		d.namespace = true
		keys := make([]string, 0, len(kwargs))
		for k := range kwargs {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			d.set(k, kwargs[k])
		}
		return d, nil
	case "range":
		var a, b, step int64 = 0, 0, 1
		ints := make([]int64, len(args))
		for i, v := range args {
			n, ok := v.(int64)
			if !ok {
				return nil, errors.New("chat template: range() needs integers")
			}
			ints[i] = n
		}
		switch len(ints) {
		case 1:
			b = ints[0]
		case 2:
			a, b = ints[0], ints[1]
		case 3:
			a, b, step = ints[0], ints[1], ints[2]
		default:
			return nil, errors.New("chat template: range() takes 1 to 3 arguments")
		}
		if step == 0 {
			return nil, errors.New("chat template: range() step is zero")
		}
		var out []any
		for i := a; step > 0 && i < b || step < 0 && i > b; i += step {
			if len(out) == maxRange {
				// Jinja2's sandbox (transformers renders in it) refuses
				// the same; an overflowing step looped for good here (the
				// fuzzing trial).
				return nil, fmt.Errorf("chat template: range() of more than %d items", maxRange)
			}
			out = append(out, i)
			if step > 0 && i > math.MaxInt64-step || step < 0 && i < math.MinInt64-step {
				break // the next would wrap around
			}
		}
		return out, nil
	case "strftime_now":
		if len(args) != 1 {
			return nil, errors.New("chat template: strftime_now() takes a format")
		}
		return strftime(time.Now(), jStr(args[0])), nil
	}
	return nil, fmt.Errorf("chat template: unknown function %s", name)
}

func strftime(t time.Time, f string) string {
	r := strings.NewReplacer("%d", t.Format("02"), "%b", t.Format("Jan"), "%B", t.Format("January"),
		"%Y", t.Format("2006"), "%m", t.Format("01"), "%y", t.Format("06"), "%H", t.Format("15"), "%M", t.Format("04"))
	return r.Replace(f)
}

// jMsg is a chat message as a template sees it: a read-only dict with role
// and content, boxed once per render, and whatever else the message has
// (tool_calls, tool_call_id, name) in extra.
type jMsg struct {
	role, content any
	extra         *jDictV // nil: none
}

// msgDict is a chat message as a dict, for the rare operations that need one.
func msgDict(m *jMsg) *jDictV {
	d := newDict()
	d.set("role", m.role)
	d.set("content", m.content)
	if m.extra != nil {
		for _, k := range m.extra.keys {
			d.set(k, m.extra.m[k])
		}
	}
	return d
}

func jGetAttr(x any, name string) any {
	switch x := x.(type) {
	case *jMsg:
		switch name {
		case "role":
			return x.role
		case "content":
			return x.content
		case "get", "items", "keys", "values":
			return jMethod{msgDict(x), name}
		}
		if x.extra != nil {
			return x.extra.get(name)
		}
		return undefined
	case *jDictV:
		if v, ok := x.m[name]; ok {
			return v
		}
		switch name {
		case "get", "items", "keys", "values":
			return jMethod{x, name}
		}
		return undefined
	case *jLoop:
		switch name {
		case "index0":
			return int64(x.index0)
		case "index":
			return int64(x.index0 + 1)
		case "revindex":
			return int64(x.length - x.index0)
		case "revindex0":
			return int64(x.length - x.index0 - 1)
		case "first":
			return x.index0 == 0
		case "last":
			return x.index0 == x.length-1
		case "length":
			return int64(x.length)
		case "previtem":
			if x.index0 > 0 {
				return x.items[x.index0-1]
			}
		case "nextitem":
			if x.index0+1 < x.length {
				return x.items[x.index0+1]
			}
		}
		return undefined
	case string:
		return jMethod{x, name}
	case []any:
		if name == "append" {
			return jMethod{x, name}
		}
	}
	return undefined
}

func jGetItem(x, i any) any {
	switch x := x.(type) {
	case []any:
		if n, ok := i.(int64); ok {
			if n < 0 {
				n += int64(len(x))
			}
			if n >= 0 && n < int64(len(x)) {
				return x[n]
			}
		}
	case string:
		if n, ok := i.(int64); ok {
			rs := []rune(x)
			if n < 0 {
				n += int64(len(rs))
			}
			if n >= 0 && n < int64(len(rs)) {
				return string(rs[n])
			}
		}
	case *jDictV, *jMsg:
		if s, ok := i.(string); ok {
			return jGetAttr(x, s)
		}
	}
	return undefined
}

func jCallMethod(recv any, name string, args []any) (any, error) {
	strArg := func(i int, def string) string {
		if i < len(args) {
			if s, ok := args[i].(string); ok {
				return s
			}
		}
		return def
	}
	switch x := recv.(type) {
	case string:
		switch name {
		case "startswith", "endswith":
			if len(args) != 1 {
				return nil, fmt.Errorf("chat template: %s() takes one argument", name)
			}
			var prefixes []any
			if l, ok := args[0].([]any); ok {
				prefixes = l
			} else {
				prefixes = []any{args[0]}
			}
			for _, p := range prefixes {
				s := jStr(p)
				if name == "startswith" && strings.HasPrefix(x, s) || name == "endswith" && strings.HasSuffix(x, s) {
					return true, nil
				}
			}
			return false, nil
		case "strip", "lstrip", "rstrip":
			if len(args) == 0 || args[0] == nil {
				switch name {
				case "strip":
					return strings.TrimFunc(x, unicode.IsSpace), nil
				case "lstrip":
					return strings.TrimLeftFunc(x, unicode.IsSpace), nil
				}
				return strings.TrimRightFunc(x, unicode.IsSpace), nil
			}
			cut := strArg(0, "")
			switch name {
			case "strip":
				return strings.Trim(x, cut), nil
			case "lstrip":
				return strings.TrimLeft(x, cut), nil
			}
			return strings.TrimRight(x, cut), nil
		case "split":
			var parts []string
			if sep := strArg(0, ""); sep == "" {
				parts = strings.Fields(x)
			} else {
				parts = strings.Split(x, sep)
			}
			out := make([]any, len(parts))
			for i, p := range parts {
				out[i] = p
			}
			return out, nil
		case "upper":
			return strings.ToUpper(x), nil
		case "lower":
			return strings.ToLower(x), nil
		case "title":
			return pyTitle(x), nil
		case "capitalize":
			return pyCapitalize(x), nil
		case "replace":
			return strings.ReplaceAll(x, strArg(0, ""), strArg(1, "")), nil
		case "join":
			if len(args) != 1 {
				return nil, errors.New("chat template: join() takes one argument")
			}
			items, err := jIterate(args[0])
			if err != nil {
				return nil, err
			}
			parts := make([]string, len(items))
			for i, v := range items {
				parts[i] = jStr(v)
			}
			return strings.Join(parts, x), nil
		}
	case *jDictV:
		switch name {
		case "get":
			if len(args) == 0 {
				return nil, errors.New("chat template: get() needs a key")
			}
			if v, ok := x.m[jStr(args[0])]; ok {
				return v, nil
			}
			if len(args) > 1 {
				return args[1], nil
			}
			return nil, nil
		case "items", "keys", "values":
			out := make([]any, len(x.keys))
			for i, k := range x.keys {
				switch name {
				case "items":
					out[i] = []any{k, x.m[k]}
				case "keys":
					out[i] = k
				default:
					out[i] = x.m[k]
				}
			}
			return out, nil
		}
	}
	return nil, fmt.Errorf("chat template: %s has no method %s", jTypeName(recv), name)
}

func pyCapitalize(s string) string {
	rs := []rune(strings.ToLower(s))
	if len(rs) > 0 {
		rs[0] = unicode.ToUpper(rs[0])
	}
	return string(rs)
}

func pyTitle(s string) string {
	rs := []rune(s)
	prevLetter := false
	for i, r := range rs {
		if prevLetter {
			rs[i] = unicode.ToLower(r)
		} else {
			rs[i] = unicode.ToUpper(r)
		}
		prevLetter = unicode.IsLetter(r)
	}
	return string(rs)
}

var jFilters = map[string]bool{
	"length": true, "count": true, "trim": true, "tojson": true, "upper": true, "lower": true,
	"default": true, "d": true, "first": true, "last": true, "join": true, "string": true, "int": true,
	"float": true, "list": true, "items": true, "capitalize": true, "title": true, "replace": true,
	"reverse": true, "safe": true, "select": true, "reject": true, "selectattr": true, "rejectattr": true,
	"map": true, "unique": true,
}

// jSelect implements select, reject, selectattr and rejectattr.
func jSelect(name string, x any, args []any) (any, error) {
	items, err := jIterate(x)
	if err != nil {
		return nil, err
	}
	attr := ""
	if name == "selectattr" || name == "rejectattr" {
		if len(args) == 0 {
			return nil, fmt.Errorf("chat template: %s needs an attribute", name)
		}
		attr, args = jStr(args[0]), args[1:]
	}
	keep := name == "select" || name == "selectattr"
	var out []any
	for _, item := range items {
		v := item
		if attr != "" {
			v = jGetAttr(item, attr)
		}
		ok := jTruthy(v)
		if len(args) > 0 {
			if ok, err = jApplyTest(jStr(args[0]), v, args[1:]); err != nil {
				return nil, err
			}
		}
		if ok == keep {
			out = append(out, item)
		}
	}
	return out, nil
}

func jApplyFilter(name string, x any, args []any, kwargs map[string]any) (any, error) {
	if m, ok := x.(*jMsg); ok {
		x = msgDict(m)
	}
	switch name {
	case "length", "count":
		switch x := x.(type) {
		case string:
			return int64(len([]rune(x))), nil
		case []any:
			return int64(len(x)), nil
		case *jDictV:
			return int64(len(x.keys)), nil
		}
		return nil, fmt.Errorf("chat template: %s has no length", jTypeName(x))
	case "trim":
		return strings.TrimFunc(jStr(x), unicode.IsSpace), nil
	case "tojson":
		var b strings.Builder
		indent := 0
		if n, ok := kwargs["indent"].(int64); ok {
			indent = int(n)
		} else if len(args) > 0 {
			if n, ok := args[0].(int64); ok {
				indent = int(n)
			}
		}
		if err := jToJSON(&b, x, indent, 0); err != nil {
			return nil, err
		}
		return b.String(), nil
	case "upper":
		return strings.ToUpper(jStr(x)), nil
	case "lower":
		return strings.ToLower(jStr(x)), nil
	case "capitalize":
		return pyCapitalize(jStr(x)), nil
	case "title":
		return pyTitle(jStr(x)), nil
	case "string", "safe":
		return jStr(x), nil
	case "default", "d":
		def := any("")
		if len(args) > 0 {
			def = args[0]
		}
		boolean := len(args) > 1 && jTruthy(args[1])
		if _, undef := x.(jUndefined); undef || boolean && !jTruthy(x) {
			return def, nil
		}
		return x, nil
	case "first", "last":
		l, err := jIterate(x)
		if err != nil || len(l) == 0 {
			return undefined, err
		}
		if name == "first" {
			return l[0], nil
		}
		return l[len(l)-1], nil
	case "join":
		l, err := jIterate(x)
		if err != nil {
			return nil, err
		}
		sep := ""
		if len(args) > 0 {
			sep = jStr(args[0])
		}
		parts := make([]string, len(l))
		for i, v := range l {
			parts[i] = jStr(v)
		}
		return strings.Join(parts, sep), nil
	case "int":
		switch v := x.(type) {
		case int64:
			return v, nil
		case float64:
			return int64(v), nil
		case bool:
			if v {
				return int64(1), nil
			}
			return int64(0), nil
		case string:
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil {
				return int64(0), nil
			}
			return n, nil
		}
		return int64(0), nil
	case "float":
		switch v := x.(type) {
		case int64:
			return float64(v), nil
		case float64:
			return v, nil
		case string:
			f, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f, nil
		}
		return 0.0, nil
	case "list":
		return jIterate(x)
	case "items":
		if d, ok := x.(*jDictV); ok {
			return jCallMethod(d, "items", nil)
		}
		return nil, fmt.Errorf("chat template: items of %s", jTypeName(x))
	case "replace":
		if len(args) < 2 {
			return nil, errors.New("chat template: replace needs two arguments")
		}
		return strings.ReplaceAll(jStr(x), jStr(args[0]), jStr(args[1])), nil
	case "select", "reject", "selectattr", "rejectattr":
		return jSelect(name, x, args)
	case "map":
		items, err := jIterate(x)
		if err != nil {
			return nil, err
		}
		out := make([]any, len(items))
		for i, item := range items {
			switch {
			case kwargs["attribute"] != nil:
				out[i] = jGetAttr(item, jStr(kwargs["attribute"]))
			case len(args) > 0:
				if out[i], err = jApplyFilter(jStr(args[0]), item, args[1:], nil); err != nil {
					return nil, err
				}
			default:
				return nil, errors.New("chat template: map needs attribute= or a filter name")
			}
		}
		return out, nil
	case "unique":
		items, err := jIterate(x)
		if err != nil {
			return nil, err
		}
		var out []any
		for _, item := range items {
			if !slices.ContainsFunc(out, func(v any) bool { return jEqual(v, item) }) {
				out = append(out, item)
			}
		}
		return out, nil
	case "reverse":
		switch v := x.(type) {
		case string:
			rs := []rune(v)
			slices.Reverse(rs)
			return string(rs), nil
		}
		l, err := jIterate(x)
		if err != nil {
			return nil, err
		}
		l = slices.Clone(l)
		slices.Reverse(l)
		return l, nil
	}
	return nil, fmt.Errorf("chat template: unsupported filter %q", name)
}

var jTests = map[string]bool{
	"defined": true, "undefined": true, "none": true, "string": true, "number": true, "integer": true,
	"float": true, "boolean": true, "true": true, "false": true, "mapping": true, "iterable": true,
	"sequence": true, "even": true, "odd": true, "equalto": true, "eq": true,
}

func jApplyTest(name string, x any, args []any) (bool, error) {
	if m, ok := x.(*jMsg); ok {
		x = msgDict(m)
	}
	switch name {
	case "defined":
		_, undef := x.(jUndefined)
		return !undef, nil
	case "undefined":
		_, undef := x.(jUndefined)
		return undef, nil
	case "none":
		return x == nil, nil
	case "string":
		_, ok := x.(string)
		return ok, nil
	case "number":
		switch x.(type) {
		case int64, jBigInt, float64:
			return true, nil
		}
		return false, nil
	case "integer":
		switch x.(type) {
		case int64, jBigInt:
			return true, nil
		}
		return false, nil
	case "float":
		_, ok := x.(float64)
		return ok, nil
	case "boolean":
		_, ok := x.(bool)
		return ok, nil
	case "true":
		return x == true, nil
	case "false":
		return x == false, nil
	case "mapping":
		_, ok := x.(*jDictV)
		return ok, nil
	case "iterable", "sequence":
		switch x.(type) {
		case string, []any, *jDictV:
			return true, nil
		}
		return false, nil
	case "even", "odd":
		n, ok := x.(int64)
		if !ok {
			return false, fmt.Errorf("chat template: %s test on %s", name, jTypeName(x))
		}
		return (n%2 == 0) == (name == "even"), nil
	case "equalto", "eq":
		if len(args) != 1 {
			return false, errors.New("chat template: equalto needs one argument")
		}
		return jEqual(x, args[0]), nil
	}
	return false, fmt.Errorf("chat template: unsupported test %q", name)
}

func jTruthy(v any) bool {
	switch v := v.(type) {
	case nil, jUndefined:
		return false
	case bool:
		return v
	case int64:
		return v != 0
	case float64:
		return v != 0
	case string:
		return v != ""
	case []any:
		return len(v) > 0
	case *jDictV:
		return len(v.keys) > 0
	}
	return true
}

func jTypeName(v any) string {
	switch v.(type) {
	case *jMsg:
		return "dict"
	case nil:
		return "none"
	case jUndefined:
		return "undefined"
	case bool:
		return "boolean"
	case int64, jBigInt:
		return "integer"
	case float64:
		return "float"
	case string:
		return "string"
	case []any:
		return "list"
	case *jDictV:
		return "dict"
	}
	return fmt.Sprintf("%T", v)
}

// jStr converts a value to text as Jinja (Python) prints it.
func jStr(v any) string {
	if m, ok := v.(*jMsg); ok {
		v = msgDict(m)
	}
	switch v := v.(type) {
	case nil:
		return "None"
	case jUndefined:
		return ""
	case jBigInt:
		return string(v)
	case bool:
		if v {
			return "True"
		}
		return "False"
	case int64:
		return strconv.FormatInt(v, 10)
	case float64:
		if v == math.Trunc(v) && math.Abs(v) < 1e16 {
			return strconv.FormatFloat(v, 'f', 1, 64)
		}
		return strconv.FormatFloat(v, 'g', -1, 64)
	case string:
		return v
	case []any, *jDictV:
		var b strings.Builder
		jRepr(&b, v)
		return b.String()
	}
	return fmt.Sprint(v)
}

func jRepr(b *strings.Builder, v any) {
	switch v := v.(type) {
	case string:
		b.WriteString("'" + strings.ReplaceAll(strings.ReplaceAll(v, `\`, `\\`), "'", `\'`) + "'")
	case []any:
		b.WriteByte('[')
		for i, x := range v {
			if i > 0 {
				b.WriteString(", ")
			}
			jRepr(b, x)
		}
		b.WriteByte(']')
	case *jDictV:
		b.WriteByte('{')
		for i, k := range v.keys {
			if i > 0 {
				b.WriteString(", ")
			}
			jRepr(b, k)
			b.WriteString(": ")
			jRepr(b, v.m[k])
		}
		b.WriteByte('}')
	default:
		b.WriteString(jStr(v))
	}
}

// jQuoteJSON writes s as a JSON string the way Python's json.dumps does
// with ensure_ascii=False: only '"', '\\' and control characters escaped,
// with the short escapes where JSON has one.
func jQuoteJSON(b *strings.Builder, s string) {
	const hex = "0123456789abcdef"
	if !utf8.ValidString(s) {
		s = string([]rune(s)) // each invalid byte becomes U+FFFD
	}
	b.WriteByte('"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		b.WriteString(s[start:i])
		start = i + 1
		switch c {
		case '"', '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			b.WriteString(`\u00`)
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&0xf])
		}
	}
	b.WriteString(s[start:])
	b.WriteByte('"')
}

// jToJSON writes v as Python's json.dumps(v, ensure_ascii=False,
// indent=indent) does (indent 0: one line).
func jToJSON(b *strings.Builder, v any, indent, level int) error {
	newline := func(level int) {
		if indent > 0 {
			b.WriteByte('\n')
			b.WriteString(strings.Repeat(" ", indent*level))
		}
	}
	sep := ", "
	if indent > 0 {
		sep = ","
	}
	if m, ok := v.(*jMsg); ok {
		v = msgDict(m)
	}
	switch v := v.(type) {
	case nil, jUndefined:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(v))
	case int64, float64, jBigInt:
		b.WriteString(jStr(v))
	case string:
		jQuoteJSON(b, v)
	case []any:
		if len(v) == 0 {
			b.WriteString("[]")
			return nil
		}
		b.WriteByte('[')
		for i, x := range v {
			if i > 0 {
				b.WriteString(sep)
			}
			newline(level + 1)
			if err := jToJSON(b, x, indent, level+1); err != nil {
				return err
			}
		}
		newline(level)
		b.WriteByte(']')
	case *jDictV:
		if len(v.keys) == 0 {
			b.WriteString("{}")
			return nil
		}
		if v.frozen && level == 0 {
			if t := v.json.Load(); t != nil && t.indent == indent {
				b.WriteString(t.text)
				return nil
			}
			start := b.Len()
			defer func() {
				if b.Len() > start {
					v.json.Store(&jsonText{indent, strings.Clone(b.String()[start:])})
				}
			}()
		}
		b.WriteByte('{')
		for i, k := range v.keys {
			if i > 0 {
				b.WriteString(sep)
			}
			newline(level + 1)
			_ = jToJSON(b, k, indent, level+1)
			b.WriteString(": ")
			if err := jToJSON(b, v.m[k], indent, level+1); err != nil {
				return err
			}
		}
		newline(level)
		b.WriteByte('}')
	default:
		return fmt.Errorf("chat template: tojson of %s", jTypeName(v))
	}
	return nil
}

func jEqual(a, b any) bool {
	if m, ok := a.(*jMsg); ok {
		a = msgDict(m)
	}
	if m, ok := b.(*jMsg); ok {
		b = msgDict(m)
	}
	if x, ok := a.(jBigInt); ok {
		y, ok := b.(jBigInt)
		return ok && x == y
	}
	switch a := a.(type) {
	case int64:
		switch b := b.(type) {
		case int64:
			return a == b
		case float64:
			return float64(a) == b
		}
	case float64:
		switch b := b.(type) {
		case int64:
			return a == float64(b)
		case float64:
			return a == b
		}
	case string:
		s, ok := b.(string)
		return ok && a == s
	case bool:
		x, ok := b.(bool)
		return ok && a == x
	case nil:
		return b == nil
	case jUndefined:
		_, ok := b.(jUndefined)
		return ok
	case []any:
		l, ok := b.([]any)
		return ok && slices.EqualFunc(a, l, jEqual)
	case *jDictV:
		d, ok := b.(*jDictV)
		if !ok || len(a.keys) != len(d.keys) {
			return false
		}
		for k, v := range a.m {
			if w, ok := d.m[k]; !ok || !jEqual(v, w) {
				return false
			}
		}
		return true
	}
	return false
}

func jContains(container, x any) (bool, error) {
	if m, ok := container.(*jMsg); ok {
		container = msgDict(m)
	}
	switch c := container.(type) {
	case string:
		s, ok := x.(string)
		if !ok {
			return false, fmt.Errorf("chat template: 'in <string>' needs a string, not %s", jTypeName(x))
		}
		return strings.Contains(c, s), nil
	case []any:
		return slices.ContainsFunc(c, func(v any) bool { return jEqual(v, x) }), nil
	case *jDictV:
		s, ok := x.(string)
		if !ok {
			return false, nil
		}
		_, has := c.m[s]
		return has, nil
	case jUndefined, nil:
		return false, nil
	}
	return false, fmt.Errorf("chat template: 'in' on %s", jTypeName(container))
}

func jCompare(a, b any) (int, error) {
	if x, ok := a.(string); ok {
		if y, ok := b.(string); ok {
			return strings.Compare(x, y), nil
		}
	}
	x, ok1 := jNumber(a)
	y, ok2 := jNumber(b)
	if !ok1 || !ok2 {
		return 0, fmt.Errorf("chat template: cannot compare %s and %s", jTypeName(a), jTypeName(b))
	}
	switch {
	case x < y:
		return -1, nil
	case x > y:
		return 1, nil
	}
	return 0, nil
}

func jNumber(v any) (float64, bool) {
	switch v := v.(type) {
	case int64:
		return float64(v), true
	case float64:
		return v, true
	case bool:
		if v {
			return 1, true
		}
		return 0, true
	}
	return 0, false
}

func jArith(op string, a, b any) (any, error) {
	if op == "+" {
		switch x := a.(type) {
		case string:
			if y, ok := b.(string); ok {
				return x + y, nil
			}
		case []any:
			if y, ok := b.([]any); ok {
				return append(slices.Clone(x), y...), nil
			}
		}
	}
	if op == "*" {
		if s, ok := a.(string); ok {
			if n, ok := b.(int64); ok {
				if len(s) > 0 && n > maxRepeat/int64(len(s)) {
					return nil, fmt.Errorf("chat template: a string repeated to more than %d bytes", maxRepeat)
				}
				return strings.Repeat(s, int(max(n, 0))), nil
			}
		}
	}
	x, xi := a.(int64)
	y, yi := b.(int64)
	if xi && yi {
		switch op {
		case "+":
			return x + y, nil
		case "-":
			return x - y, nil
		case "*":
			return x * y, nil
		case "//", "%":
			if y == 0 {
				return nil, errors.New("chat template: division by zero")
			}
			q, m := x/y, x%y
			if m != 0 && (m < 0) != (y < 0) { // Python floors
				q--
				m += y
			}
			if op == "//" {
				return q, nil
			}
			return m, nil
		}
	}
	fx, ok1 := jNumber(a)
	fy, ok2 := jNumber(b)
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("chat template: unsupported operand types for %s: %s and %s", op, jTypeName(a), jTypeName(b))
	}
	switch op {
	case "+":
		return fx + fy, nil
	case "-":
		return fx - fy, nil
	case "*":
		return fx * fy, nil
	case "/":
		if fy == 0 {
			return nil, errors.New("chat template: division by zero")
		}
		return fx / fy, nil
	case "//":
		if fy == 0 {
			return nil, errors.New("chat template: division by zero")
		}
		return math.Floor(fx / fy), nil
	case "%":
		if fy == 0 {
			return nil, errors.New("chat template: division by zero")
		}
		return fx - fy*math.Floor(fx/fy), nil
	}
	return nil, fmt.Errorf("chat template: unknown operator %s", op)
}
