package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// postMessages sends a Messages API request as Anthropic's SDKs do
// (x-api-key, anthropic-version) and decodes the answer into v.
// messagesRequest is a Messages API request as Anthropic's SDKs send it.
func messagesRequest(url, body string) *http.Request {
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("x-api-key", "unused")
	req.Header.Set("anthropic-version", "2023-06-01")
	return req
}

func postMessages(t *testing.T, url, body string, v any) *http.Response {
	t.Helper()
	resp, err := http.DefaultClient.Do(messagesRequest(url, body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if v != nil {
		json.NewDecoder(resp.Body).Decode(v)
	}
	return resp
}

type anthropicMessage struct {
	Type    string `json:"type"`
	Content []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	} `json:"content"`
	Usage struct {
		InputTokens  int `json:"input_tokens"`
		OutputTokens int `json:"output_tokens"`
		CacheRead    int `json:"cache_read_input_tokens"`
	} `json:"usage"`
}

// An agent's session over the Messages API (as Claude Code sends it:
// system blocks, tools, tool_use and tool_result blocks, streamed), engines
// reporting their cache: every turn stays on the engine that holds the
// session, which the engine's own events show (overlap) and its usage
// confirms (cached tokens).
func TestMessagesAgentSession(t *testing.T) {
	es, _ := fleetWithEvents(t, 4, "-speedup", "20")
	url, p, _ := startProxyConfig(t, "log_level: info\n"+eventBackends(es, "router: {policy: kv}\n"))
	system := `[{"type":"text","text":"` + strings.Repeat("You are an agent working in a repository. ", 20) + `","cache_control":{"type":"ephemeral"}}]`
	tools := `[{"name":"bash","description":"Run a command","input_schema":{"type":"object","properties":{"command":{"type":"string"}}}},{"name":"read","input_schema":{"properties":{"path":{"type":"string"}}}}]`
	msgs := []string{`{"role":"user","content":"List the files, then read the Go ones."}`}
	var worker string
	for turn := range 4 {
		body := fmt.Sprintf(`{"model":"mock-model","max_tokens":8,"stream":true,"system":%s,"tools":%s,"messages":[%s]}`, system, tools, strings.Join(msgs, ","))
		req, _ := http.NewRequest("POST", url+"/v1/messages", strings.NewReader(body))
		req.Header.Set("x-api-key", "unused")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var text strings.Builder
		var types []string
		var usage anthropicMessage
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok || line == "[DONE]" {
				continue
			}
			var ev struct {
				Type  string `json:"type"`
				Delta struct {
					Text string `json:"text"`
				} `json:"delta"`
				Usage json.RawMessage `json:"usage"`
			}
			if err := json.Unmarshal([]byte(line), &ev); err != nil {
				t.Fatalf("turn %d: event %s: %v", turn, line, err)
			}
			types = append(types, ev.Type)
			text.WriteString(ev.Delta.Text)
			if ev.Type == "message_delta" {
				json.Unmarshal(ev.Usage, &usage.Usage)
			}
		}
		resp.Body.Close()
		w := resp.Header.Get("x-kvproxy-worker")
		if resp.StatusCode != 200 || types[len(types)-1] != "message_stop" || usage.Usage.OutputTokens == 0 || text.Len() == 0 {
			t.Fatalf("turn %d: %d, events %v, usage %+v", turn, resp.StatusCode, types, usage.Usage)
		}
		if turn == 0 {
			worker = w
		} else {
			line := accessLine(t, p, resp.Header.Get("x-request-id"))
			if w != worker || usage.Usage.CacheRead == 0 || line["overlap_blocks"].(float64) == 0 || line["cached_tokens"] != float64(usage.Usage.CacheRead) {
				t.Fatalf("turn %d: on %s (the session is on %s), cache read %d, access line %v", turn, w, worker, usage.Usage.CacheRead, line)
			}
		}
		id := fmt.Sprintf("toolu_%d", turn)
		msgs = append(msgs,
			fmt.Sprintf(`{"role":"assistant","content":[{"type":"text","text":%q},{"type":"tool_use","id":%q,"name":"bash","input":{"command":"ls -la","timeout":30.5}}]}`, text.String(), id),
			fmt.Sprintf(`{"role":"user","content":[{"type":"tool_result","tool_use_id":%q,"content":[{"type":"text","text":"a.go\nb.go (turn %d)"}]}]}`, id, turn))
	}
	assertIdle(t, url)
}

// kvproxy and the engine convert a message independently (each as vLLM
// does): count_tokens, which kvproxy answers, is the engine's prompt.
func TestMessagesPromptIsTheEngines(t *testing.T) {
	engines := fleet(t, 1, "-speedup", "50")
	url, _ := kvproxy(t, engines, "kv")
	for _, body := range []string{
		`"messages":[{"role":"user","content":"Hello"}]`,
		`"system":[{"type":"text","text":"A. "},{"type":"text","text":"B."}],"messages":[{"role":"user","content":[{"type":"text","text":"one"},{"type":"text","text":"two"}]}]`,
		`"system":"Be brief.","tools":[{"name":"f","description":"d","input_schema":{"properties":{"x":{"type":"number"}}}}],"messages":[{"role":"user","content":"go"},
			{"role":"assistant","content":[{"type":"thinking","thinking":"plan","signature":"s"},{"type":"text","text":"ok"},{"type":"tool_use","id":"t1","name":"f","input":{"x":1.0,"s":"é \"q\"","n":null,"l":[true,1e-7]}}]},
			{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"42"},{"type":"tool_result","id":"t2","content":[{"type":"text","text":"it's"}]},{"type":"text","text":"next"}]},
			{"role":"assistant","content":[{"type":"tool_result","content":"echo"}]},{"role":"user","content":[{"type":"tool_result","content":""}]}]`,
		// Claude Code's: the billing header, inline system messages (one in a tool run), images by URL and in a tool result.
		`"system":[{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.197.5c8;"},{"type":"text","text":"You are Claude Code."}],"messages":[{"role":"system","content":"lead"},{"role":"user","content":"go"},
			{"role":"assistant","content":[{"type":"redacted_thinking","data":"x"},{"type":"tool_use","id":"t1","name":"f","input":{}}]},{"role":"system","content":"mid-run"},
			{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"a"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}},{"type":"text","text":"b"}]}]},
			{"role":"user","content":[{"type":"image","source":{"type":"url","url":"https://example.com/cat.png"}},{"type":"text","text":"and this?"}]},{"role":"system","content":"trailing"}]`,
		// Two tool results with images (Claude Code reading two screenshots); an empty assistant turn.
		`"messages":[{"role":"user","content":"look"},{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"read","input":{}},{"type":"tool_use","id":"b","name":"read","input":{}}]},
			{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":[{"type":"text","text":"one"},{"type":"image","source":{"type":"url","url":"https://x/1.png"}}]},
			{"type":"tool_result","tool_use_id":"b","content":[{"type":"image","source":{"type":"base64","data":"QUJD"}}]}]},{"role":"assistant","content":[{"type":"redacted_thinking","data":"x"}]},{"role":"user","content":"so?"}]`,
		// Tools written with spaces, as Python writes JSON.
		`"tools":[{"name": "f", "description": "d", "input_schema": {"properties": {"x": {"type": "number"}}}}],"messages":[{"role":"user","content":"go"}]`,
		// No system prompt: inline system messages are folded.
		`"messages":[{"role":"user","content":"q1"},{"role":"system","content":"n1"},{"role":"assistant","content":"a1"},{"role":"system","content":"n2"},{"role":"user","content":"q2"},
			{"role":"assistant","content":[{"type":"tool_use","id":"t2","name":"f","input":{"x":1}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t2","content":"r"}]},{"role":"system","content":"n3"}]`,
	} {
		var count struct {
			InputTokens int `json:"input_tokens"`
		}
		if resp := postMessages(t, url+"/v1/messages/count_tokens", `{"model":"mock-model",`+body+`}`, &count); resp.StatusCode != 200 {
			t.Fatalf("count_tokens %s: %d", body, resp.StatusCode)
		}
		var answer anthropicMessage
		resp := postMessages(t, url+"/v1/messages", `{"model":"mock-model","max_tokens":1,`+body+`}`, &answer)
		// Anthropic's usage: input_tokens are those not read from the cache.
		if computed := answer.Usage.InputTokens + answer.Usage.CacheRead; resp.StatusCode != 200 || answer.Type != "message" || count.InputTokens == 0 || count.InputTokens != computed {
			t.Errorf("%s:\n%d: kvproxy counted %d tokens, the engine computed %d", body, resp.StatusCode, count.InputTokens, computed)
		}
	}
	var bad struct {
		Type  string `json:"type"`
		Error struct{ Type, Message string }
	}
	if resp := postMessages(t, url+"/v1/messages", `{"model":"mock-model","messages":[{"role":"user","content":"x"}]}`, &bad); resp.StatusCode != 400 || bad.Type != "error" || bad.Error.Type != "invalid_request_error" {
		t.Fatalf("no max_tokens: %d %+v", resp.StatusCode, bad)
	}
	assertIdle(t, url)
}
