package e2e

import (
	"context"
	"strings"
	"testing"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/shared"
)

// An agent's conversation (tools, the assistant's tool calls, tool
// answers, text in parts and a photo as a data: URL) is routed on the
// prompt the engine computes: the dry run's prompt has as many tokens as
// the engine counted, and with KV events on, each turn finds the blocks
// the engine holds of the turn before, tools included.
func TestAgentConversationRoutesOnTheEnginesPrompt(t *testing.T) {
	es, _ := fleetWithEvents(t, 2, "-speedup", "50")
	url, _, _ := startProxyConfig(t, eventBackends(es, ""))
	c := client(url)
	ctx := context.Background()

	tools := []openai.ChatCompletionToolParam{{Function: shared.FunctionDefinitionParam{
		Name:        "get_weather",
		Description: openai.String("The weather in a city"),
		Parameters: shared.FunctionParameters{"type": "object",
			"properties": map[string]any{"city": map[string]any{"type": "string"}}, "required": []string{"city"}},
	}}}
	photo := "data:image/jpeg;base64," + strings.Repeat("/9j/4AAQSkZJRgABAQ", 25_000) // 450 KB
	msgs := []openai.ChatCompletionMessageParamUnion{
		openai.SystemMessage("You are a travel agent. " + strings.Repeat("Answer briefly and precisely. ", 20)),
		openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
			openai.TextContentPart("Where was this taken?"),
			openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: photo}),
			openai.TextContentPart("And what is the weather there?"),
		}),
	}
	type dryRun struct {
		WorkerID      string   `json:"worker_id"`
		OverlapBlocks int      `json:"overlap_blocks"`
		TokenIDs      []uint32 `json:"token_ids"`
	}
	turn := func(msgs []openai.ChatCompletionMessageParamUnion, tools []openai.ChatCompletionToolParam) (dryRun, openai.CompletionUsage) {
		t.Helper()
		var dry dryRun
		body := map[string]any{"model": "default", "messages": msgs,
			"nvext": map[string]any{"annotations": []string{"query_instance_id"}}}
		if tools != nil {
			body["tools"] = tools
		}
		if err := c.Post(ctx, "chat/completions", body, &dry); err != nil {
			t.Fatal(err)
		}
		res, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model: "default", Messages: msgs, Tools: tools, MaxTokens: openai.Int(4)})
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(dry.TokenIDs)) != res.Usage.PromptTokens {
			t.Fatalf("kvproxy routed a prompt of %d tokens, the engine computed %d", len(dry.TokenIDs), res.Usage.PromptTokens)
		}
		return dry, res.Usage
	}

	first, usage := turn(msgs, tools)
	if usage.PromptTokens > 2000 {
		t.Fatalf("the photo counted as prompt text: %d prompt tokens", usage.PromptTokens)
	}
	bare, _ := turn(msgs, nil)
	if len(bare.TokenIDs) >= len(first.TokenIDs) {
		t.Fatalf("the tools are not in the prompt: %d tokens with them, %d without", len(first.TokenIDs), len(bare.TokenIDs))
	}

	call := openai.ChatCompletionAssistantMessageParam{ToolCalls: []openai.ChatCompletionMessageToolCallParam{{
		ID: "call_1", Function: openai.ChatCompletionMessageToolCallFunctionParam{Name: "get_weather", Arguments: `{"city":"Lisbon"}`},
	}}}
	msgs = append(msgs, openai.ChatCompletionMessageParamUnion{OfAssistant: &call},
		openai.ToolMessage(`{"sky":"clear","celsius":21}`, "call_1"))
	second, usage := turn(msgs, tools)
	if second.OverlapBlocks < len(first.TokenIDs)/16-1 || usage.PromptTokensDetails.CachedTokens == 0 {
		t.Fatalf("the next turn matched %d blocks of the %d-token turn before (engine: %d cached tokens)",
			second.OverlapBlocks, len(first.TokenIDs), usage.PromptTokensDetails.CachedTokens)
	}
	t.Logf("turn 1: %d prompt tokens (%d without the tools); turn 2: %d tokens, %d blocks matched, engine cached %d",
		len(first.TokenIDs), len(bare.TokenIDs), usage.PromptTokens, second.OverlapBlocks, usage.PromptTokensDetails.CachedTokens)
	assertIdle(t, url)
}
