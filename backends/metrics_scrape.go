package backends

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// EngineMetrics is an engine's own view of its load, from its Prometheus
// /metrics page.
type EngineMetrics struct {
	Waiting int     // requests queued, not yet scheduled
	Running int     // requests in the running batch
	KVUsage float64 // fraction of KV cache blocks in use, 0..1
	// HasKVUsage is false when the engine exports no KV usage gauge.
	HasKVUsage bool
	// CacheBlocks is the engine's KV capacity in blocks of CacheBlockSize
	// tokens, from vLLM's cache_config_info (labels num_gpu_blocks and
	// block_size); 0 when not exported. With several series (one per
	// data-parallel engine) it is the largest, one engine's capacity.
	CacheBlocks, CacheBlockSize int
	// LoRA is vLLM's vllm:lora_requests_info (nil when not exported).
	LoRA *LoRAInfo
}

// LoRAInfo is what vLLM says of the LoRA adapters in its batch, from the
// latest series of vllm:lora_requests_info (its value is the time it was
// set; older label sets stay on the page).
type LoRAInfo struct {
	// MaxLoRAs is how many adapters one batch can hold (max_lora): a
	// request for another waits until one of them leaves the batch.
	MaxLoRAs int      `json:"max_lora"`
	Running  []string `json:"running"` // the adapters of running requests
	Waiting  []string `json:"waiting"` // the adapters of waiting requests
}

// Full reports whether the batch holds all the adapters it can and lora is
// not one of them: a request for lora waits there for a place.
func (l *LoRAInfo) Full(lora string) bool {
	return l != nil && l.MaxLoRAs > 0 && len(l.Running) >= l.MaxLoRAs && !slices.Contains(l.Running, lora)
}

// RankMetrics is one data-parallel engine's own metrics.
type RankMetrics struct {
	// Rank is the engine's data-parallel rank: vLLM labels every series of
	// an engine with its index (engine="r"); 0 for series without it.
	Rank int
	EngineMetrics
}

// Metric names read, per engine kind. Series of one name with different
// labels (one per data-parallel engine, per model) are summed for request
// counts and averaged for KV usage.
var (
	waitingNames = [][]byte{[]byte("vllm:num_requests_waiting"), []byte("sglang:num_queue_reqs")}
	runningNames = [][]byte{[]byte("vllm:num_requests_running"), []byte("sglang:num_running_reqs")}
	usageNames   = [][]byte{[]byte("vllm:kv_cache_usage_perc"), []byte("sglang:token_usage")}
	// vLLM before 0.10 named KV usage gpu_cache_usage_perc; read only if
	// the newer name is absent (some versions export both).
	usageOldName  = []byte("vllm:gpu_cache_usage_perc")
	cacheInfoName = []byte("vllm:cache_config_info")
	loraInfoName  = []byte("vllm:lora_requests_info")
)

// engineLabel names a vLLM series' data-parallel engine.
const engineLabel = "engine"

// ErrNoEngineMetrics: the page holds none of the load metrics kvproxy reads.
var ErrNoEngineMetrics = errors.New("no vLLM or SGLang load metrics on the page")

// ParseEngineMetrics reads vLLM's (vllm:num_requests_waiting,
// vllm:num_requests_running, vllm:kv_cache_usage_perc) or SGLang's
// (sglang:num_queue_reqs, sglang:num_running_reqs, sglang:token_usage) gauges
// from Prometheus text exposition format. Other lines, and lines that do not
// parse, are skipped. It does not allocate, but for the LoRA adapters vLLM
// lists (EngineMetrics.LoRA).
func ParseEngineMetrics(page []byte) (EngineMetrics, error) {
	m, _, err := parseEngineMetrics(page, nil, false)
	return m, err
}

// ParseEngineRanks is ParseEngineMetrics that also reads each data-parallel
// engine's own figures, appended to ranks[:0] by rank, one per engine the
// page has series of. It does not allocate when ranks has the room and the
// page names fewer than 16 engines.
func ParseEngineRanks(page []byte, ranks []RankMetrics) (EngineMetrics, []RankMetrics, error) {
	return parseEngineMetrics(page, ranks, true)
}

func parseEngineMetrics(page []byte, ranks []RankMetrics, perRank bool) (EngineMetrics, []RankMetrics, error) {
	var (
		total engineSums
		small [16]engineSums
		accs  = small[:0] // by rank
		lora  []byte      // the latest vllm:lora_requests_info line
		loraT float64
	)
	for len(page) > 0 {
		line := page
		if i := bytes.IndexByte(page, '\n'); i >= 0 {
			line, page = page[:i], page[i+1:]
		} else {
			page = nil
		}
		name, v, ok := parseSample(line)
		if ok && bytes.Equal(name, loraInfoName) {
			if lora == nil || v >= loraT {
				lora, loraT = line, v
			}
			continue
		}
		if !ok || !total.add(name, line, v) || !perRank {
			continue
		}
		r := labelInt(line, engineLabel)
		if r > MaxDPRank {
			continue
		}
		for len(accs) <= r {
			accs = append(accs, engineSums{})
		}
		accs[r].add(name, line, v)
	}
	if !total.loaded() {
		return EngineMetrics{}, ranks[:0], ErrNoEngineMetrics
	}
	ranks = ranks[:0]
	for r := range accs {
		if accs[r].loaded() {
			ranks = append(ranks, RankMetrics{Rank: r, EngineMetrics: accs[r].metrics()})
		}
	}
	m := total.metrics()
	if lora != nil {
		m.LoRA = &LoRAInfo{MaxLoRAs: labelInt(lora, "max_lora"), Running: labelList(lora, "running_lora_adapters"), Waiting: labelList(lora, "waiting_lora_adapters")}
	}
	return m, ranks, nil
}

// engineSums gathers the series of the metrics read, of one engine or all.
type engineSums struct {
	waiting, running, usage, oldUsage float64
	nWait, nRun, nUsage, nOld         int
	cacheBlocks, cacheBlockSize       int
}

// add counts the sample name = v (of the whole line) if it is one of the
// metrics read, and reports whether it was.
func (s *engineSums) add(name, line []byte, v float64) bool {
	switch {
	case bytes.Equal(name, cacheInfoName):
		if n := labelInt(line, "num_gpu_blocks"); n > s.cacheBlocks {
			s.cacheBlocks, s.cacheBlockSize = n, labelInt(line, "block_size")
		}
	case oneOf(name, waitingNames):
		s.waiting += v
		s.nWait++
	case oneOf(name, runningNames):
		s.running += v
		s.nRun++
	case oneOf(name, usageNames):
		s.usage += v
		s.nUsage++
	case bytes.Equal(name, usageOldName):
		s.oldUsage += v
		s.nOld++
	default:
		return false
	}
	return true
}

// loaded reports whether any load metric was counted (a capacity alone is
// not a load).
func (s *engineSums) loaded() bool { return s.nWait+s.nRun+s.nUsage+s.nOld > 0 }

func (s *engineSums) metrics() EngineMetrics {
	m := EngineMetrics{Waiting: clampCount(s.waiting), Running: clampCount(s.running),
		CacheBlocks: s.cacheBlocks, CacheBlockSize: s.cacheBlockSize}
	switch {
	case s.nUsage > 0:
		m.KVUsage, m.HasKVUsage = s.usage/float64(s.nUsage), true
	case s.nOld > 0:
		m.KVUsage, m.HasKVUsage = s.oldUsage/float64(s.nOld), true
	}
	m.KVUsage = max(0, min(1, m.KVUsage))
	return m
}

// labelList reads label key of a sample line as a comma-separated list
// (vLLM's adapter lists; no escapes in adapter names); nil if empty or absent.
func labelList(line []byte, key string) []string {
	val := labelValue(line, key)
	if len(val) == 0 {
		return nil
	}
	var out []string
	for _, s := range bytes.Split(val, []byte(",")) {
		if s = bytes.TrimSpace(s); len(s) > 0 {
			out = append(out, string(s))
		}
	}
	return out
}

// labelValue is the raw value of label key in a sample line, up to its
// closing quote; nil if absent.
func labelValue(line []byte, key string) []byte {
	open := bytes.IndexByte(line, '{')
	if open < 0 {
		return nil
	}
	labels := line[open:]
	for i := 0; ; {
		j := bytes.Index(labels[i:], []byte(key))
		if j < 0 {
			return nil
		}
		at := i + j
		i = at + len(key)
		if prev := labels[at-1]; (prev != '{' && prev != ',' && prev != ' ') || !bytes.HasPrefix(labels[i:], []byte(`="`)) {
			continue // a longer label name that ends in key
		}
		val := labels[i+2:]
		if k := bytes.IndexByte(val, '"'); k >= 0 {
			return val[:k]
		}
		return nil
	}
}

// labelInt reads the integer value of label key in a sample line
// (`name{a="1",key="42"} 1`); 0 if absent or not a positive integer.
func labelInt(line []byte, key string) int {
	open := bytes.IndexByte(line, '{')
	if open < 0 {
		return 0
	}
	labels := line[open:]
	for i := 0; ; {
		j := bytes.Index(labels[i:], []byte(key))
		if j < 0 {
			return 0
		}
		at := i + j
		i = at + len(key)
		prev := labels[at-1]
		if (prev != '{' && prev != ',' && prev != ' ') || !bytes.HasPrefix(labels[i:], []byte(`="`)) {
			continue // a longer label name that ends in key
		}
		n, k := 0, i+2
		for ; k < len(labels) && labels[k] >= '0' && labels[k] <= '9' && n < math.MaxInt32/10; k++ {
			n = n*10 + int(labels[k]-'0')
		}
		if k == i+2 || k >= len(labels) || labels[k] != '"' {
			return 0
		}
		return n
	}
}

func oneOf(name []byte, names [][]byte) bool {
	for _, n := range names {
		if bytes.Equal(name, n) {
			return true
		}
	}
	return false
}

func clampCount(v float64) int {
	if v < 0 || math.IsNaN(v) {
		return 0
	}
	if v > math.MaxInt32 {
		return math.MaxInt32
	}
	return int(v)
}

// parseSample splits `name{labels} value [timestamp]`. Label values may
// hold '}' or spaces inside quotes.
func parseSample(line []byte) (name []byte, v float64, ok bool) {
	line = bytes.TrimSpace(line)
	if len(line) == 0 || line[0] == '#' {
		return nil, 0, false
	}
	i := 0
	for i < len(line) && line[i] != '{' && line[i] != ' ' && line[i] != '\t' {
		i++
	}
	name, rest := line[:i], line[i:]
	if len(rest) > 0 && rest[0] == '{' {
		j, inQuote := 1, false
		for ; j < len(rest); j++ {
			c := rest[j]
			switch {
			case inQuote && c == '\\':
				j++
			case c == '"':
				inQuote = !inQuote
			case !inQuote && c == '}':
				goto closed
			}
		}
		return nil, 0, false
	closed:
		rest = rest[j+1:]
	}
	rest = bytes.TrimLeft(rest, " \t")
	if k := bytes.IndexAny(rest, " \t"); k >= 0 {
		rest = rest[:k] // drop the timestamp
	}
	f, err := strconv.ParseFloat(string(rest), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return nil, 0, false
	}
	return name, f, true
}

// MetricsScraper fetches engines' /metrics pages. One scraper serves every
// backend; it is safe for concurrent use and must not be copied after use.
type MetricsScraper struct {
	Client  *fasthttp.Client // nil: a private client
	Timeout time.Duration    // whole request, default 2s
	// MaxBodySize bounds a page, default 4 MiB.
	MaxBodySize int

	once     sync.Once
	own      *fasthttp.Client
	insecure *fasthttp.Client // for https engines whose certificate is not checked
}

// Scrape fetches url and parses it. A non-200 status, a timeout, a page over
// the size bound or a page without load metrics is an error; the caller marks
// the backend's scrape as failed.
// insecure skips the certificate check of an https engine.
func (s *MetricsScraper) Scrape(url string, insecure bool) (EngineMetrics, error) {
	m, _, err := s.scrape(url, insecure, nil, false)
	return m, err
}

// ScrapeRanks is Scrape that also gives each data-parallel engine's own
// metrics (ParseEngineRanks), appended to ranks[:0].
func (s *MetricsScraper) ScrapeRanks(url string, insecure bool, ranks []RankMetrics) (EngineMetrics, []RankMetrics, error) {
	return s.scrape(url, insecure, ranks, true)
}

func (s *MetricsScraper) scrape(url string, insecure bool, ranks []RankMetrics, perRank bool) (EngineMetrics, []RankMetrics, error) {
	c := s.client()
	if insecure {
		c = s.insecure
	}
	timeout := s.timeout()
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url)
	req.Header.SetMethod(fasthttp.MethodGet)
	if err := c.DoTimeout(req, resp, timeout); err != nil {
		return EngineMetrics{}, ranks[:0], fmt.Errorf("scrape %s: %w", url, err)
	}
	if sc := resp.StatusCode(); sc != fasthttp.StatusOK {
		return EngineMetrics{}, ranks[:0], fmt.Errorf("scrape %s: status %d", url, sc)
	}
	body := resp.Body()
	if len(body) > s.maxBody() {
		return EngineMetrics{}, ranks[:0], fmt.Errorf("scrape %s: page of %d bytes exceeds %d", url, len(body), s.maxBody())
	}
	m, ranks, err := parseEngineMetrics(body, ranks, perRank)
	if err != nil {
		return EngineMetrics{}, ranks, fmt.Errorf("scrape %s: %w", url, err)
	}
	return m, ranks, nil
}

func (s *MetricsScraper) timeout() time.Duration {
	if s.Timeout > 0 {
		return s.Timeout
	}
	return 2 * time.Second
}

func (s *MetricsScraper) maxBody() int {
	if s.MaxBodySize > 0 {
		return s.MaxBodySize
	}
	return 4 << 20
}

func (s *MetricsScraper) client() *fasthttp.Client {
	s.once.Do(func() {
		s.own, s.insecure = engineClients(func() *fasthttp.Client {
			return &fasthttp.Client{
				Name:                "kvproxy-scraper",
				MaxResponseBodySize: s.maxBody(),
				MaxIdleConnDuration: 3 * time.Second, // past kvproxy's 1 s scrape interval, and no longer: see NewProber
				WriteTimeout:        s.timeout(),     // bounds a TLS handshake too: see NewProber
			}
		})
	})
	if s.Client != nil {
		return s.Client
	}
	return s.own
}
