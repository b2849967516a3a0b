package mockengine

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"sync"

	"github.com/kvproxy/kvproxy/kv"
)

// unmarshalExact decodes a JSON object into v (a pointer to a struct)
// matching its members' names exactly, as vLLM's pydantic models do:
// encoding/json would also take "Stream" for stream. A top-level member
// spelled like a field but in other case is ignored, as vLLM ignores it.
func unmarshalExact(body []byte, v any) error {
	folded := foldedNames(reflect.TypeOf(v).Elem())
	var members map[string]json.RawMessage
	if json.Unmarshal(body, &members) == nil {
		inexact := false
		for k := range members {
			if exact, known := folded[strings.ToLower(k)]; known && exact != k {
				delete(members, k)
				inexact = true
			}
		}
		if inexact {
			body, _ = json.Marshal(members)
		}
	}
	return json.Unmarshal(body, v)
}

// fieldError is a wrong-typed member as a 400 naming it and the JSON type
// it wants (as vLLM does, not in Go's types), or nil for other errors.
func fieldError(err error) *badRequest {
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) || te.Field == "" {
		return nil
	}
	return invalid(te.Field, "%s must be %s, got %s", te.Field, kv.JSONKind(te.Type), te.Value)
}

var foldedCache sync.Map // reflect.Type → map[lowercased name]name

// foldedNames maps the lowercased JSON names of t's fields to the names.
func foldedNames(t reflect.Type) map[string]string {
	if m, ok := foldedCache.Load(t); ok {
		return m.(map[string]string)
	}
	m := map[string]string{}
	for i := 0; i < t.NumField(); i++ {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		if name == "" {
			name = t.Field(i).Name
		}
		if name != "-" {
			m[strings.ToLower(name)] = name
		}
	}
	foldedCache.Store(t, m)
	return m
}
