package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
)

// twoEngines runs two kvmock processes of one engine each behind kvproxy
// with limits.migration_limit 1, and returns the proxy's URL and process
// and the engine processes by backend id.
func twoEngines(t *testing.T, extra string) (string, *proc, map[string]*proc) {
	t.Helper()
	a, aProc := fleetProc(t, 1, "-speedup", "4")
	b, bProc := fleetProc(t, 1, "-speedup", "4")
	url, p, _ := startProxyConfig(t, backendsYAML(map[string]string{"mock-a": a[0], "mock-b": b[0]}, "limits: {migration_limit: 1}\n"+extra))
	return url, p, map[string]*proc{"mock-a": aProc, "mock-b": bProc}
}

// An engine killed mid-stream: the OpenAI SDK's stream goes on from the
// other engine, with all the tokens asked for, no error, and the usage of
// the client's request (the output moved into the continuation's prompt
// counted as output).
func TestStreamMigratesWhenItsEngineIsKilled(t *testing.T) {
	url, p, engines := twoEngines(t, "")
	c := client(url)
	ctx := context.Background()
	msgs := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be thorough."), openai.UserMessage("Describe every river you know.")}
	whole, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "default", Messages: msgs, MaxTokens: openai.Int(1)})
	if err != nil {
		t.Fatal(err)
	}

	const want = 300
	var httpResp *http.Response
	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model: "default", Messages: msgs, MaxTokens: openai.Int(want),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	}, option.WithJSONSet("ignore_eos", true), option.WithResponseInto(&httpResp))
	var text strings.Builder
	tokens, roles := 0, 0
	var usage openai.CompletionUsage
	killed := ""
	for stream.Next() {
		ch := stream.Current()
		if len(ch.Choices) > 0 {
			if ch.Choices[0].Delta.Role != "" {
				roles++
			}
			if d := ch.Choices[0].Delta.Content; d != "" {
				text.WriteString(d)
				tokens++
			}
		}
		if ch.Usage.TotalTokens > 0 {
			usage = ch.Usage
		}
		if tokens == 20 && killed == "" {
			killed = httpResp.Header.Get("X-Kvproxy-Worker")
			engines[killed].cmd.Process.Signal(syscall.SIGKILL)
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("the stream failed after its engine was killed: %v", err)
	}
	if tokens != want || roles != 1 {
		t.Fatalf("got %d tokens (want %d) and %d role chunks (want 1); text %q", tokens, want, roles, text.String())
	}
	if usage.CompletionTokens != want || usage.PromptTokens != whole.Usage.PromptTokens || usage.TotalTokens != want+whole.Usage.PromptTokens {
		t.Fatalf("usage %+v; want %d completion and %d prompt tokens", usage, want, whole.Usage.PromptTokens)
	}
	waitFor(t, 5*time.Second, "the access log line naming the migration", func() bool {
		return strings.Contains(p.String(), `"migrated_from":["`+killed+`"]`)
	})
	if !strings.Contains(p.String(), `"message":"stream migrated"`) {
		t.Fatalf("no migration warning in the log:\n%s", tail(p.String(), 2000))
	}
	if m := promValueOr0(t, url, `kvproxy_stream_migrations_total{backend="`+killed+`",result="ok"}`); m != 1 {
		t.Fatalf("kvproxy_stream_migrations_total ok = %v, want 1", m)
	}
	assertIdle(t, url)
}

// A completion stream (a text prompt) whose engine stops answering
// (SIGSTOP: its connections stay open and silent) is cut once the health
// probe fails, and continued on the other engine: the client gets every
// token and [DONE], no error.
func TestCompletionStreamMigratesFromAFrozenEngine(t *testing.T) {
	url, _, engines := twoEngines(t, "health: {interval: 200ms, timeout: 200ms, fall: 2}\n")
	body := `{"model":"default","stream":true,"max_tokens":300,"ignore_eos":true,"prompt":"Once upon a time, by the river,"}`
	resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, readAll(resp.Body))
	}
	frozen := engines[resp.Header.Get("X-Kvproxy-Worker")]
	br := bufio.NewReader(resp.Body)
	tokens, tail := 0, ""
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			break
		}
		tail += l
		var ch struct {
			Choices []struct{ Text string } `json:"choices"`
		}
		if data, ok := strings.CutPrefix(strings.TrimSpace(l), "data: "); ok && data != "[DONE]" {
			if err := json.Unmarshal([]byte(data), &ch); err != nil {
				t.Fatalf("bad chunk %q: %v", data, err)
			}
			if len(ch.Choices) == 1 && ch.Choices[0].Text != "" {
				if tokens++; tokens == 10 {
					frozen.cmd.Process.Signal(syscall.SIGSTOP)
					defer frozen.cmd.Process.Signal(syscall.SIGCONT)
				}
			}
		}
	}
	if strings.Contains(tail, `"error"`) || !strings.HasSuffix(tail, "data: [DONE]\n\n") || tokens != 300 {
		t.Fatalf("%d tokens (want 300), and the stream did not end cleanly:\n%s", tokens, tail[max(len(tail)-800, 0):])
	}
	assertIdle(t, url)
}
