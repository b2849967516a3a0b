package proxy

import (
	"net/http"
	"strings"
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

// With auth.metrics_keys, /metrics takes one of them or an admin key: a
// client's key gets a 403, none or a wrong one a 401; a reload without
// them opens it again. Prometheus sends the key as a bearer token.
func TestMetricsKeys(t *testing.T) {
	e := startFake(t, "e0", nil)
	guarded := strings.Replace(tenantsYAML, "  admin_keys: [admin-key-xyz]\n", "  admin_keys: [admin-key-xyz]\n  metrics_keys: [scraper-key-1]\n", 1)
	p := startProxyYAML(t, guarded, e)
	scrape := func(key string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", p.url+"/metrics", nil)
		return doAuth(t, req, key)
	}
	for _, c := range []struct {
		key, code string
		status    int
	}{
		{"scraper-key-1", "", 200},
		{"admin-key-xyz", "", 200},
		{"key-alpha-123", "metrics_key_required", 403},
		{"wrong-key-123", "invalid_api_key", 401},
		{"", "invalid_api_key", 401},
	} {
		status, body := scrape(c.key)
		if status != c.status || (c.code != "" && !strings.Contains(body, `"code":"`+c.code+`"`)) || (status == 200 && !strings.Contains(body, "kvproxy_client_connections")) {
			t.Fatalf("key %q: %d %.200s, want %d %s", c.key, status, body, c.status, c.code)
		}
	}
	p.reloadYAML(t, strings.ReplaceAll(tenantsYAML, "{{e0}}", e.addr))
	if status, _ := scrape(""); status != 200 || !strings.Contains(p.logs.String(), `"metrics_keys_changed":true`) {
		t.Fatalf("after a reload without metrics keys: %d, want 200, and the reload logged:\n%s", status, p.logs.String())
	}
}
