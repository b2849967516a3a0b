package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Replay modes: how prompts are sent.
const (
	// ModeCompletions sends token ids as the prompt of /v1/completions.
	ModeCompletions = "completions"
	// ModeChat sends text messages to /v1/chat/completions, one word per
	// synthesized token (a tokenizer may split a word into several tokens).
	ModeChat = "chat"
)

// ReplayConfig says where and how to send a workload.
type ReplayConfig struct {
	// URL is the proxy's base URL, e.g. http://127.0.0.1:8080.
	URL    string
	Model  string
	APIKey string
	Mode   string // ModeCompletions (default) or ModeChat
	// Words, in chat mode, are written one per synthesized token (token t
	// as Words[t % len(Words)], after a space): words the engine's
	// tokenizer reads as one token each (SingleTokenWords) keep prompts at
	// the trace's lengths. Empty: made-up words, which a tokenizer splits.
	Words []string
	// Concurrency > 0 runs closed-loop with that many requests in flight,
	// ignoring arrival times; 0 runs open-loop at the workload's arrival
	// times (scale them with Workload.Scale).
	Concurrency int
	Synth       Synth
	// Timeout bounds each request (default 10 minutes).
	Timeout time.Duration
	// Client is the HTTP client to use (default: one with keep-alive
	// connections sized for the load).
	Client *http.Client
	// OnRequest, if set, receives each request's record as it ends (one
	// call at a time, in completion order).
	OnRequest func(RequestRecord)
}

// workerHeader names the backend that served a request in kvproxy's answers.
const workerHeader = "x-kvproxy-worker"

// outcome is what one request measured.
type outcome struct {
	index            int
	worker           string
	start, end, ttft time.Duration
	itl              []time.Duration
	prompt, cached   int // cached < 0: no response reported it
	output           int
	chunks           int  // chunks that carried text
	first            bool // a first token came (ttft is set)
	cut              bool // cut off by the end of the run (ctx), not failed
	err              error
}

// Replay sends every request of w to the proxy and reports what the
// responses showed: TTFT, inter-chunk latency, end-to-end latency, output
// throughput, cached_tokens from usage, errors. The label names the run.
func Replay(ctx context.Context, w *Workload, cfg ReplayConfig, label string) (Result, error) {
	if cfg.URL == "" {
		return Result{}, errors.New("replay: no URL")
	}
	if cfg.Mode == "" {
		cfg.Mode = ModeCompletions
	}
	if cfg.Mode != ModeCompletions && cfg.Mode != ModeChat {
		return Result{}, fmt.Errorf("replay: unknown mode %q", cfg.Mode)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Minute
	}
	if cfg.Client == nil {
		conns := cfg.Concurrency
		if conns <= 0 {
			conns = 1024
		}
		cfg.Client = &http.Client{Transport: &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
			MaxIdleConns:        conns,
			MaxIdleConnsPerHost: conns,
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true,
		}}
	}
	endpoint := strings.TrimRight(cfg.URL, "/") + "/v1/completions"
	if cfg.Mode == ModeChat {
		endpoint = strings.TrimRight(cfg.URL, "/") + "/v1/chat/completions"
	}
	rp := &replayer{cfg: cfg, endpoint: endpoint, t0: time.Now()}

	var mu sync.Mutex
	var rec Recorder
	done := func(o outcome) {
		mu.Lock()
		defer mu.Unlock()
		if cfg.OnRequest != nil {
			r := &w.Requests[o.index]
			rr := RequestRecord{Index: o.index, Arrival: r.Arrival, Sent: o.start, Worker: o.worker,
				Prompt: o.prompt, Cached: o.cached, Output: o.output, TTFT: o.ttft}
			switch {
			case o.cut:
				rr.Err = "interrupted"
			case o.err != nil:
				rr.Err = o.err.Error()
			}
			cfg.OnRequest(rr)
		}
		if o.cut || o.err != nil {
			if o.cut {
				rec.Interrupted(o.start, o.end, o.chunks)
			} else {
				rec.Error(o.start, o.end, o.err.Error())
			}
			if o.first {
				rec.TTFT(o.ttft)
			}
			return
		}
		rec.Request(o.start, o.end, o.ttft, o.prompt, o.cached, o.output)
		for _, d := range o.itl {
			rec.ITL(d, 1)
		}
	}

	var wg sync.WaitGroup
	if cfg.Concurrency > 0 {
		next := make(chan int)
		for range cfg.Concurrency {
			wg.Go(func() {
				for i := range next {
					if ctx.Err() != nil {
						continue // handed over as the run ended: never sent
					}
					done(rp.send(ctx, i, &w.Requests[i]))
				}
			})
		}
	feed:
		for i := range w.Requests {
			select {
			case next <- i:
			case <-ctx.Done():
				break feed
			}
		}
		close(next)
	} else {
		timer := time.NewTimer(0)
		<-timer.C
	open:
		for i := range w.Requests {
			if wait := w.Requests[i].Arrival - time.Since(rp.t0); wait > 0 {
				timer.Reset(wait)
				select {
				case <-timer.C:
				case <-ctx.Done():
					break open
				}
			}
			if ctx.Err() != nil {
				break // interrupted: the rest were never sent
			}
			r := &w.Requests[i]
			wg.Go(func() { done(rp.send(ctx, i, r)) })
		}
	}
	wg.Wait()
	return rec.Result(label), ctx.Err()
}

type replayer struct {
	cfg      ReplayConfig
	endpoint string
	t0       time.Time
	bufs     sync.Pool
}

// send sends one request. When the run's ctx ends first, the request is
// cut off (o.cut), not failed; a request outliving the per-request timeout
// fails with a timeout.
func (rp *replayer) send(ctx context.Context, i int, r *Request) (o outcome) {
	o.index = i
	o.start = time.Since(rp.t0)
	reqCtx, cancel := context.WithTimeout(ctx, rp.cfg.Timeout)
	defer cancel()
	defer func() {
		o.end = time.Since(rp.t0)
		switch {
		case o.err == nil:
		case ctx.Err() != nil:
			o.err, o.cut = nil, true
		case reqCtx.Err() != nil:
			o.err = fmt.Errorf("timeout after %v", rp.cfg.Timeout)
		}
	}()
	bp, _ := rp.bufs.Get().(*[]byte)
	if bp == nil {
		bp = new([]byte)
	}
	defer rp.bufs.Put(bp)
	body := rp.body((*bp)[:0], r)
	*bp = body

	req, err := http.NewRequestWithContext(reqCtx, http.MethodPost, rp.endpoint, bytes.NewReader(body))
	if err != nil {
		o.err = err
		return o
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	if rp.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+rp.cfg.APIKey)
	}
	resp, err := rp.cfg.Client.Do(req)
	if err != nil {
		o.err = err
		return o
	}
	defer resp.Body.Close()
	o.worker = resp.Header.Get(workerHeader)
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		o.err = fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
		return o
	}
	o.prompt, o.cached = r.InputLen, -1
	o.itl = make([]time.Duration, 0, r.OutputLen)
	o.err = readStream(resp.Body, rp.t0, &o)
	return o
}

// sseChunk is the part of a streamed completion chunk the replay reads.
type sseChunk struct {
	Choices []struct {
		Text  string `json:"text"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// readStream reads an SSE completion stream to [DONE], timing the chunks
// that carry text.
func readStream(body io.Reader, t0 time.Time, o *outcome) error {
	br := bufio.NewReaderSize(body, 64<<10)
	var last time.Duration
	chunks := 0
	usage := false
	for {
		line, err := br.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			// An oversized line: keep reading it whole.
			rest, err2 := br.ReadBytes('\n')
			line, err = append(append([]byte(nil), line...), rest...), err2
		}
		now := time.Since(t0)
		line = bytes.TrimRight(line, "\r\n")
		if data, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			data = bytes.TrimSpace(data)
			if string(data) == "[DONE]" {
				if chunks == 0 && o.output == 0 {
					return errors.New("stream ended without output")
				}
				if !usage {
					o.output = chunks // a chunk a token, as engines stream them
				}
				return nil
			}
			text := false
			if bytes.Contains(data, []byte(`"usage"`)) || bytes.Contains(data, []byte(`"error"`)) {
				var c sseChunk
				if jerr := json.Unmarshal(data, &c); jerr != nil {
					return fmt.Errorf("bad SSE chunk: %w", jerr)
				}
				if c.Error != nil {
					return fmt.Errorf("stream error: %s", c.Error.Message)
				}
				for _, ch := range c.Choices {
					if ch.Text != "" || ch.Delta.Content != "" {
						text = true
					}
				}
				if u := c.Usage; u != nil {
					usage = true
					o.output = u.CompletionTokens
					if u.PromptTokens > 0 {
						o.prompt = u.PromptTokens
					}
					if u.PromptTokensDetails != nil {
						o.cached = u.PromptTokensDetails.CachedTokens
					}
				}
			} else {
				// Token chunks, the bulk of a stream, are only scanned.
				text = hasText(data)
			}
			if text {
				if chunks == 0 {
					o.ttft, o.first = now-o.start, true
				} else {
					o.itl = append(o.itl, now-last)
				}
				last = now
				chunks++
				o.chunks = chunks
			}
		}
		if err != nil {
			if err == io.EOF {
				return errors.New("stream ended before [DONE]")
			}
			return err
		}
	}
}

// hasText reports whether a completion chunk carries a non-empty "text" or
// "content" string (a chat chunk announcing the role only does not).
func hasText(data []byte) bool {
	for _, key := range [][]byte{[]byte(`"text":`), []byte(`"content":`)} {
		rest := data
		for {
			i := bytes.Index(rest, key)
			if i < 0 {
				break
			}
			rest = bytes.TrimLeft(rest[i+len(key):], " \t")
			if len(rest) >= 2 && rest[0] == '"' && rest[1] != '"' {
				return true
			}
		}
	}
	return false
}

// body appends the JSON request body for r to b.
func (rp *replayer) body(b []byte, r *Request) []byte {
	b = append(b, `{"model":`...)
	b = strconv.AppendQuote(b, rp.cfg.Model)
	b = append(b, `,"max_tokens":`...)
	b = strconv.AppendInt(b, int64(max(r.OutputLen, 1)), 10)
	b = append(b, `,"min_tokens":`...)
	b = strconv.AppendInt(b, int64(max(r.OutputLen, 1)), 10)
	b = append(b, `,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}`...)
	if rp.cfg.Mode == ModeChat {
		b = append(b, `,"messages":[`...)
		b = appendMessages(b, r, rp.cfg.Synth, rp.cfg.Words)
		b = append(b, `]}`...)
		return b
	}
	b = append(b, `,"prompt":[`...)
	var tok []uint32
	for i, seg := range r.Segments {
		tok = rp.cfg.Synth.Segment(tok[:0], seg)
		for j, t := range tok {
			if i > 0 || j > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendUint(b, uint64(t), 10)
		}
	}
	return append(b, `]}`...)
}

// appendMessages renders r's segments as chat messages: system, user and
// assistant segments of a conversation become their own messages; trace
// segments join into one user message.
func appendMessages(b []byte, r *Request, syn Synth, words []string) []byte {
	var tok []uint32
	role := ""
	open := false
	for _, seg := range r.Segments {
		rl := segmentRole(seg.Key)
		if rl != role || !open {
			if open {
				b = append(b, `"},`...)
			}
			b = append(b, `{"role":"`...)
			b = append(b, rl...)
			b = append(b, `","content":"`...)
			role, open = rl, true
		} else if len(words) == 0 {
			b = append(b, ' ')
		}
		tok = syn.Segment(tok[:0], seg)
		for j, t := range tok {
			if len(words) > 0 {
				b = append(b, ' ')
				b = append(b, words[int(t)%len(words)]...)
				continue
			}
			if j > 0 {
				b = append(b, ' ')
			}
			b = appendWord(b, t)
		}
	}
	if open {
		b = append(b, `"}`...)
	}
	return b
}

func segmentRole(key uint64) string {
	switch key &^ keyIDMask {
	case keySystem:
		return "system"
	case keyAssistant:
		return "assistant"
	}
	return "user"
}

var (
	consonants = "bdfghjklmnprstvz"
	vowels     = "aeiou"
)

// appendWord writes token t as a pronounceable lowercase word, one word per
// token id, so equal token prefixes give equal text prefixes.
func appendWord(b []byte, t uint32) []byte {
	for {
		b = append(b, consonants[t%16], vowels[(t/16)%5])
		t /= 80
		if t == 0 {
			return b
		}
	}
}
