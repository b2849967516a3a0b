package proxy

import (
	"bytes"
	"reflect"
	"strings"
	"testing"

	"github.com/kvproxy/kvproxy/tokenize"
)

// TestParseRequestStrings: strings decode as encoding/json decodes them,
// whether or not they need decoding, and content parts join with newlines
// (vLLM's "\n".join); tool calls are kept apart from the content.
func TestParseRequestStrings(t *testing.T) {
	cases := []struct {
		name, messages string
		want           []string // role, content, role, content, ...
	}{
		{"plain", `[{"role":"user","content":"héllo"}]`, []string{"user", "héllo"}},
		{"escapes", `[{"role":"user","content":"a\nb\t\"q\"\\ \/ \b\f\r \u00e9\u4e16 \ud83d\ude00"}]`,
			[]string{"user", "a\nb\t\"q\"\\ / \b\f\r é世 😀"}},
		{"lone surrogates", `[{"role":"user","content":"\ud800x\udc00\ud83dA\ud83d\ud83d\ude00"}]`,
			[]string{"user", "\uFFFDx\uFFFD\uFFFDA\uFFFD😀"}},
		{"invalid utf-8", "[{\"role\":\"user\",\"content\":\"a\xff\xe2\x82b\"}]", []string{"user", "a\uFFFD\uFFFD\uFFFDb"}},
		{"escaped role and key", `[{"r\u006fle":"\u0075ser","c\u006Fntent":"x"}]`, []string{"user", "x"}},
		{"names match exactly", `[{"role":"user","Role":"tool","content":"x","CONTENT":"y"}]`, []string{"user", "x"}},
		{"last member wins, null too", `[{"role":"tool","role":"user","content":"a","content":"b"},{"role":"user","content":"c","content":null}]`, []string{"user", "b", "user", ""}},
		{"parts", `[{"role":"user","content":[{"type":"text","text":"a\n"},{"type":"image_url","image_url":{"url":"u"}} ,{"type":"t\u0065xt","text":"\u00e9"},{"type":"text"}]}]`,
			[]string{"user", "a\n\n" + string(tokenize.AppendMediaStandIn(nil, []byte("u"))) + "\né"}},
		{"tool calls", `[{"role":"assistant","content":"c\n","tool_calls":[{"id":"1"}]},{"role":"tool","content":null,"tool_calls":[2]}]`,
			[]string{"assistant", "c\n", "tool", ""}},
		{"backslashes before a quote", `[{"role":"user","content":"x\\"},{"role":"user","content":"\\\"y\\\\"}]`, []string{"user", `x\`, "user", `\"y\\`}},
		{"no content", `[{"role":"system"},{"role":"user","content":null,"name":"n"}]`, []string{"system", "", "user", ""}},
		{"parts vLLM reads as text", `[{"role":"assistant","content":[{"type":"refusal","refusal":"no","text":"x"},{"type":"output_text","text":"o"},{"type":"thinking","thinking":"t"},{"type":"input_text","text":null}]}]`, []string{"assistant", "no\no\nt"}},
		{"string parts, a text part without text", `[{"role":"user","content":["a",{"type":"text"},{"type":"text","text":null},"b",{"type":"text","text":""}]}]`, []string{"user", "a\nb\n"}},
		{"any role", `[{"role":"ipython","content":"42"},{"role":"function","content":"f"}]`, []string{"ipython", "42", "function", "f"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			body := `{"model":"m\u0031","messages":` + c.messages + `}`
			req, pe := parseRequest([]byte(body), true)
			if pe != nil {
				t.Fatalf("error %s: %s", pe.param, pe.msg)
			}
			if req.model != "m1" {
				t.Fatalf("model %q", req.model)
			}
			var got []string
			for _, m := range req.messages {
				got = append(got, m.Role, m.Content)
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Fatalf("got %q\nwant %q", got, c.want)
			}
		})
	}
}

// TestParseRequestMedia: an image's data: URL, megabytes of base64, is a
// short digest in the routed prompt, the same for the same image and
// another for another one (found by a user trial: a phone photo counted as
// 287k prompt tokens and was refused).
func TestParseRequestMedia(t *testing.T) {
	image := func(data string) string {
		return `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},` +
			`{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,` + data + `"}}]}]}`
	}
	big := strings.Repeat("QUJD", 250_000) // 1 MB of base64
	var contents []string
	for _, body := range []string{image(big), image(big), image(big[4:])} {
		req, pe := parseRequest([]byte(body), true)
		if pe != nil {
			t.Fatal(pe.msg)
		}
		contents = append(contents, req.messages[0].Content)
	}
	if len(contents[0]) > 64 || !strings.HasPrefix(contents[0], "what is this?\n<media ") {
		t.Fatalf("routed content %.100q (%d bytes)", contents[0], len(contents[0]))
	}
	if contents[0] != contents[1] || contents[0] == contents[2] {
		t.Fatalf("the same image must route the same and another one not: %q", contents)
	}
	// However the part is written (SDKs differ in spacing and member order,
	// detail and uuid are optional, Responses-style parts carry the URL as
	// a string), the same image is the same digest (found by the eighth
	// session's second trial).
	url := "data:image/png;base64," + big[:4000]
	for _, part := range []string{
		`{"image_url": {"url": "` + url + `", "detail": "high"}, "type": "image_url"}`,
		`{"type":"image_url","uuid":"u1","image_url":{"url":"` + strings.ReplaceAll(url, "/", `\/`) + `"}}`,
		`{"type":"input_image","image_url":"` + url + `"}`,
	} {
		req, pe := parseRequest([]byte(`{"model":"m","messages":[{"role":"user","content":[`+part+`]}]}`), true)
		if pe != nil {
			t.Fatal(pe.msg)
		}
		if want := string(tokenize.AppendMediaStandIn(nil, []byte(url))); req.messages[0].Content != want {
			t.Fatalf("%.80s...: %q, want %q", part, req.messages[0].Content, want)
		}
	}
}

// TestParseRequestErrors: every validation error keeps its parameter and
// message.
func TestParseRequestErrors(t *testing.T) {
	const notMessages = "messages must be an array of message objects with a string role"
	cases := []struct {
		body       string
		chat       bool
		param, msg string
	}{
		{" ", true, "", "the request body is empty; expected a JSON object"},
		{`[1]`, true, "", "the request body is not a valid JSON object"},
		{`{"model":"m",}`, true, "", "the request body is not a valid JSON object: invalid character '}' looking for beginning of object key string (at byte 14)"},
		{"{\"model\":\"m\x01\"}", true, "", "the request body is not a valid JSON object: invalid character '\\x01' in string literal (at byte 12)"},
		{`{"messages":[]}`, true, "messages", "messages must contain at least one message"}, // no model: the caller's to decide
		{`{"Model":"m","messages":[]}`, true, "messages", "messages must contain at least one message"},
		{`{"model":"m","model":null}`, true, "messages", "you must provide a messages parameter"}, // null is no model, as in vLLM
		{`{"model":"m","nvext":{"token_data":"x"}}`, true, "nvext", "nvext must be an object with token_data (token ids), backend_instance_id, annotations (strings) and greed_sampling (a boolean)"},
		{`{"model":"m","Messages":[{"role":"user"}]}`, true, "messages", "you must provide a messages parameter"},
		{`{"model":"m","messages":[{"role":"user","role":null}]}`, true, "messages[0].role", "every message needs a role: a non-empty string such as system, user, assistant or tool"},
		{`{"model":[]}`, true, "model", "model must be a string"},
		{`{"model":""}`, true, "messages", "you must provide a messages parameter"}, // "" is no model, as in vLLM
		{`{"model":7}`, true, "model", "model must be a string"},
		{`{"model":"m","stream":"true"}`, true, "stream", "stream must be a boolean"},
		{`{"model":"m","nvext":[]}`, true, "nvext", "nvext must be an object with token_data (token ids), backend_instance_id, annotations (strings) and greed_sampling (a boolean)"},
		{`{"model":"m","add_generation_prompt":1,"messages":[]}`, true, "add_generation_prompt", "add_generation_prompt must be a boolean"},
		{`{"model":"m"}`, true, "messages", "you must provide a messages parameter"},
		{`{"model":"m","messages":null}`, true, "messages", "messages must contain at least one message"},
		{`{"model":"m","messages":[]}`, true, "messages", "messages must contain at least one message"},
		{`{"model":"m","messages":{}}`, true, "messages", notMessages},
		{`{"model":"m","messages":[{"role":"bad"},{"role":1}]}`, true, "messages", notMessages},
		{`{"model":"m","messages":[{"role":"user","name":2}]}`, true, "messages[0].name", "name must be a string"},
		{`{"model":"m","messages":[{"role":"user"},{"role":"tool","tool_call_id":{}},{"role":2}]}`, true, "messages[1].tool_call_id", "tool_call_id must be a string"},
		{`{"model":"m","messages":[{"role":"assistant","tool_calls":"x","name":1}]}`, true, "messages[0].tool_calls", "tool_calls must be an array of tool calls"},
		{`{"model":"m","tools":{},"messages":[{"role":"user"}]}`, true, "tools", "tools must be an array of tool objects"},
		{`{"model":"m","tools":[{},"f"],"messages":[{"role":"user"}]}`, true, "tools[1]", "tools must be an array of tool objects"},
		{`{"model":"m","messages":[{"role":"user"},3]}`, true, "messages", notMessages},
		{`{"model":"m","messages":[{"role":"user"},null]}`, true, "messages[1].role", "every message needs a role: a non-empty string such as system, user, assistant or tool"},
		{`{"model":"m","messages":[{"role":"user","content":5}]}`, true, "messages[0].content", "content must be a string or an array of content parts"},
		{`{"model":"m","messages":[{"role":"user","content":{}}]}`, true, "messages[0].content", "content must be a string or an array of content parts"},
		{`{"model":"m","messages":[{"role":"user","content":[{"type":"text"},{"text":"x"}]}]}`, true, "messages[0].content[1]", "content part must be an object with a type, or a string"},
		{`{"model":"m","messages":[{"role":"user","content":[{"type":""}]}]}`, true, "messages[0].content[0]", "content part must be an object with a type, or a string"},
		{`{"model":"m","messages":[{"role":"user","content":[null]}]}`, true, "messages[0].content[0]", "content part must be an object with a type, or a string"},
		{`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":1}]}]}`, true, "messages[0].content[0]", "a content part's text must be a string"},
		{`{"model":"m","messages":[{"role":"user","content":[{"type":"refusal","refusal":5}]}]}`, true, "messages[0].content[0]", "a content part's refusal must be a string"},
		{`{"model":"m","prompt":null}`, false, "prompt", "you must provide a prompt parameter"},
		{`{"model":"m","prompt":[]}`, false, "prompt", "prompt must not be empty"},
		{`{"model":"m","prompt":{}}`, false, "prompt", "prompt must be a string, an array of strings, or an array of token ids (integers 0..4294967295)"},
	}
	for _, c := range cases {
		_, pe := parseRequest([]byte(c.body), c.chat)
		if pe == nil {
			t.Errorf("%s: accepted", c.body)
			continue
		}
		if pe.param != c.param || pe.msg != c.msg {
			t.Errorf("%s:\n got %s: %s\nwant %s: %s", c.body, pe.param, pe.msg, c.param, c.msg)
		}
	}
}

// TestParseRequestReuse: a reset request parses the next body as a new one
// would, and strings of the next request do not overwrite nothing it still
// needs while parsing.
func TestParseRequestReuse(t *testing.T) {
	var r apiRequest
	bodies := []string{
		`{"model":"a\n","stream":true,"add_generation_prompt":false,"nvext":{"annotations":["x"]},"messages":[{"role":"user","content":"\u00e9"},{"role":"assistant","content":[{"type":"text","text":"p"}]}]}`,
		`{"model":"b","messages":[{"role":"user","content":"x\ny"}]}`,
	}
	for _, body := range bodies {
		r.reset()
		if pe := r.parse([]byte(body), true); pe != nil {
			t.Fatal(pe.msg)
		}
		want, _ := parseRequest([]byte(body), true)
		if r.model != want.model || r.stream != want.stream || r.addGenPrompt != want.addGenPrompt ||
			!reflect.DeepEqual(r.messages, want.messages) || !reflect.DeepEqual(r.nv, want.nv) {
			t.Fatalf("reused request differs from a new one:\n%+v\n%+v", r, *want)
		}
	}
}

// FuzzParseRequestMatchesDecoder holds the scanning parser to the one that
// decoded with goccy/go-json (request_ref_test.go): the same errors, the
// same fields, the same strings, the same engine body.
func FuzzParseRequestMatchesDecoder(f *testing.F) {
	seeds := []string{
		chatBody,
		`{"model":"m","messages":[{"role":"user","content":"a\nb\u00e9\ud800\ud83d\ude00"}],"Stream":false,"ADD_GENERATION_PROMPT":null}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url","image_url":{"url":"u"}}]}],"cache_salt":"evil"}`,
		`{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c"}]},{"role":"tool","content":"r","name":null}]}`,
		`{"model":"m","messages":[{"role":"user","role":null}, null, 1]}`,
		`{"model":"m","ſtream":true,"mesſages":[{"ROLE":"\u0075ser","Content":"\t"}],"model":"n"}`,
		`{"\u006dodel":"m\"","prompt":"p\n","nvext":{"token_data":[1,2],"backend_instance_id":"b"}}`,
		`{"model":"m","prompt":[[1],[2]]}`,
		`{"model":"m","prompt":"p","temperature":0.7,"top_k":null,"min_p":0.1,"nvext":{"greed_sampling":true,"top_k" : 5,"min_p":0.2,"ignore_eos":null,"greed_sampling":null,"repetition_\u0070enalty":1.1}}`,
		`{"model":"m","prompt":"p","nvext":{"greed_sampling":"x","greed_sampling":false}}`,
		`{"model":"m","prompt":"p","top_k":5,"top_k":null,"nvext":{"top_k":3}}`,
		"{\"model\":\"m\xff\",\"messages\":[{\"role\":\"user\",\"content\":\"\xe2\x82\"}]}",
		`{"model":"m","messages":[{"role":"user","content":[{"type":"t\u0065xt","text":"a","text":null},{"type":null,"type":"x"}]}]}`,
		`{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"assistant","tool_calls":[{"id":"a","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"a","name":"f","name":null,"content":"r"}]}`,
		`{"model":"m","tools":[],"messages":[{"role":"assistant","tool_calls":[ ],"content":"x"},{"role":"tool","tool_call_id":"\u0061","tool_call_id":3}]}`,
		`{"model":"m","tools":null,"messages":[{"role":"user","name":"n","name":2},{"role":1}]}`,
		`{"model":"m","prompt":["a","b\n",""]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"\u0074\u0068\u0069\u006e\u006b\u0069\u006e\u0067","thinking":"hi"},{"type":"input\u005f\u0074\u0065\u0078\u0074","text":"x"}]}]}`,
		`{"model":"m","messages":[{"role":"user","content":["s",{"type":"refusal","refusal":"r"},{"type":"thinking","thinking":null},{"type":"input_image","image_url":"u"},{"type":""},{"type":"text","text":5}]}]}`,
		`{"model":"m","messages":[{"role":"assistant","reasoning":"r","reasoning_content":"c"},{"role":"assistant","reasoning":null,"reasoning_content":"c"},{"role":"assistant","reasoning_content":"\u00e9"},{"role":"assistant","reasoning":5}]}`,
		`{"model":"m","prompt":[[1,2],[3],[]]}`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), true)
		f.Add([]byte(s), false)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		ref, rpe := refParseRequest(body, chat)
		var got apiRequest
		got.text = make([]byte, 0, 1) // force growth while strings are held
		pe := got.parse(body, chat)
		if (pe == nil) != (rpe == nil) {
			t.Fatalf("error %v, reference %v", pe, rpe)
		}
		if pe != nil {
			if *pe != *rpe {
				t.Fatalf("error %s: %q, reference %s: %q", pe.param, pe.msg, rpe.param, rpe.msg)
			}
			return
		}
		if got.model != ref.model || got.stream != ref.stream || got.addGenPrompt != ref.addGenPrompt ||
			got.promptText != ref.promptText || got.hasTokens != ref.hasTokens || !reflect.DeepEqual(got.promptTokens, ref.promptTokens) ||
			got.tools != ref.tools || got.cacheSalt != ref.cacheSalt || !reflect.DeepEqual(got.batchTexts, ref.batchTexts) || !reflect.DeepEqual(got.batchTokens, ref.batchTokens) ||
			!reflect.DeepEqual(got.nv, ref.nv) || len(got.messages) != len(ref.messages) {
			t.Fatalf("fields differ:\n%+v\n%+v", got, *ref)
		}
		for i := range got.messages {
			if got.messages[i] != ref.messages[i] {
				t.Fatalf("message %d: %q, reference %q", i, got.messages[i], ref.messages[i])
			}
		}
		gf, rf := got.fields, ref.refFields
		for _, p := range [][2][]byte{{gf.Model, rf.Model}, {gf.Stream, rf.Stream}, {gf.Nvext, rf.Nvext}, {gf.AddGenerationPrompt, rf.AddGenerationPrompt}, {gf.Messages, rf.Messages}, {gf.Prompt, rf.Prompt}} {
			if (p[0] == nil) != (p[1] == nil) || !bytes.Equal(p[0], p[1]) {
				t.Fatalf("raw field %q, reference %q", p[0], p[1])
			}
		}
		for _, salt := range []string{"", "s<alt>"} {
			for _, es := range []bool{false, true} {
				got.engineSampling = es
				out, err := got.forwardBody(nil, "served\n", salt)
				rout, rerr := ref.refForwardBody("served\n", salt, es)
				if (err == nil) != (rerr == nil) || !bytes.Equal(out, rout) {
					t.Fatalf("engine body %s (%v), reference %s (%v)", out, err, rout, rerr)
				}
			}
		}
	})
}

func TestKeyIs(t *testing.T) {
	for key, want := range map[string]bool{
		`stream`: true, `\u0073tream`: true, `\u0073\u0074\u0072\u0065\u0061\u006D`: true, `s\u0074ream`: true,
		`STREAM`: false, `sTrEaM`: false, `ſtream`: false, `\u017Ftream`: false, `\u0053tream`: false,
		`strea`: false, `streams`: false, `stre@m`: false, `stream\u0000`: false, `\u0000stream`: false, ``: false,
	} {
		if got := keyIs([]byte(key), "stream"); got != want {
			t.Errorf("keyIs(%s, stream) = %v", key, got)
		}
	}
	if !keyIs([]byte(`add_generation_prompt`), "add_generation_prompt") || keyIs([]byte("add-generation-prompt"), "add_generation_prompt") {
		t.Error("underscores")
	}
}

// TestNvextNamesMatchExactly: nvext's members are read as the rest of the
// request is, by exact name with the last one winning.
func TestNvextNamesMatchExactly(t *testing.T) {
	body := `{"model":"m","prompt":[1],"nvext":{"token_data":[9],"Token_Data":[8],"token_data":[1,2],` +
		`"annotations":["a"],"ANNOTATIONS":["b"],"backend_instance_id":"x","Backend_Instance_Id":"y"}}`
	req, pe := parseRequest([]byte(body), false)
	if pe != nil {
		t.Fatalf("error %s: %s", pe.param, pe.msg)
	}
	if !reflect.DeepEqual(req.nv.TokenData, []uint32{1, 2}) || !reflect.DeepEqual(req.nv.Annotations, []string{"a"}) || string(req.nv.BackendInstanceID) != `"x"` {
		t.Fatalf("nvext %+v", req.nv)
	}
}

// nvext's sampling member goes where the request's own is absent or, as
// engines read duplicates (the last), null: then every occurrence of the
// request's goes (the fourth review: an earlier value stayed and the
// engine, or a null after it, won over nvext's).
func TestNvextSamplingAgainstDuplicates(t *testing.T) {
	for body, want := range map[string]string{
		`{"prompt":"p","top_k":5,"top_k":null,"nvext":{"top_k":3}}`: `{"prompt":"p","model":"e","top_k":3}`,
		`{"prompt":"p","top_k":null,"top_k":5,"nvext":{"top_k":3}}`: `{"prompt":"p","top_k":null,"top_k":5,"model":"e"}`,
		`{"prompt":"p","nvext":{"top_k":3,"min_p":null}}`:           `{"prompt":"p","model":"e","top_k":3}`,
	} {
		var r apiRequest
		if pe := r.parse([]byte(body), false); pe != nil {
			t.Fatal(pe)
		}
		r.engineSampling = true
		if out, err := r.forwardBody(nil, "e", ""); err != nil || string(out) != want {
			t.Errorf("%s: %s (%v), want %s", body, out, err, want)
		}
	}
}
