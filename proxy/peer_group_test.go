package proxy

import "testing"

// A backend whose role a reload changes (same id, engine and events, so
// its event feed goes on) moves its data-parallel ranks to its new peer
// group with rank 0, and a rank its feed first names after the reload
// joins the new group too.
func TestRoleChangeMovesEveryRankToItsPeerGroup(t *testing.T) {
	pre, dec := startFake(t, "pre", nil), startFake(t, "dec", nil)
	cfg := func(role string) string {
		return "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\nbackends:\n" +
			"  - {id: pre, url: 'http://" + pre.addr + "', model: m, role: " + role + ", kv_events: {mode: http}}\n" +
			"  - {id: dec, url: 'http://" + dec.addr + "', model: m}\n"
	}
	p := startProxyYAML(t, cfg("prefill"))
	groups := func(when string, want int, ranks ...string) {
		t.Helper()
		for _, name := range ranks {
			w, ok := workerStatus(p, "m", name)
			if !ok || w.Removed || w.PeerGroup != want {
				t.Fatalf("%s: %s present %v, removed %v, in peer group %d; want %d", when, name, ok, w.Removed, w.PeerGroup, want)
			}
		}
	}
	pushRank(t, p, "pre", 1, promptIDs(100))
	groups("a prefill engine", 1, "pre", "pre#1")
	p.reloadYAML(t, cfg("both"))
	groups("reloaded as both", 0, "pre", "pre#1")
	pushRank(t, p, "pre", 2, promptIDs(200)) // first named after the reload
	groups("reloaded as both", 0, "pre#2")
	p.reloadYAML(t, cfg("prefill"))
	pushRank(t, p, "pre", 3, promptIDs(300))
	groups("a prefill engine again", 1, "pre", "pre#1", "pre#2", "pre#3")
}
