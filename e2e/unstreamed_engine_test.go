package e2e

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/shared"
)

// unstreamingGateway stands in front of a real engine as a gateway without
// streaming does: a completion asked for as a stream goes to the engine
// unstreamed, and its whole JSON answer comes back (200,
// application/json); everything else passes as it is. It returns the
// gateway's address and a count of the answers it unstreamed.
func unstreamingGateway(t *testing.T, engine string) (string, *atomic.Int64) {
	t.Helper()
	target, _ := url.Parse("http://" + engine)
	pass := httputil.NewSingleHostReverseProxy(target)
	var unstreamed atomic.Int64
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || !strings.HasSuffix(r.URL.Path, "/completions") {
			pass.ServeHTTP(w, r)
			return
		}
		var req map[string]any
		body, _ := io.ReadAll(r.Body)
		if json.Unmarshal(body, &req) != nil || req["stream"] != true {
			r.Body = io.NopCloser(bytes.NewReader(body))
			pass.ServeHTTP(w, r)
			return
		}
		delete(req, "stream")
		delete(req, "stream_options")
		body, _ = json.Marshal(req)
		resp, err := http.Post("http://"+engine+r.URL.Path, "application/json", bytes.NewReader(body))
		if err != nil {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		unstreamed.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String(), &unstreamed
}

// Through the OpenAI SDK's streaming API, an engine that answers a stream
// with its whole answer as JSON gives the SDK a stream it accumulates as
// any other: a tool call whole, finish_reason, the usage it asked for;
// kvproxy meters that usage and frees the request's load. Before, the SDK
// got an error event and the engine was ejected.
func TestEngineWithoutStreamingThroughTheSDK(t *testing.T) {
	engines := fleet(t, 1, "-speedup", "50")
	gw, unstreamed := unstreamingGateway(t, engines[0])
	url, _, _ := startProxyConfig(t, "log_level: info\n"+backendsYAML(map[string]string{"gw": gw}, ""))
	c := client(url)
	params := openai.ChatCompletionNewParams{
		Model:         "default",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(travelSystem), openai.UserMessage("Is it warm in Lisbon?")},
		Tools:         []openai.ChatCompletionToolParam{{Function: shared.FunctionDefinitionParam{Name: "get_weather", Parameters: weatherSchema}}},
		ToolChoice:    openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String(string(openai.ChatCompletionToolChoiceOptionAutoRequired))},
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	}
	for round := range 2 {
		before := completionTokens(t, url)
		acc, httpResp := streamChat(t, c, params)
		if len(acc.Choices) != 1 || len(acc.Choices[0].Message.ToolCalls) != 1 || httpResp.Header.Get("Content-Type") != "text/event-stream" {
			t.Fatalf("round %d: streamed answer %+v", round, acc.ChatCompletion)
		}
		call := acc.Choices[0].Message.ToolCalls[0]
		if acc.Choices[0].FinishReason != "tool_calls" || call.Function.Name != "get_weather" || acc.Usage.CompletionTokens == 0 ||
			acc.Usage.PromptTokens == 0 {
			t.Fatalf("round %d: streamed answer %+v", round, acc.ChatCompletion)
		}
		checkWeatherArgs(t, call.Function.Arguments)
		assertSettled(t, url, before, acc.Usage.CompletionTokens)
	}
	if unstreamed.Load() != 2 {
		t.Fatalf("the gateway unstreamed %d answers, want 2", unstreamed.Load())
	}
	if rows := adminBackends(t, url); len(rows) != 1 || !rows[0].Healthy {
		t.Fatalf("the engine is not healthy after its answers: %+v", rows)
	}
}
