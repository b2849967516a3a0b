package proxy

import (
	"net/http"
	"testing"
)

// With admin keys but no client keys, a wrong key on an admin endpoint is a
// 401, not the 403 of a client's key (any client may call without a key
// there, which does not make a wrong admin key a client's).
func TestAdminKeyWithoutClientKeys(t *testing.T) {
	e := startFake(t, "e0", nil)
	p := startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m}]\nauth: {admin_keys: [admin-key-xyz]}\n", e)
	for key, want := range map[string]int{"wrong-key-123": 401, "admin-key-xyz": 200} {
		req, _ := http.NewRequest("GET", p.url+"/admin/backends", nil)
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("key %s: %d, want %d", key, resp.StatusCode, want)
		}
	}
}
