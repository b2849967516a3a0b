package e2e

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
)

// Disaggregated prefill through real processes: kvproxy in front of two
// kvmock engines, one a prefill engine. A streamed chat through the OpenAI
// SDK is computed by the prefill engine and decoded by the other, which
// pulls every full block of the prompt rather than computing it.
func TestDisaggregatedPrefillThroughKVMock(t *testing.T) {
	engines := fleet(t, 2, "-speedup", "20")
	url, _, _ := startProxyConfig(t, "models:\n  - {name: mock-model, tokenizer: cl100k_base, template: chatml, block_size: 16}\n"+
		"backends:\n"+
		"  - {id: pre, url: 'http://"+engines[0]+"', model: mock-model, kind: vllm, role: prefill}\n"+
		"  - {id: dec, url: 'http://"+engines[1]+"', model: mock-model, kind: vllm}\n")
	c := client(url)
	var httpResp *http.Response
	stream := c.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model:         "mock-model",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage(strings.Repeat("Tell me about rivers and the sea. ", 60))},
		MaxTokens:     openai.Int(16),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	}, option.WithResponseInto(&httpResp), option.WithJSONSet("ignore_eos", true))
	var text strings.Builder
	var usage openai.CompletionUsage
	for stream.Next() {
		ch := stream.Current()
		if len(ch.Choices) > 0 {
			text.WriteString(ch.Choices[0].Delta.Content)
		}
		if ch.Usage.TotalTokens > 0 {
			usage = ch.Usage
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if httpResp.Header.Get("X-Kvproxy-Worker") != "dec" || httpResp.Header.Get("X-Kvproxy-Prefill-Worker") != "pre" {
		t.Fatalf("worker %q, prefill worker %q", httpResp.Header.Get("X-Kvproxy-Worker"), httpResp.Header.Get("X-Kvproxy-Prefill-Worker"))
	}
	p := usage.PromptTokens
	if text.Len() == 0 || usage.CompletionTokens != 16 || usage.PromptTokensDetails.CachedTokens != (p-1)/16*16 {
		t.Fatalf("answer %q, usage %+v: want 16 tokens decoded on a prompt pulled whole (%d cached)", text.String(), usage, (p-1)/16*16)
	}
}
