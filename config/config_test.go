package config

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

const minimal = `
models:
  - name: m
backends:
  - id: a
    url: http://127.0.0.1:9000
`

func TestDefaults(t *testing.T) {
	c, err := Parse([]byte(minimal))
	if err != nil {
		t.Fatal(err)
	}
	if c.Listen != "127.0.0.1:8080" || c.Router.Policy != "kv" || c.Router.IndexTTL != 120*time.Second {
		t.Fatalf("defaults not applied: %+v", c)
	}
	m := c.Models[0]
	if m.Tokenizer != "cl100k_base" || m.Template != "chatml" || m.BlockSize != 16 || m.BytesPerBlock != 16*128<<10 {
		t.Fatalf("model defaults: %+v", m)
	}
	b := c.Backends[0]
	if b.Kind != KindVLLM || b.Model != "m" || b.ServedModel != "m" {
		t.Fatalf("backend defaults: %+v", b)
	}
}

func TestErrorsNameTheField(t *testing.T) {
	cases := map[string]struct{ yaml, want string }{
		"unknown key": {minimal + "bogus: 1\n", "bogus"},
		"unknown nested key": {`
models: [{name: m, tokeniser: x}]
backends: [{id: a, url: "http://127.0.0.1:1"}]`, "tokeniser"},
		"bad policy":             {minimal + "router: {policy: fastest}\n", "router.policy"},
		"bad url":                {"models: [{name: m}]\nbackends: [{id: a, url: 'ftp://x'}]\n", "backends[0].url"},
		"url with path":          {"models: [{name: m}]\nbackends: [{id: a, url: 'http://h:1/v1'}]\n", "backends[0].url"},
		"bad kind":               {"models: [{name: m}]\nbackends: [{id: a, url: 'http://h:1', kind: tgi}]\n", "backends[0].kind"},
		"unknown model":          {"models: [{name: m}, {name: n}]\nbackends: [{id: a, url: 'http://h:1', model: z}]\n", "backends[0].model"},
		"duplicate id":           {"models: [{name: m}]\nbackends: [{id: a, url: 'http://h:1'}, {id: a, url: 'http://h:2'}]\n", "backends[1].id"},
		"duplicate alias":        {"models: [{name: m, aliases: [x]}, {name: x}]\nbackends: [{id: a, url: 'http://h:1', model: m}]\n", "already used"},
		"bad tokenizer":          {"models: [{name: m, tokenizer: gpt2}]\nbackends: [{id: a, url: 'http://h:1'}]\n", "models[0].tokenizer"},
		"bad block size":         {"models: [{name: m, block_size: -1}]\nbackends: [{id: a, url: 'http://h:1'}]\n", "models[0].block_size"},
		"mock off loopback":      {"models: [{name: m}]\nbackends: [{id: a, url: 'http://10.0.0.1:9', kind: mock}]\n", "loopback"},
		"bad duration":           {minimal + "router: {index_ttl: soon}\n", "index_ttl"},
		"no backends":            {"models: [{name: m}]\n", "backends"},
		"empty":                  {"", "empty"},
		"bad listen":             {minimal + "listen: nope\n", "listen"},
		"bad admin_listen":       {minimal + "admin_listen: 9090\n", "admin_listen: want host:port"},
		"admin_listen = listen":  {minimal + "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:8080\n", "admin_listen: \"127.0.0.1:8080\" takes listen's port"},
		"admin_listen wildcard":  {minimal + "listen: 127.0.0.1:8080\nadmin_listen: 0.0.0.0:8080\n", "admin_listen: \"0.0.0.0:8080\" takes listen's port"},
		"listen wildcard":        {minimal + "listen: ':8080'\nadmin_listen: 10.0.0.1:8080\n", "takes listen's port"},
		"admin_listen localhost": {minimal + "listen: 127.0.0.1:8080\nadmin_listen: localhost:8080\n", "takes listen's port"},
		"admin_listen no port":   {minimal + "admin_listen: '127.0.0.1:'\n", "admin_listen: want host:port"},
		"admin_listen bad port":  {minimal + "admin_listen: 127.0.0.1:99999\n", "admin_listen: want host:port"},
		"listen named port":      {minimal + "listen: 127.0.0.1:http\n", "listen: want host:port"},
		"bad nats url":           {minimal + "replicas: {nats: 'http://h:4222'}\n", "replicas.nats"},
		"wildcard subject":       {minimal + "replicas: {nats: 'nats://h:4222', subject: 'kvproxy.*'}\n", "replicas.subject"},
		"spaced subject":         {minimal + "replicas: {nats: 'nats://h:4222', subject: 'kvproxy load'}\n", "replicas.subject"},
		"tiny interval":          {minimal + "replicas: {nats: 'nats://h:4222', interval: 1ms}\n", "replicas.interval"},
		"bad cors origin":        {minimal + "cors: {allowed_origins: ['https://a.example.com/path']}\n", "cors.allowed_origins[0]"},
		"cors origin no scheme":  {minimal + "cors: {allowed_origins: [app.example.com]}\n", "cors.allowed_origins[0]"},
		"cors default port":      {minimal + "cors: {allowed_origins: ['https://a.example.com:443']}\n", "cors.allowed_origins[0]"},
		"cors capitals":          {minimal + "cors: {allowed_origins: ['https://App.example.com']}\n", "cors.allowed_origins[0]"},
		"unparsable nats":        {minimal + "replicas: {nats: 'nats://[::1'}\n", "replicas.nats"},
		"negative interval":      {minimal + "replicas: {nats: 'nats://h:4222', interval: -1s}\n", "replicas.interval"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("want an error mentioning %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not mention %q", err, tc.want)
			}
		})
	}
}

func TestEnvExpansion(t *testing.T) {
	t.Setenv("KVP_TEST_PORT", "9123")
	c, err := Parse([]byte("models: [{name: m}]\nbackends: [{id: a, url: 'http://127.0.0.1:${KVP_TEST_PORT}'}]\nlisten: '${KVP_TEST_LISTEN:-127.0.0.1:7000}'\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Backends[0].URL != "http://127.0.0.1:9123" || c.Listen != "127.0.0.1:7000" {
		t.Fatalf("expansion: %q %q", c.Backends[0].URL, c.Listen)
	}
	_, err = Parse([]byte("models: [{name: '${KVP_SURELY_UNSET_VAR}'}]\n"))
	if err == nil || !strings.Contains(err.Error(), "KVP_SURELY_UNSET_VAR") {
		t.Fatalf("unset variable must be named, got %v", err)
	}
}

func TestModelByAlias(t *testing.T) {
	c, err := Parse([]byte("models: [{name: big, aliases: [default, gpt-4o]}]\nbackends: [{id: a, url: 'http://h:1'}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if m, ok := c.ModelByName("gpt-4o"); !ok || m.Name != "big" {
		t.Fatal("alias lookup failed")
	}
	if _, ok := c.ModelByName("nope"); ok {
		t.Fatal("unknown model found")
	}
}

// The shipped example must always load.
func TestExampleConfigLoads(t *testing.T) {
	_, file, _, _ := runtime.Caller(0)
	path := filepath.Join(filepath.Dir(file), "..", "config.example.yaml")
	if _, err := os.Stat(path); err != nil {
		t.Skip("no config.example.yaml yet")
	}
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Backends) < 2 {
		t.Fatalf("example should define a fleet, got %d backends", len(c.Backends))
	}
}

// CORS origins are written as browsers send them, or they would never
// match: each of these is refused at start, a plain one accepted.
func TestCORSOriginsAsBrowsersSendThem(t *testing.T) {
	base := "models: [{name: m}]\nbackends: [{id: a, url: 'http://127.0.0.1:9000', model: m}]\n"
	for _, o := range []string{"https://a.example.com:", "https://a.example.com?", "https://a.example.com#", "https://a.example.com:0443",
		"http://a.example.com:080", "https://bücher.example", "https://a.example.com/", "https://a.example.com:443", "HTTPS://a.example.com"} {
		if _, err := Parse([]byte(base + "cors: {allowed_origins: ['" + o + "']}\n")); err == nil || !strings.Contains(err.Error(), "cors.allowed_origins[0]") {
			t.Errorf("%s: %v", o, err)
		}
	}
	for _, o := range []string{"*", "https://a.example.com", "http://localhost:3000", "https://xn--bcher-kva.example"} {
		if _, err := Parse([]byte(base + "cors: {allowed_origins: ['" + o + "']}\n")); err != nil {
			t.Errorf("%s: %v", o, err)
		}
	}
}

// Listeners on different ports, or on the same port of different hosts, or
// both on any free port, are two listeners.
func TestAdminListenBesideListen(t *testing.T) {
	for _, pair := range [][2]string{
		{"127.0.0.1:0", "127.0.0.1:0"},
		{"127.0.0.1:8080", "127.0.0.1:9090"},
		{"127.0.0.1:8080", "127.0.0.2:8080"},
		{"0.0.0.0:8080", "127.0.0.1:9090"},
	} {
		if _, err := Parse([]byte(minimal + "listen: '" + pair[0] + "'\nadmin_listen: '" + pair[1] + "'\n")); err != nil {
			t.Errorf("listen %s, admin_listen %s: %v", pair[0], pair[1], err)
		}
	}
}
