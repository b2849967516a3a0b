package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvproxy/kvproxy/config"
)

// A request for a LoRA adapter is served by its base model's backends and
// forwarded with the adapter's name. vLLM caches an adapter's blocks apart
// from the base model's (and reports them with its lora_name): the request
// finds the blocks stored under its adapter, never the base model's or
// another adapter's, and the base model never finds the adapter's.
func TestLoRAAdapterRequestsRouteOnTheAdaptersBlocks(t *testing.T) {
	lists := `{"object":"list","data":[{"id":"engine-m","parent":null},{"id":"sql-lora","parent":"engine-m"},{"id":"chat-lora","parent":"engine-m"}]}`
	e0 := startFake(t, "e0", func(f *fakeEngine) { f.modelList = lists })
	e1 := startFake(t, "e1", func(f *fakeEngine) { f.modelList = lists })
	p := startProxyYAML(t, "models: [{name: m, adapters: [sql-lora, chat-lora], tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m, kv_events: {mode: http}}\n"+
		"  - {id: e1, url: 'http://{{e1}}', model: m, served_model: engine-m, kv_events: {mode: http}}\n", e0, e1)
	ids := promptIDs(1000)
	push := func(engine, lora string) {
		t.Helper()
		batch := fmt.Sprintf(`{"engine_id":%q,"events":[{"type":"block_stored","block_hashes":[1,2,3,4],"parent_block_hash":null,"token_ids":[%s],"block_size":16,"lora_name":%q}]}`, engine, ids, lora)
		if resp, b := post(t, p.url+"/v1/kv_events", batch); resp.StatusCode != 200 {
			t.Fatalf("push: %d %s", resp.StatusCode, b)
		}
	}
	dryRun := func(model string) decisionJSON {
		t.Helper()
		resp, b := post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":1,"nvext":{"annotations":["query_instance_id"]}}`, model, ids))
		var d decisionJSON
		if resp.StatusCode != 200 || json.Unmarshal(b, &d) != nil {
			t.Fatalf("dry run of %s: %d %s", model, resp.StatusCode, b)
		}
		return d
	}
	push("e1", "sql-lora")
	if d := dryRun("sql-lora"); d.WorkerID != "e1" || d.OverlapBlocks != 4 {
		t.Fatalf("sql-lora: %s with %d blocks, want e1 with the 4 it caches", d.WorkerID, d.OverlapBlocks)
	}
	for _, model := range []string{"m", "chat-lora"} {
		if d := dryRun(model); d.OverlapBlocks != 0 {
			t.Fatalf("%s finds %d of sql-lora's blocks on %s", model, d.OverlapBlocks, d.WorkerID)
		}
	}
	push("e0", "")
	if d := dryRun("m"); d.WorkerID != "e0" || d.OverlapBlocks != 4 {
		t.Fatalf("base model: %s with %d blocks, want e0 with 4", d.WorkerID, d.OverlapBlocks)
	}
	if d := dryRun("sql-lora"); d.WorkerID != "e1" || d.OverlapBlocks != 4 {
		t.Fatalf("sql-lora after the base model's blocks: %s with %d blocks", d.WorkerID, d.OverlapBlocks)
	}

	// The engine gets the adapter's name, not the base model's served name.
	resp, b := post(t, p.url+"/v1/completions", fmt.Sprintf(`{"model":"sql-lora","prompt":[%s],"max_tokens":1}`, ids))
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "e1" {
		t.Fatalf("sql-lora: %d on %q: %s", resp.StatusCode, resp.Header.Get(WorkerHeader), b)
	}
	if got := e1.lastBody()["model"]; got != "sql-lora" {
		t.Fatalf("the engine got model %v, want sql-lora", got)
	}
	if resp, b := post(t, p.url+"/v1/embeddings", `{"model":"chat-lora","input":"hi"}`); resp.StatusCode != 200 || !strings.Contains(string(b), `"model":"chat-lora"`) {
		t.Fatalf("pass-through of an adapter: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
	metrics := p.metrics(t)
	if !strings.Contains(metrics, `kvproxy_tokens_total{model="sql-lora",tenant="",type="prompt"} 10`) {
		t.Fatalf("the adapter's tokens are not counted under its name:\n%s", grepLines(metrics, "kvproxy_tokens_total"))
	}

	var list struct{ Data []modelJSON }
	if resp, b := fetch(t, p.url+"/v1/models"); resp.StatusCode != 200 || json.Unmarshal(b, &list) != nil {
		t.Fatalf("/v1/models: %d %s", resp.StatusCode, b)
	}
	want := []modelJSON{{ID: "m"}, {ID: "sql-lora", Parent: "m"}, {ID: "chat-lora", Parent: "m"}}
	if len(list.Data) != len(want) {
		t.Fatalf("/v1/models: %+v", list.Data)
	}
	for i, w := range want {
		if got := list.Data[i]; got.ID != w.ID || got.Parent != w.Parent || got.Object != "model" {
			t.Fatalf("/v1/models[%d] = %+v, want id %s parent %q", i, got, w.ID, w.Parent)
		}
	}
	if resp, b := fetch(t, p.url+"/v1/models/chat-lora"); resp.StatusCode != 200 || !strings.Contains(string(b), `"id":"chat-lora"`) || !strings.Contains(string(b), `"parent":"m"`) {
		t.Fatalf("/v1/models/chat-lora: %d %s", resp.StatusCode, b)
	}
}

func TestLoRAAdapterNamesMustBeUnique(t *testing.T) {
	for _, bad := range []string{
		"models: [{name: m, adapters: [m], block_size: 16}]",
		"models: [{name: m, aliases: [a], adapters: [a], block_size: 16}]",
		"models: [{name: m, adapters: [x, x], block_size: 16}]",
		"models: [{name: m, adapters: [n], block_size: 16}, {name: n, block_size: 16}]",
		"models: [{name: m, adapters: [''], block_size: 16}]",
	} {
		_, err := config.Parse([]byte(bad + "\nbackends: [{id: e0, url: 'http://127.0.0.1:1', model: m}]\n"))
		if err == nil || !strings.Contains(err.Error(), "adapter") {
			t.Errorf("%s: %v", bad, err)
		}
	}
}

// fetch GETs url.
func fetch(t *testing.T, url string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// vLLM lists its LoRA adapters in /v1/models (cards with a parent), those
// of --lora-modules and those loaded at run time. kvproxy polls the lists:
// a request for an adapter only some engines list goes to those, whether
// the configuration names the adapter or not, and an adapter no engine
// lists is an unknown model.
func TestLoRAAdaptersListedByEnginesRouteToThem(t *testing.T) {
	lists := func(adapters ...string) string {
		cards := []string{`{"id":"engine-m","object":"model","parent":null}`}
		for _, a := range adapters {
			cards = append(cards, fmt.Sprintf(`{"id":%q,"object":"model","root":"/adapters/%s","parent":"engine-m"}`, a, a))
		}
		return `{"object":"list","data":[` + strings.Join(cards, ",") + `]}`
	}
	e0 := startFake(t, "e0", func(f *fakeEngine) { f.modelList = lists("sql-lora") })
	e1 := startFake(t, "e1", func(f *fakeEngine) { f.modelList = lists() })
	e2 := startFake(t, "e2", func(f *fakeEngine) { f.modelList = lists("sql-lora", "chat-lora") })
	p := startProxyYAML(t, "models: [{name: m, adapters: [chat-lora, nowhere-lora], tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"router: {policy: round_robin}\nbackends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: e1, url: 'http://{{e1}}', model: m, served_model: engine-m}\n"+
		"  - {id: e2, url: 'http://{{e2}}', model: m, served_model: engine-m}\n", e0, e1, e2)
	waitListsRead(t, p, 3)
	served := func(model string, n int) map[string]int {
		t.Helper()
		got := map[string]int{}
		for range n {
			resp, b := post(t, p.url+"/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}]}`, model))
			if resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", model, resp.StatusCode, b)
			}
			got[resp.Header.Get(WorkerHeader)]++
		}
		return got
	}
	if got := served("sql-lora", 6); got["e0"] != 3 || got["e2"] != 3 {
		t.Fatalf("sql-lora, listed by e0 and e2 only and not configured, went to %v", got)
	}
	if got := e2.lastBody()["model"]; got != "sql-lora" {
		t.Fatalf("the engine got model %v", got)
	}
	// The index answers for a listed adapter's hashes as for its model's.
	_, b := post(t, p.url+"/v1/chat/completions", `{"model":"sql-lora","messages":[{"role":"user","content":"hi"}],"nvext":{"annotations":["query_instance_id"]}}`)
	var d decisionJSON
	json.Unmarshal(b, &d)
	hashes, _ := json.Marshal(d.BlockHashes)
	if resp, b := post(t, p.url+"/admin/index/lookup", `{"model":"sql-lora","hashes":`+string(hashes)+`}`); resp.StatusCode != 200 || !strings.Contains(string(b), `"held"`) {
		t.Fatalf("index lookup for a listed adapter: %d %s", resp.StatusCode, b)
	}
	if got := served("chat-lora", 3); got["e2"] != 3 {
		t.Fatalf("chat-lora, configured and listed by e2 alone, went to %v", got)
	}
	if got := served("nowhere-lora", 3); len(got) != 3 {
		t.Fatalf("nowhere-lora, configured but listed by no engine, went to %v: each engine should answer for itself (vLLM's resolvers load an adapter when first asked)", got)
	}
	if got := served("m", 3); len(got) != 3 {
		t.Fatalf("the base model went to %v", got)
	}
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"other-lora","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 404 {
		t.Fatalf("an adapter no engine lists: %d %s", resp.StatusCode, b)
	}
	var list struct{ Data []modelJSON }
	_, b = fetch(t, p.url+"/v1/models")
	json.Unmarshal(b, &list)
	var ids []string
	for _, c := range list.Data {
		ids = append(ids, c.ID+"<"+c.Parent)
	}
	if strings.Join(ids, " ") != "m< chat-lora<m nowhere-lora<m sql-lora<m" {
		t.Fatalf("/v1/models: %v", ids)
	}
	if resp, b := fetch(t, p.url+"/v1/models/sql-lora"); resp.StatusCode != 200 || !strings.Contains(string(b), `"parent":"m"`) {
		t.Fatalf("/v1/models/sql-lora: %d %s", resp.StatusCode, b)
	}
}

// A request for an adapter only the engines list, sent the moment kvproxy
// starts, waits for their lists to be read instead of getting a 404 (an
// end-to-end test's first request did, now and then).
func TestAdapterAskedForAtStartWaitsForTheLists(t *testing.T) {
	list := `{"object":"list","data":[{"id":"engine-m","parent":null},{"id":"sql-lora","parent":"engine-m"}]}`
	e0 := startFake(t, "e0", func(f *fakeEngine) { f.modelList, f.modelsDelay = list, 300*time.Millisecond })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}\n", e0)
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"sql-lora","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 {
		t.Fatalf("sql-lora at start: %d %s", resp.StatusCode, b)
	}
	if got := e0.lastBody()["model"]; got != "sql-lora" {
		t.Fatalf("the engine got model %v", got)
	}
	// Once the lists are read, a name nobody lists is a 404 at once.
	start := time.Now()
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"other-lora","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 404 {
		t.Fatalf("other-lora: %d %s", resp.StatusCode, b)
	}
	if d := time.Since(start); d > listsReadWait/2 {
		t.Fatalf("a 404 after the lists were read took %v", d)
	}
}

// An engine that answers 404 for an adapter (unloaded since kvproxy read its
// list, or an adapter it never had) is no worse an engine: the request goes
// to one that serves it, the engine's list leaves the adapter out until the
// next poll, and when no engine serves it the client gets the engine's 404.
// The 404s were counted as a misconfigured engine's: three of them ejected
// every backend of the model (found by the eleventh session's review).
func TestLoRAAdapterNotServedIsNoEngineFault(t *testing.T) {
	list := `{"object":"list","data":[{"id":"engine-m","parent":null},{"id":"sql-lora","parent":"engine-m"},{"id":"gone-lora","parent":"engine-m"}]}`
	e0 := startFake(t, "e0", func(f *fakeEngine) { f.modelList, f.notServed = list, "sql-lora" })
	e1 := startFake(t, "e1", func(f *fakeEngine) { f.modelList = list })
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"router: {policy: round_robin}\nbackends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: e1, url: 'http://{{e1}}', model: m, served_model: engine-m}\n", e0, e1)
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal(what)
			}
		}
	}
	waitFor("the adapter lists", func() bool { return p.s.st.Load().poolOfAdapter("sql-lora", nil) != nil })
	for i := range 6 {
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"sql-lora","messages":[{"role":"user","content":"hi"}]}`)
		if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "e1" {
			t.Fatalf("request %d: %d from %s: %s", i, resp.StatusCode, resp.Header.Get(WorkerHeader), b)
		}
	}
	if n := e0.requests.Load(); n != 1 {
		t.Fatalf("e0 was asked %d times for the adapter it does not serve, want once", n)
	}
	// gone-lora is served by neither: the client gets the engine's 404.
	for _, e := range []*fakeEngine{e0, e1} {
		e.mu.Lock()
		e.notServed = "gone-lora"
		e.mu.Unlock()
	}
	for range 4 {
		resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"gone-lora","messages":[{"role":"user","content":"hi"}]}`)
		if resp.StatusCode != 404 || !strings.Contains(string(b), "does not exist") || resp.Header.Get("Retry-After") != "" {
			t.Fatalf("an adapter no engine serves: %d %s (Retry-After %q)", resp.StatusCode, b, resp.Header.Get("Retry-After"))
		}
	}
	for _, r := range p.s.backendRows(p.s.st.Load()) {
		if !r.Healthy {
			t.Fatalf("%s was taken out for not serving an adapter", r.ID)
		}
	}
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 {
		t.Fatalf("the base model after the adapter's 404s: %d %s", resp.StatusCode, b)
	}
	p.waitIdle(t)
}

// With tokenizer: engine, an adapter's request is tokenized under the base
// model's name (adapters share its tokenizer): an engine without the
// adapter answered its /tokenize with 404 and was put out of tokenizing
// for every model for 30 s (found by the eleventh session's review).
func TestLoRAAdapterIsTokenizedAsTheBaseModel(t *testing.T) {
	e0 := startFake(t, "e0", func(f *fakeEngine) {
		f.modelList = `{"object":"list","data":[{"id":"engine-m","parent":null},{"id":"sql-lora","parent":"engine-m"}]}`
	})
	p := startProxyYAML(t, "models: [{name: m, adapters: [sql-lora], tokenizer: engine, template: chatml, block_size: 16}]\n"+
		"backends:\n  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}\n", e0)
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"sql-lora","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	e0.mu.Lock()
	defer e0.mu.Unlock()
	for i, path := range e0.paths {
		if path == "/tokenize" && e0.bodies[i]["model"] != "engine-m" {
			t.Fatalf("tokenized as %v", e0.bodies[i]["model"])
		}
	}
	if !slices.Contains(e0.paths, "/tokenize") {
		t.Fatalf("never tokenized: %v", e0.paths)
	}
}

// Only an engine's "the model does not exist" takes an adapter off its list:
// a 404 for a path it lacks, on a pass-through endpoint or on the Messages
// API, did too, and two such requests from any tenant made the adapter
// unknown to every tenant until the next poll (found by the eleventh
// session's second user trial).
func TestLoRAAdapterStaysListedAfterOther404s(t *testing.T) {
	e0 := startFake(t, "e0", func(f *fakeEngine) {
		f.modelList = `{"object":"list","data":[{"id":"engine-m","parent":null},{"id":"sql-lora","parent":"engine-m"}]}`
		f.status, f.errBody = http.StatusNotFound, `{"detail":"Not Found"}`
	})
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}\n", e0)
	b := p.s.st.Load().backends["e0"]
	for deadline := time.Now().Add(5 * time.Second); b.adapters.Load() == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the engine's list was never read")
		}
	}
	for _, path := range []string{"/pooling", "/pooling", "/v1/messages", "/v1/chat/completions"} {
		post(t, p.url+path, `{"model":"sql-lora","input":"x","max_tokens":1,"messages":[{"role":"user","content":"x"}]}`)
	}
	if yes, known := b.serves("sql-lora"); !yes || !known {
		t.Fatalf("after 404s that do not name the adapter, e0 serves it: %v (known %v)", yes, known)
	}
	p.waitIdle(t)
}

// A reload that only adds an adapter or an alias keeps the model's pool:
// its router and what it knows of the engines' caches (the whole index was
// rebuilt, and cache-aware routing started from nothing: found by the
// eleventh session's second user trial).
func TestReloadNamingKeepsTheIndex(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	yaml := func(names string) string {
		return "models: [{name: m, " + names + "tokenizer: cl100k_base, template: chatml}]\n" +
			"backends:\n  - {id: e0, url: 'http://" + e0.addr + "', model: m, served_model: engine-m, kv_events: {mode: http}}\n"
	}
	p := startProxyYAML(t, yaml("block_size: 16, "))
	ids := promptIDs(1000)
	if resp, b := post(t, p.url+"/v1/kv_events", `{"engine_id":"e0","events":[{"type":"block_stored","block_hashes":[1,2,3,4],"parent_block_hash":null,"token_ids":[`+ids+`],"block_size":16}]}`); resp.StatusCode != 200 {
		t.Fatalf("push: %d %s", resp.StatusCode, b)
	}
	overlap := func(model string) int {
		t.Helper()
		resp, b := post(t, p.url+"/v1/completions", `{"model":"`+model+`","prompt":[`+ids+`],"max_tokens":1,"nvext":{"annotations":["query_instance_id"]}}`)
		var d decisionJSON
		if resp.StatusCode != 200 || json.Unmarshal(b, &d) != nil {
			t.Fatalf("dry run: %d %s", resp.StatusCode, b)
		}
		return d.OverlapBlocks
	}
	if n := overlap("m"); n != 4 {
		t.Fatalf("before the reload: %d blocks", n)
	}
	pool := p.s.st.Load().models["m"]
	reloadYAML(t, p, yaml("block_size: 16, aliases: [mm], adapters: [sql-lora], "))
	if p.s.st.Load().models["m"] != pool {
		t.Fatal("the reload rebuilt the model's pool")
	}
	if n := overlap("mm"); n != 4 {
		t.Fatalf("after the reload, through the new alias: %d blocks", n)
	}
	if p.s.st.Load().models["sql-lora"] != pool || pool.adapter("sql-lora") != "sql-lora" {
		t.Fatal("the new adapter is not the model's")
	}
	reloadYAML(t, p, yaml("block_size: 32, "))
	if p.s.st.Load().models["m"] == pool {
		t.Fatal("a new block size kept the pool")
	}
}

// A reload that fails changes no names: the kept pool's aliases and
// adapters were swapped before a later model failed to build, and the
// adapter went to the engine as the base model until the next reload
// (found by the eleventh session's last review).
func TestFailedReloadKeepsTheNames(t *testing.T) {
	e0 := startFake(t, "e0", nil)
	head := "backends:\n  - {id: e0, url: 'http://" + e0.addr + "', model: m, served_model: engine-m}\n"
	p := startProxyYAML(t, "models: [{name: m, adapters: [sql-lora], tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+head)
	bad := filepath.Join(t.TempDir(), "tokenizer.json")
	os.WriteFile(bad, []byte("not a tokenizer"), 0o644)
	cfg, err := config.Parse([]byte("models: [{name: m, aliases: [sql-lora], tokenizer: cl100k_base, template: chatml, block_size: 16}, " +
		"{name: other, tokenizer: '" + bad + "', template: chatml, block_size: 16}]\n" + head))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.s.Reload(cfg); err == nil {
		t.Fatal("a reload with a broken tokenizer was accepted")
	}
	if resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"sql-lora","messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != 200 || e0.lastBody()["model"] != "sql-lora" {
		t.Fatalf("after the failed reload: %d %s, the engine got %v", resp.StatusCode, b, e0.lastBody()["model"])
	}
}

// vLLM runs at most max_lora adapters in a batch: a request for another
// waits there until one leaves. Its vllm:lora_requests_info says which
// adapters the batch holds; an adapter's request goes to an engine with
// room for it (or running it already) while there is one.
func TestLoRAAdapterAvoidsFullBatches(t *testing.T) {
	list := `{"object":"list","data":[{"id":"engine-m","parent":null},{"id":"sql-lora","parent":"engine-m"},{"id":"other-lora","parent":"engine-m"}]}`
	page := func(max int, running string) string {
		return fmt.Sprintf("vllm:num_requests_running{model_name=\"engine-m\"} 1\n"+
			"vllm:lora_requests_info{max_lora=\"%d\",running_lora_adapters=\"%s\",waiting_lora_adapters=\"\"} 1.79e+09\n", max, running)
	}
	engines := map[string]*fakeEngine{}
	for _, id := range []string{"e0", "e1", "e2"} {
		engines[id] = startFake(t, id, func(f *fakeEngine) { f.modelList, f.metricsPage = list, page(1, "other-lora") })
	}
	setPage := func(id, p string) {
		engines[id].mu.Lock()
		engines[id].metricsPage = p
		engines[id].mu.Unlock()
	}
	setPage("e1", page(2, "other-lora"))
	p := startProxyYAML(t, "models: [{name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"router: {policy: round_robin}\nbackends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: e1, url: 'http://{{e1}}', model: m, served_model: engine-m}\n"+
		"  - {id: e2, url: 'http://{{e2}}', model: m, served_model: engine-m}\n", engines["e0"], engines["e1"], engines["e2"])
	full := func(id string) bool { return p.s.st.Load().backends[id].loraFull("sql-lora") }
	waitScraped := func(want map[string]bool) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			ok := p.s.st.Load().poolOfAdapter("sql-lora", nil) != nil
			for id, w := range want {
				ok = ok && full(id) == w
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the engines' batches were not read as %v", want)
			}
		}
	}
	served := func(model string) map[string]int {
		t.Helper()
		got := map[string]int{}
		for range 6 {
			resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"`+model+`","messages":[{"role":"user","content":"hi"}]}`)
			if resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", model, resp.StatusCode, b)
			}
			got[resp.Header.Get(WorkerHeader)]++
		}
		return got
	}
	waitScraped(map[string]bool{"e0": true, "e1": false, "e2": true})
	if got := served("sql-lora"); got["e1"] != 6 {
		t.Fatalf("sql-lora went to %v, want e1, the one batch with room", got)
	}
	if got := served("other-lora"); len(got) != 3 {
		t.Fatalf("other-lora, running everywhere, went to %v", got)
	}
	setPage("e1", page(1, "other-lora"))
	waitScraped(map[string]bool{"e0": true, "e1": true, "e2": true})
	if got := served("sql-lora"); len(got) != 3 {
		t.Fatalf("with every batch full, sql-lora went to %v: it must wait somewhere", got)
	}
	var rows []backendJSON
	_, b := fetch(t, p.url+"/admin/backends")
	json.Unmarshal(b, &rows)
	if len(rows) != 3 || rows[0].Scrape == nil || rows[0].Scrape.LoRA == nil || rows[0].Scrape.LoRA.MaxLoRAs != 1 {
		t.Fatalf("/admin/backends does not show the batches' adapters: %s", b)
	}
	p.waitIdle(t)
}

// vLLM's model cards give max_model_len, which clients size prompts by;
// kvproxy's give the largest its engines list (a request goes to an engine
// it fits: TestRequestsGoWhereTheyFit), and none while no engine gives one
// (found by the twelfth session's SDK trial: the field was dropped).
func TestModelsGiveTheEnginesContextLength(t *testing.T) {
	card := func(maxLen string) string {
		return `{"object":"list","data":[{"id":"engine-m","object":"model","parent":null` + maxLen + `},{"id":"sql-lora","parent":"engine-m"}]}`
	}
	e0 := startFake(t, "e0", func(f *fakeEngine) { f.modelList = card(`,"max_model_len":32768`) })
	e1 := startFake(t, "e1", func(f *fakeEngine) { f.modelList = card(`,"max_model_len":8192`) })
	e2 := startFake(t, "e2", func(f *fakeEngine) { f.modelList = card(``) })
	e3 := startFake(t, "e3", func(f *fakeEngine) {
		f.modelList = `{"object":"list","data":[{"id":"engine-m","object":"model","parent":null}]}`
	})
	p := startProxyYAML(t, "models:\n"+
		"  - {name: m, aliases: [mm], tokenizer: cl100k_base, template: chatml, block_size: 16}\n"+
		"  - {name: other, tokenizer: cl100k_base, template: chatml, block_size: 16}\n"+
		"backends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: e1, url: 'http://{{e1}}', model: m, served_model: engine-m}\n"+
		"  - {id: e2, url: 'http://{{e2}}', model: m, served_model: engine-m}\n"+
		"  - {id: e3, url: 'http://{{e3}}', model: other, served_model: engine-m}\n", e0, e1, e2, e3)
	waitListsRead(t, p, 4)
	var list struct{ Data []modelJSON }
	_, b := fetch(t, p.url+"/v1/models")
	json.Unmarshal(b, &list)
	got := map[string]int{}
	for _, c := range list.Data {
		got[c.ID] = c.MaxModelLen
	}
	if want := map[string]int{"m": 32768, "mm": 32768, "sql-lora": 32768, "other": 0}; !maps.Equal(got, want) {
		t.Fatalf("/v1/models: %v, want %v (%s)", got, want, b)
	}
	if _, b := fetch(t, p.url+"/v1/models/mm"); !strings.Contains(string(b), `"max_model_len":32768`) {
		t.Fatalf("/v1/models/mm: %s", b)
	}
	if _, b := fetch(t, p.url+"/v1/models/other"); strings.Contains(string(b), `max_model_len`) {
		t.Fatalf("/v1/models/other, whose engine gives none: %s", b)
	}
	// kvproxy's own prompt limit, when lower, is the context a client gets
	// (it was listed as the engines' while longer prompts were refused).
	p.reloadYAML(t, "models:\n"+
		"  - {name: m, aliases: [mm], tokenizer: cl100k_base, template: chatml, block_size: 16}\n"+
		"  - {name: other, tokenizer: cl100k_base, template: chatml, block_size: 16}\n"+
		"backends:\n"+
		"  - {id: e0, url: 'http://"+e0.addr+"', model: m, served_model: engine-m}\n"+
		"  - {id: e1, url: 'http://"+e1.addr+"', model: m, served_model: engine-m}\n"+
		"  - {id: e2, url: 'http://"+e2.addr+"', model: m, served_model: engine-m}\n"+
		"  - {id: e3, url: 'http://"+e3.addr+"', model: other, served_model: engine-m}\n"+
		"limits: {max_prompt_tokens: 4096}\n")
	for _, path := range []string{"/v1/models", "/v1/models/mm", "/v1/models/sql-lora"} {
		if _, b := fetch(t, p.url+path); !strings.Contains(string(b), `"max_model_len":4096`) || strings.Contains(string(b), `"max_model_len":32768`) {
			t.Fatalf("%s with max_prompt_tokens 4096: %s", path, b)
		}
	}
}

// Engines of one model may run different context lengths (a few with long
// context for the long prompts). A request is sent only to an engine whose
// max_model_len holds its prompt and the output it asks for, whatever
// routing would prefer; when none does, it goes to the longest, whose
// refusal names the context /v1/models gives (the trial got the shortest
// engine's). Without this, round_robin sent every other long
// prompt to the short engine, which refuses it with 400.
func TestRequestsGoWhereTheyFit(t *testing.T) {
	short := startFake(t, "short", func(f *fakeEngine) { f.modelList = modelCard(1024) })
	long := startFake(t, "long", func(f *fakeEngine) { f.modelList = modelCard(4096) })
	unknown := startFake(t, "unknown", func(f *fakeEngine) {
		f.modelList = `{"object":"list","data":[{"id":"engine-m","object":"model","parent":null}]}`
	})
	p := startProxyYAML(t, "models:\n"+
		"  - {name: m, tokenizer: cl100k_base, template: chatml, block_size: 16}\n"+
		"  - {name: n, tokenizer: cl100k_base, template: chatml, block_size: 16}\n"+
		"backends:\n"+
		"  - {id: short, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: long, url: 'http://{{e1}}', model: m, served_model: engine-m}\n"+
		"  - {id: short-n, url: 'http://{{e0}}', model: n, served_model: engine-m}\n"+
		"  - {id: unknown-n, url: 'http://{{e2}}', model: n, served_model: engine-m}\n"+
		"router: {policy: round_robin}\n", short, long, unknown)
	waitListsRead(t, p, 4)
	words := func(n int) string { return strings.Repeat("hello ", n) } // a token each
	served := func(model, body string) map[string]int {
		t.Helper()
		got := map[string]int{}
		for range 4 {
			resp, b := post(t, p.url+"/v1/chat/completions", `{"model":"`+model+`",`+body+`}`)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			got[resp.Header.Get(WorkerHeader)]++
		}
		return got
	}
	msg := func(n int) string { return `"messages":[{"role":"user","content":"` + words(n) + `"}]` }
	if got := served("m", msg(10)); got["short"] != 2 || got["long"] != 2 {
		t.Fatalf("short prompts went to %v, want both engines in turn", got)
	}
	if got := served("m", msg(2000)); got["long"] != 4 {
		t.Fatalf("2,000-token prompts went to %v, want only the 4,096-token engine", got)
	}
	// The output asked for counts too: 500 + 600 is over 1,024.
	for _, field := range []string{"max_tokens", "max_completion_tokens"} {
		if got := served("m", msg(500)+`,"`+field+`":600`); got["long"] != 4 {
			t.Fatalf("500 tokens with %s 600 went to %v, want only the long engine", field, got)
		}
	}
	if got := served("m", msg(500)+`,"max_tokens":100`); got["short"] != 2 {
		t.Fatalf("500 tokens with max_tokens 100 went to %v, want both engines", got)
	}
	// Longer than any engine: the longest answers.
	if got := served("m", msg(5000)); got["long"] != 4 {
		t.Fatalf("a prompt too long for every engine went to %v, want the longest", got)
	}
	// An engine that does not list its context length may have room.
	if got := served("n", msg(2000)); got["unknown-n"] != 4 {
		t.Fatalf("model n's long prompts went to %v, want the engine of unknown length", got)
	}
	// The dry run tells the same.
	_, b := post(t, p.url+"/v1/chat/completions", `{"model":"m",`+msg(2000)+`,"nvext":{"annotations":["query_instance_id"]}}`)
	if !strings.Contains(string(b), `"worker_id":"long"`) {
		t.Fatalf("dry run of a long prompt: %s", b)
	}
	p.waitIdle(t)
}

// waitListsRead waits until kvproxy has read the model lists of n engines
// (/admin/backends shows their adapters).
func waitListsRead(t *testing.T, p *testProxy, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var rows []backendJSON
		_, b := fetch(t, p.url+"/admin/backends")
		json.Unmarshal(b, &rows)
		known := 0
		for _, r := range rows {
			if r.Adapters != nil {
				known++
			}
		}
		if known == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the engines' model lists were not read: %s", b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// An engine whose model list lacks the model kvproxy sends it (a kvmock
// left at its default name, an engine started with another
// --served-model-name) is warned of once, naming what it lists: the
// backend looked healthy until the first request got its 404 (found by
// the newcomer trial).
func TestEngineNotListingTheServedModelIsWarned(t *testing.T) {
	e := startFake(t, "e0", func(f *fakeEngine) {
		f.modelList = `{"object":"list","data":[{"id":"mock-model","parent":null}]}`
	})
	p := startProxyYAML(t, "models: [{name: m, block_size: 16}]\nbackends: [{id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}]\n", e)
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(p.logs.String(), "the engine does not list the model kvproxy sends it") {
		if time.Now().After(deadline) {
			t.Fatalf("no warning:\n%s", p.logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if l := p.logs.String(); !strings.Contains(l, `"served_model":"engine-m"`) || !strings.Contains(l, `"engine_models":["mock-model"]`) {
		t.Fatalf("the warning should name both:\n%s", l)
	}
}

// modelCard is a vLLM model list of engine-m with its max_model_len.
func modelCard(maxLen int) string {
	return fmt.Sprintf(`{"object":"list","data":[{"id":"engine-m","object":"model","parent":null,"max_model_len":%d}]}`, maxLen)
}

// A prompt too long for the short engines that serve its adapter goes to
// them, whose 400 names their context, not to a 503: the long engine that
// has room does not serve the adapter (it was "no healthy backend").
func TestLongPromptForAnAdapterOfShortEngines(t *testing.T) {
	list := func(maxLen int, adapters ...string) string {
		data := fmt.Sprintf(`{"id":"engine-m","object":"model","parent":null,"max_model_len":%d}`, maxLen)
		for _, a := range adapters {
			data += fmt.Sprintf(`,{"id":%q,"object":"model","parent":"engine-m","max_model_len":%d}`, a, maxLen)
		}
		return `{"object":"list","data":[` + data + `]}`
	}
	short := startFake(t, "short", func(f *fakeEngine) { f.modelList = list(1024, "sql-lora") })
	long := startFake(t, "long", func(f *fakeEngine) { f.modelList = list(4096) })
	p := startProxyYAML(t, "models: [{name: m, adapters: [sql-lora], tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: short, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: long, url: 'http://{{e1}}', model: m, served_model: engine-m}\n", short, long)
	waitListsRead(t, p, 2)
	body := `{"model":"sql-lora","messages":[{"role":"user","content":"` + strings.Repeat("hello ", 2000) + `"}]}`
	resp, b := post(t, p.url+"/v1/chat/completions", body)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "short" || short.lastBody()["model"] != "sql-lora" {
		t.Fatalf("a long prompt for the adapter: %d %s (worker %q), want it sent to short", resp.StatusCode, b, resp.Header.Get(WorkerHeader))
	}
	// The base model's long prompts still go where they fit.
	resp, b = post(t, p.url+"/v1/chat/completions", strings.Replace(body, "sql-lora", "m", 1))
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "long" {
		t.Fatalf("a long prompt for the model: %d %s (worker %q), want long", resp.StatusCode, b, resp.Header.Get(WorkerHeader))
	}
	p.waitIdle(t)
}

// A full batch is a preference, a short context is not: a long prompt for
// an adapter waits for a place in the batch of the engine it fits rather
// than go to a short engine with room, which would refuse it.
func TestLongPromptWaitsForTheBatchItFits(t *testing.T) {
	list := func(maxLen int) string {
		return fmt.Sprintf(`{"object":"list","data":[{"id":"engine-m","parent":null,"max_model_len":%[1]d},{"id":"sql-lora","parent":"engine-m","max_model_len":%[1]d}]}`, maxLen)
	}
	full := "vllm:num_requests_running{model_name=\"engine-m\"} 1\n" +
		"vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"other-lora\",waiting_lora_adapters=\"\"} 1.79e+09\n"
	short := startFake(t, "short", func(f *fakeEngine) { f.modelList = list(1024) })
	long := startFake(t, "long", func(f *fakeEngine) { f.modelList, f.metricsPage = list(4096), full })
	p := startProxyYAML(t, "models: [{name: m, adapters: [sql-lora], tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: short, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: long, url: 'http://{{e1}}', model: m, served_model: engine-m}\n", short, long)
	waitListsRead(t, p, 2)
	for deadline := time.Now().Add(5 * time.Second); !p.s.st.Load().backends["long"].loraFull("sql-lora"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("long's full batch was not read")
		}
	}
	body := `{"model":"sql-lora","messages":[{"role":"user","content":"` + strings.Repeat("hello ", 2000) + `"}]}`
	resp, b := post(t, p.url+"/v1/chat/completions", body)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "long" {
		t.Fatalf("a long prompt for the adapter: %d %s (worker %q), want long", resp.StatusCode, b, resp.Header.Get(WorkerHeader))
	}
	// A short one goes where the batch has room.
	resp, b = post(t, p.url+"/v1/chat/completions", `{"model":"sql-lora","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "short" {
		t.Fatalf("a short prompt for the adapter: %d %s (worker %q), want short", resp.StatusCode, b, resp.Header.Get(WorkerHeader))
	}
	p.waitIdle(t)
}

// The scrape loop replaces an engine's model list and context length while
// requests read them: a request must never find every engine left out
// because it read one engine twice and got two answers (a 503 "no healthy
// backend" with one healthy engine, TestFailedReloadKeepsTheNames about
// once in a thousand runs).
func TestAvoidReadsEachEngineOnce(t *testing.T) {
	e0, e1 := startFake(t, "e0", nil), startFake(t, "e1", nil)
	p := startProxyYAML(t, "models: [{name: m, adapters: [sql-lora], tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"backends:\n"+
		"  - {id: e0, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: e1, url: 'http://{{e1}}', model: m, served_model: engine-m}\n", e0, e1)
	waitListsRead(t, p, 2)
	pool, b0, b1 := p.s.st.Load().models["m"], p.s.st.Load().backends["e0"], p.s.st.Load().backends["e1"]
	none := []string{}
	b1.adapters.Store(&none)
	b1.maxModelLen.Store(1024)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // what the scrape loop does, much faster
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if i%2 == 0 {
				b0.adapters.Store(nil)
				b0.maxModelLen.Store(0)
			} else {
				b0.adapters.Store(&none)
				b0.maxModelLen.Store(1024)
			}
		}
	}()
	defer func() { close(stop); <-done }()
	for i, end := 0, time.Now().Add(2*time.Second); i < 1000000 && time.Now().Before(end); i++ {
		if avoid := pool.avoidForAdapter(nil, "sql-lora"); len(avoid) == 2 {
			t.Fatalf("run %d: the adapter left out both engines: %v", i, avoid)
		}
		if avoid := pool.avoidForLength(nil, 2000); len(avoid) == 2 {
			t.Fatalf("run %d: a 2,000-token request left out both engines: %v", i, avoid)
		}
	}
}

// An engine that is down (no scrape, so no "full batch") is no room for
// the adapter: the healthy engine whose batch is full was left out, and the
// request got a 503 with a healthy engine serving it (the review).
func TestDownEngineIsNoBatchRoom(t *testing.T) {
	list := func(maxLen int) string {
		return fmt.Sprintf(`{"object":"list","data":[{"id":"engine-m","parent":null,"max_model_len":%[1]d},{"id":"sql-lora","parent":"engine-m","max_model_len":%[1]d}]}`, maxLen)
	}
	full := "vllm:num_requests_running{model_name=\"engine-m\"} 1\n" +
		"vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"other-lora\",waiting_lora_adapters=\"\"} 1.79e+09\n"
	a := startFake(t, "a", func(f *fakeEngine) { f.modelList, f.metricsPage = list(4096), full })
	b := startFake(t, "b", func(f *fakeEngine) { f.modelList = list(4096) })
	p := serveYAML(t, strings.NewReplacer("{{e0}}", a.addr, "{{e1}}", b.addr).Replace("models: [{name: m, adapters: [sql-lora], tokenizer: cl100k_base, template: chatml, block_size: 16}]\n"+
		"health: {interval: 200ms, timeout: 100ms, fall: 1}\n"+
		"backends:\n"+
		"  - {id: a, url: 'http://{{e0}}', model: m, served_model: engine-m}\n"+
		"  - {id: b, url: 'http://{{e1}}', model: m, served_model: engine-m}\n"), false)
	waitListsRead(t, p, 2)
	for deadline := time.Now().Add(5 * time.Second); !p.s.st.Load().backends["a"].loraFull("sql-lora"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a's full batch was not read")
		}
	}
	b.unhealthy.Store(true)
	for deadline := time.Now().Add(8 * time.Second); p.s.st.Load().backends["b"].healthy(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("b not ejected")
		}
	}
	resp, body := post(t, p.url+"/v1/chat/completions", `{"model":"sql-lora","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get(WorkerHeader) != "a" {
		t.Fatalf("with b down, a request for the adapter: %d %s (worker %q), want a", resp.StatusCode, body, resp.Header.Get(WorkerHeader))
	}
	p.waitIdle(t)
}
