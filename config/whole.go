package config

import (
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// wholeNumbers rejects a fractional number given for a whole-number field:
// yaml.v3 decodes `fall: 1.5` into an int as 1, silently. root is the
// file's tree, its values expanded (expandScalars).
func wholeNumbers(root *yaml.Node) error {
	return checkWhole(root, reflect.TypeOf(Config{}), "")
}

func checkWhole(n *yaml.Node, t reflect.Type, path string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case n.Kind == yaml.DocumentNode || n.Kind == yaml.AliasNode:
		for _, c := range n.Content {
			if err := checkWhole(c, t, path); err != nil {
				return err
			}
		}
		if n.Alias != nil {
			return checkWhole(n.Alias, t, path)
		}
	case n.Kind == yaml.MappingNode && t.Kind() == reflect.Struct:
		for i := 0; i+1 < len(n.Content); i += 2 {
			key := n.Content[i].Value
			if f, ok := fieldByYAMLName(t, key); ok {
				if err := checkWhole(n.Content[i+1], f.Type, join(path, key)); err != nil {
					return err
				}
			}
		}
	case n.Kind == yaml.MappingNode && t.Kind() == reflect.Map:
		for i := 0; i+1 < len(n.Content); i += 2 {
			if err := checkWhole(n.Content[i+1], t.Elem(), join(path, n.Content[i].Value)); err != nil {
				return err
			}
		}
	case n.Kind == yaml.SequenceNode && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array):
		for i, c := range n.Content {
			if err := checkWhole(c, t.Elem(), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	case n.Kind == yaml.ScalarNode && n.ShortTag() == "!!float":
		switch t.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
			reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			if t.PkgPath() == "time" || reflect.PointerTo(t).Implements(unmarshalerType) {
				return nil // a duration, or a type that reads its own values
			}
			if v, err := strconv.ParseFloat(n.Value, 64); err == nil && v == math.Trunc(v) {
				return nil // 1e3
			}
			return fmt.Errorf("%s: %s is not a whole number (line %d)", path, n.Value, n.Line)
		}
	}
	return nil
}

var unmarshalerType = reflect.TypeOf((*yaml.Unmarshaler)(nil)).Elem()

func fieldByYAMLName(t reflect.Type, name string) (reflect.StructField, bool) {
	for i := range t.NumField() {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if tag == name || (tag == "" && strings.EqualFold(f.Name, name)) {
			return f, true
		}
	}
	return reflect.StructField{}, false
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}
