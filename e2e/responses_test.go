package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"github.com/openai/openai-go/responses"
)

// accessLine is kvproxy's access log line for a request id.
func accessLine(t *testing.T, p *proc, rid string) map[string]any {
	t.Helper()
	var line map[string]any
	waitFor(t, 3*time.Second, "the access line of "+rid, func() bool {
		for _, l := range strings.Split(p.String(), "\n") {
			if strings.Contains(l, `"request_id":"`+rid+`"`) && strings.Contains(l, `"message":"request"`) {
				return json.Unmarshal([]byte(l[strings.IndexByte(l, '{'):]), &line) == nil
			}
		}
		return false
	})
	return line
}

// The Responses API through the OpenAI SDK, engines reporting their cache
// (KV events): a conversation the client resends whole is routed by its
// prefix to the engine that holds it (kvproxy's tokens hash as the
// engine's do), and one the engine stores continues there by
// previous_response_id, streamed or not.
func TestResponsesAPIThroughTheSDK(t *testing.T) {
	es, _ := fleetWithEvents(t, 4, "-speedup", "20")
	url, p, _ := startProxyConfig(t, "log_level: info\n"+eventBackends(es, "router: {policy: kv}\n"))
	c := client(url)
	ctx := context.Background()

	system := strings.Repeat("You are a meticulous assistant who answers in full sentences. ", 12)
	var input responses.ResponseInputParam
	var worker string
	for turn := range 4 {
		input = append(input, responses.ResponseInputItemParamOfMessage(fmt.Sprintf("Turn %d: tell me about the number %d.", turn, turn*7), responses.EasyInputMessageRoleUser))
		var httpResp *http.Response
		res, err := c.Responses.New(ctx, responses.ResponseNewParams{
			Model:           "mock-model",
			Instructions:    openai.String(system),
			Input:           responses.ResponseNewParamsInputUnion{OfInputItemList: input},
			MaxOutputTokens: openai.Int(8),
			Store:           openai.Bool(false),
		}, option.WithResponseInto(&httpResp))
		if err != nil {
			t.Fatal(err)
		}
		w := httpResp.Header.Get("x-kvproxy-worker")
		if turn == 0 {
			worker = w
		} else {
			line := accessLine(t, p, httpResp.Header.Get("x-request-id"))
			if w != worker || res.Usage.InputTokensDetails.CachedTokens == 0 || line["overlap_blocks"].(float64) == 0 {
				t.Fatalf("turn %d: on %s (the conversation is on %s), %d cached tokens, access line %v", turn, w, worker, res.Usage.InputTokensDetails.CachedTokens, line)
			}
		}
		input = append(input, responses.ResponseInputItemParamOfMessage(res.OutputText(), responses.EasyInputMessageRoleAssistant))
	}

	var httpResp *http.Response
	first, err := c.Responses.New(ctx, responses.ResponseNewParams{
		Model:           "mock-model",
		Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String("Tell me a story about a lighthouse keeper.")},
		MaxOutputTokens: openai.Int(8),
	}, option.WithResponseInto(&httpResp))
	if err != nil {
		t.Fatal(err)
	}
	owner := httpResp.Header.Get("x-kvproxy-worker")
	if !strings.HasPrefix(first.ID, "resp_kvp") || owner == "" {
		t.Fatalf("first response %s from %q", first.ID, owner)
	}
	prev := first.ID
	for turn := 1; turn <= 3; turn++ {
		res, err := c.Responses.New(ctx, responses.ResponseNewParams{
			Model:              "mock-model",
			Input:              responses.ResponseNewParamsInputUnion{OfString: openai.String(fmt.Sprintf("And then, part %d?", turn))},
			PreviousResponseID: openai.String(prev),
			MaxOutputTokens:    openai.Int(8),
		}, option.WithResponseInto(&httpResp))
		if err != nil {
			t.Fatalf("turn %d: %v", turn, err) // another engine answers 404: it does not hold the response
		}
		if w := httpResp.Header.Get("x-kvproxy-worker"); w != owner || res.PreviousResponseID != prev || res.Usage.InputTokensDetails.CachedTokens == 0 {
			t.Fatalf("turn %d: on %s (the response is on %s), previous %q, %d cached tokens", turn, w, owner, res.PreviousResponseID, res.Usage.InputTokensDetails.CachedTokens)
		}
		prev = res.ID
	}

	stream := c.Responses.NewStreaming(ctx, responses.ResponseNewParams{
		Model:              "mock-model",
		Input:              responses.ResponseNewParamsInputUnion{OfString: openai.String("How does it end?")},
		PreviousResponseID: openai.String(prev),
		MaxOutputTokens:    openai.Int(12),
	}, option.WithJSONSet("ignore_eos", true))
	var text strings.Builder
	var completed responses.Response
	for stream.Next() {
		switch ev := stream.Current(); ev.Type {
		case "response.output_text.delta":
			text.WriteString(ev.Delta.OfString)
		case "response.completed", "response.incomplete":
			completed = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(completed.ID, "resp_kvp") || completed.PreviousResponseID != prev || completed.Usage.OutputTokens != 12 ||
		text.String() != completed.OutputText() || completed.Usage.InputTokensDetails.CachedTokens == 0 {
		t.Fatalf("streamed follow-up: %s (previous %q, want %q), usage %+v, text %q vs %q", completed.ID, completed.PreviousResponseID, prev, completed.Usage, text.String(), completed.OutputText())
	}

	got, err := c.Responses.Get(ctx, completed.ID, responses.ResponseGetParams{})
	if err != nil || got.ID != completed.ID || got.PreviousResponseID != prev {
		t.Fatalf("retrieve: %v %+v", err, got)
	}
	if err := c.Responses.Delete(ctx, completed.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	var apiErr *openai.Error
	if _, err := c.Responses.Get(ctx, completed.ID, responses.ResponseGetParams{}); !asAPIError(err, &apiErr) || apiErr.StatusCode != 404 {
		t.Fatalf("retrieve after delete: %v", err)
	}
	assertIdle(t, url)
}

// kvproxy and the engine render a response's input independently (each as
// vLLM does): the prompt kvproxy routes on is the one the engine computes,
// item shape by item shape.
func TestResponsesPromptIsTheEngines(t *testing.T) {
	engines := fleet(t, 1, "-speedup", "50")
	url, _ := kvproxy(t, engines, "kv")
	tools := `"tools":[{"type":"function","name":"get_weather","parameters":{ "type": "object", "properties": {"city": {"type": "string"}} },"description":"Weather","x_extra":{ "a": 1 }},{"type":"web_search"},{"type":"function","name":"t2","strict":true}]`
	for _, body := range []string{
		`"input":"Hello there"`,
		`"instructions":"Be brief.","input":[{"role":"user","content":[{"type":"input_text","text":"Hi"},{"type":"input_text","text":"again"}]}]`,
		`"input":[{"role":"user","content":"Weather?"},{"type":"reasoning","summary":[{"type":"summary_text","text":"s"}],"content":[{"type":"reasoning_text","text":"think"}]},
			{"type":"function_call","call_id":"c1","name":"get_weather","arguments":"{\"city\":\"Paris\"}"},{"type":"function_call","call_id":"c2","name":"t2","namespace":"ns","arguments":"{}"},
			{"type":"function_call_output","call_id":"c1","output":"18C"},{"type":"function_call_output","call_id":"c2","output":"ok"},
			{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Mild."}]},{"type":"reasoning","summary":[{"type":"summary_text","text":"more"}]},
			{"type":"reasoning","content":[{"type":"reasoning_text"}],"summary":[{"type":"summary_text","text":"not this"}]},{"role":"developer","content":"Stay on topic."}],` + tools,
		`"input":[{"role":"user","content":"x"}],"tools":[{"type":"web_search"}]`,
		`"input":[{"role":"user","content":"x"}],"tool_choice":"none",` + tools,
	} {
		resp, err := http.Post(url+"/v1/responses", "application/json", strings.NewReader(`{"model":"mock-model",`+body+`,"nvext":{"annotations":["query_instance_id"]}}`))
		if err != nil {
			t.Fatal(err)
		}
		var dry struct {
			TokenIDs []uint32 `json:"token_ids"`
		}
		json.NewDecoder(resp.Body).Decode(&dry)
		resp.Body.Close()
		resp, err = http.Post(url+"/v1/responses", "application/json", strings.NewReader(`{"model":"mock-model","max_output_tokens":1,`+body+`}`))
		if err != nil {
			t.Fatal(err)
		}
		var answer struct {
			Usage struct {
				InputTokens int `json:"input_tokens"`
			} `json:"usage"`
		}
		json.NewDecoder(resp.Body).Decode(&answer)
		resp.Body.Close()
		if resp.StatusCode != 200 || len(dry.TokenIDs) == 0 || len(dry.TokenIDs) != answer.Usage.InputTokens {
			t.Errorf("%s:\n%d: kvproxy routed %d tokens, the engine computed %d", body, resp.StatusCode, len(dry.TokenIDs), answer.Usage.InputTokens)
		}
	}
	assertIdle(t, url)
}
