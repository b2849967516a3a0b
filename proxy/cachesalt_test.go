package proxy

import (
	"encoding/json"
	"strings"
	"testing"
)

// A client's cache_salt splits its tenant's cache, as vLLM's cache_salt
// splits an engine's: the engine gets the tenant's salt followed by the
// client's (the client's alone without keys), and the router hashes the
// prompt in that namespace, so one end user's prefix never routes another's.
func TestClientCacheSaltSplitsTheTenantsCache(t *testing.T) {
	prompt := `"messages":[{"role":"user","content":"` + strings.Repeat("shared words ", 60) + `"}]`
	for _, tc := range []struct {
		name, yaml, key string
	}{
		{"tenant", tenantsYAML, "key-alpha-123"},
		{"no keys", "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m, kind: vllm}]\n", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := startFake(t, "e0", nil)
			p := startProxyYAML(t, tc.yaml, e)
			send := func(salt string, dry bool) (int, string) {
				t.Helper()
				b := `{"model":"m",` + prompt
				if salt != "" {
					b += `,"cache_salt":` + salt
				}
				if dry {
					b += `,"nvext":{"annotations":["query_instance_id"]}`
				}
				resp, body := postAuth(t, p.url+"/v1/chat/completions", tc.key, b+"}")
				return resp.StatusCode, body
			}
			overlap := func(salt string) int {
				t.Helper()
				code, b := send(salt, true)
				var d decisionJSON
				if code != 200 || json.Unmarshal([]byte(b), &d) != nil {
					t.Fatalf("dry run: %d %s", code, b)
				}
				return d.OverlapBlocks
			}
			if code, b := send(`"user-1"`, false); code != 200 {
				t.Fatalf("%d %s", code, b)
			}
			got, _ := e.lastBody()["cache_salt"].(string)
			if tc.key == "" && got != "user-1" || tc.key != "" && (len(got) != 32+len("/user-1") || !strings.HasSuffix(got, "/user-1")) {
				t.Fatalf("the engine got cache_salt %q", got)
			}
			p.waitIdle(t)
			if n := overlap(`"user-1"`); n == 0 {
				t.Fatal("user-1 does not find its own prefix")
			}
			if n := overlap(`"user-2"`); n != 0 {
				t.Fatalf("user-2 routes on user-1's prefix: %d blocks", n)
			}
			if n := overlap(""); n != 0 {
				t.Fatalf("a request without a salt routes on user-1's prefix: %d blocks", n)
			}
			for _, bad := range []string{`""`, `42`, `["x"]`} {
				if code, b := send(bad, false); code != 400 || !strings.Contains(b, `"param":"cache_salt"`) {
					t.Fatalf("cache_salt %s: %d %s", bad, code, b)
				}
			}
			if code, _ := send("null", false); code != 200 {
				t.Fatalf("cache_salt null: %d", code)
			}
			if _, ok := e.lastBody()["cache_salt"]; ok != (tc.key != "") {
				t.Fatalf("cache_salt null: the engine got %v", e.lastBody()["cache_salt"])
			}
		})
	}
}
