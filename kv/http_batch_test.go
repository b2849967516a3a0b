package kv

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestParseHTTPBatch(t *testing.T) {
	body := `{"engine_id":"lmcache-1","model":"llama","tenant":"acme","bytes_per_block":131072,"data_parallel_rank":1,
	 "events":[
	  {"type":"block_stored","block_hashes":[1,18446744073709551615,-2,"abc"],"parent_block_hash":null,
	   "token_ids":[0,1,2,3,4,5,6,7],"block_size":2,"medium":"CPU","lora_name":"sql","extra":"ignored"},
	  {"type":"block_stored","block_hashes":[9],"parent_block_hash":"abc","token_ids":[8,9],"block_size":2},
	  {"type":"block_removed","block_hashes":[1],"medium":"shared"},
	  {"type":"all_blocks_cleared"}]}`
	b, err := ParseHTTPBatch([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if b.EngineID != "lmcache-1" || b.Model != "llama" || b.Tenant != "acme" || b.BytesPerBlock != 131072 || b.DPRank != 1 {
		t.Fatalf("header: %+v", b)
	}
	abc := EngineHashFromBytes([]byte("abc"))
	want := []Event{
		{Kind: BlockStored, EngineHashes: []uint64{1, 1<<64 - 1, 1<<64 - 2, abc}, Tokens: []uint32{0, 1, 2, 3, 4, 5, 6, 7}, BlockSize: 2, Tier: TierHost, LoRAName: "sql"},
		{Kind: BlockStored, EngineHashes: []uint64{9}, HasParent: true, EngineParent: abc, Tokens: []uint32{8, 9}, BlockSize: 2},
		{Kind: BlockRemoved, EngineHashes: []uint64{1}, Tier: TierShared},
		{Kind: AllBlocksCleared},
	}
	if !reflect.DeepEqual(b.Events, want) {
		t.Fatalf("got  %+v\nwant %+v", b.Events, want)
	}
	if b.Groups != nil {
		t.Fatalf("groups %v for events that name none", b.Groups)
	}
}

// A hybrid model's events name their KV cache group and, for a stored
// block, its kind, as vLLM's do; a batch of which one names a group has a
// group for each event.
func TestParseHTTPBatchGroups(t *testing.T) {
	body := `{"engine_id":"e","events":[
	  {"type":"all_blocks_cleared"},
	  {"type":"block_stored","block_hashes":[1],"token_ids":[1,2],"block_size":2,"group_idx":1,"kv_cache_spec_kind":"full_attention"},
	  {"type":"block_removed","block_hashes":[1],"group_idx":1,"kv_cache_spec_kind":"ignored: not a stored block's"},
	  {"type":"block_stored","block_hashes":[2],"token_ids":[1,2],"block_size":2,"group_idx":null}]}`
	b, err := ParseHTTPBatch([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := []EventGroup{{}, {1, "full_attention"}, {1, ""}, {}}
	if !reflect.DeepEqual(b.Groups, want) {
		t.Fatalf("groups %v, want %v", b.Groups, want)
	}
	_, err = ParseHTTPBatch([]byte(`{"engine_id":"e","events":[{"type":"block_removed","block_hashes":[1],"group_idx":-1}]}`))
	if be := (*HTTPBatchError)(nil); !errors.As(err, &be) || be.Path != "events[0].group_idx" {
		t.Fatalf("a negative group: %v", err)
	}
}

// Every malformed batch is rejected with an error naming where the problem is.
func TestParseHTTPBatchErrorsNameTheField(t *testing.T) {
	stored := func(fields string) string {
		return `{"engine_id":"e","events":[{"type":"block_removed","block_hashes":[1]},{"type":"block_stored",` + fields + `}]}`
	}
	cases := map[string]struct{ body, path string }{
		"no engine":      {`{"events":[]}`, "engine_id"},
		"empty engine":   {`{"engine_id":"","events":[]}`, "engine_id"},
		"no events":      {`{"engine_id":"e"}`, "events"},
		"neg bytes":      {`{"engine_id":"e","bytes_per_block":-1,"events":[]}`, "bytes_per_block"},
		"bad json":       {`{"engine_id":"e",`, ""},
		"trailing":       {`{"engine_id":"e","events":[]}]`, ""},
		"events type":    {`{"engine_id":"e","events":{}}`, "events"},
		"unknown type":   {`{"engine_id":"e","events":[{"type":"block_moved"}]}`, "events[0].type"},
		"missing type":   {`{"engine_id":"e","events":[{}]}`, "events[0].type"},
		"no hashes":      {stored(`"token_ids":[],"block_size":2`), "events[1].block_hashes"},
		"bad size":       {stored(`"block_hashes":[1],"token_ids":[1,2],"block_size":0`), "events[1].block_size"},
		"token count":    {stored(`"block_hashes":[1],"token_ids":[1,2,3],"block_size":2`), "events[1].token_ids"},
		"neg token":      {stored(`"block_hashes":[1],"token_ids":[1,-2],"block_size":2`), "events[1].token_ids"},
		"bad medium":     {stored(`"block_hashes":[1],"token_ids":[1,2],"block_size":2,"medium":"TAPE"`), "events[1].medium"},
		"float hash":     {stored(`"block_hashes":[1.5],"token_ids":[1,2],"block_size":2`), "events[1]"},
		"null hash":      {stored(`"block_hashes":[null],"token_ids":[1,2],"block_size":2`), "events[1]"},
		"lora not str":   {stored(`"block_hashes":[1],"token_ids":[1,2],"block_size":2,"lora_name":5`), "events[1].lora_name"},
		"event not obj":  {`{"engine_id":"e","events":[5]}`, "events[0]"},
		"removed medium": {`{"engine_id":"e","events":[{"type":"block_removed","block_hashes":[1],"medium":"x"}]}`, "events[0].medium"},
	}
	for name, c := range cases {
		b, err := ParseHTTPBatch([]byte(c.body))
		var be *HTTPBatchError
		if !errors.As(err, &be) {
			t.Errorf("%s: want *HTTPBatchError, got %v", name, err)
			continue
		}
		if !strings.HasPrefix(be.Path, c.path) {
			t.Errorf("%s: path %q, want prefix %q (%v)", name, be.Path, c.path, err)
		}
		if b.Events != nil || b.EngineID != "" {
			t.Errorf("%s: partial batch returned", name)
		}
		// The message speaks JSON, not Go (it said "[]json.RawMessage").
		if strings.Contains(err.Error(), "json.") || strings.Contains(err.Error(), "[]") {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := ParseHTTPBatch([]byte(`{"engine_id":"e","events":"x"}`)); err == nil || !strings.Contains(err.Error(), "want an array, not string") {
		t.Errorf("events as a string: %v", err)
	}
}

func FuzzParseHTTPBatch(f *testing.F) {
	// Seed corpus: testdata/fuzz/FuzzParseHTTPBatch.
	f.Fuzz(func(t *testing.T, b []byte) {
		batch, err := ParseHTTPBatch(b)
		if err != nil {
			var be *HTTPBatchError
			if !errors.As(err, &be) {
				t.Fatalf("error of type %T: %v", err, err)
			}
			return
		}
		if batch.EngineID == "" {
			t.Fatal("batch without engine accepted")
		}
		for _, e := range batch.Events {
			copied := len(e.Tokens) == 0 && !e.HasParent && e.BlockSize == 0 // an offloaded copy (Event)
			if e.Kind == BlockStored && !copied && (e.BlockSize <= 0 || len(e.Tokens) != len(e.EngineHashes)*e.BlockSize) {
				t.Fatalf("inconsistent event %+v", e)
			}
			if e.Kind != AllBlocksCleared && len(e.EngineHashes) == 0 {
				t.Fatal("event without hashes accepted")
			}
		}
	})
}

// A block_stored without token ids or parent is a copy of blocks announced
// before (vLLM's CPU offloading sends block_size 0 or the engine's), as
// the ZMQ decoder reads it; with a parent, tokens are required.
func TestParseHTTPBatchCopy(t *testing.T) {
	for _, ev := range []string{
		`{"type":"block_stored","block_hashes":[1,2],"parent_block_hash":null,"token_ids":[],"block_size":0,"medium":"CPU"}`,
		`{"type":"block_stored","block_hashes":[1,2],"block_size":16,"medium":"CPU"}`,
	} {
		b, err := ParseHTTPBatch([]byte(`{"engine_id":"e","events":[` + ev + `]}`))
		if err != nil {
			t.Fatalf("%s: %v", ev, err)
		}
		if e := b.Events[0]; e.Kind != BlockStored || len(e.Tokens) != 0 || e.BlockSize != 0 || e.HasParent || e.Tier != TierHost || len(e.EngineHashes) != 2 {
			t.Fatalf("%s: %+v, want a copy to the host tier", ev, e)
		}
	}
	if _, err := ParseHTTPBatch([]byte(`{"engine_id":"e","events":[{"type":"block_stored","block_hashes":[1],"parent_block_hash":7,"token_ids":[],"block_size":2}]}`)); err == nil {
		t.Fatal("a block_stored with a parent and no tokens was accepted")
	}
}
