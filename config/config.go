package config

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nkeys"
	"gopkg.in/yaml.v3"

	"github.com/kvproxy/kvproxy/kv"
)

// Config is the whole file.
type Config struct {
	// discovering: expanded from discovery templates (Expand), which may
	// stand for no backend at all for a while.
	discovering bool
	// file is the tree of the file parsed, with its line numbers, for
	// Validate to name the line of each problem (nil if built in code).
	file *yaml.Node

	Listen string `yaml:"listen"`
	// AdminListen, when set, is a second listener for operators: /metrics,
	// /admin/* and /v1/kv_events are served there and no longer on Listen;
	// /live and /health on both. Its connections do not count against
	// limits.max_connections, so no flood of clients shuts probes out.
	AdminListen string    `yaml:"admin_listen"`
	TLS         TLS       `yaml:"tls"`
	LogLevel    string    `yaml:"log_level"`
	Models      []Model   `yaml:"models"`
	Backends    []Backend `yaml:"backends"`
	Router      Router    `yaml:"router"`
	Limits      Limits    `yaml:"limits"`
	Health      Health    `yaml:"health"`
	Auth        Auth      `yaml:"auth"`
	Tenants     []Tenant  `yaml:"tenants"`
	Replicas    Replicas  `yaml:"replicas"`
	CORS        CORS      `yaml:"cors"`
	// TrustedProxies are the addresses (IPs or CIDRs) of load balancers in
	// front of kvproxy: a request from one of them is logged with the
	// client address its X-Forwarded-For names.
	TrustedProxies []string `yaml:"trusted_proxies"`
}

// TrustedNets parses TrustedProxies (Validate has checked them).
func (c *Config) TrustedNets() []*net.IPNet {
	var nets []*net.IPNet
	for _, p := range c.TrustedProxies {
		if n := parseNet(p); n != nil {
			nets = append(nets, n)
		}
	}
	return nets
}

// parseNet reads a CIDR, or an IP as the network of that one address.
func parseNet(s string) *net.IPNet {
	if _, n, err := net.ParseCIDR(s); err == nil {
		return n
	}
	ip := net.ParseIP(s)
	if ip == nil {
		return nil
	}
	bits := 128
	if ip4 := ip.To4(); ip4 != nil {
		ip, bits = ip4, 32
	}
	return &net.IPNet{IP: ip, Mask: net.CIDRMask(bits, bits)}
}

// CORS lets web pages on other origins call kvproxy from a browser. Left
// out, every origin may (as vLLM and OpenAI's API allow): keys are sent as
// bearer tokens, never as cookies, so a page can only use a key it holds.
// An empty list turns CORS off.
type CORS struct {
	AllowedOrigins []string `yaml:"allowed_origins"` // "*", or origins such as https://app.example.com
}

// TLS makes kvproxy's listener serve HTTPS with a certificate and key in
// PEM files, read again on every reload (certificate rotation).
type TLS struct {
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
}

// Enabled reports whether the listener serves HTTPS.
func (t TLS) Enabled() bool { return t.CertFile != "" || t.KeyFile != "" }

// Load reads the certificate and key.
func (t TLS) Load() (*tls.Certificate, error) {
	c, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return nil, err
	}
	return &c, nil
}

// Replicas shares the load this kvproxy puts on the engines with the other
// replicas of one fleet over NATS, so they do not pile onto one engine.
// Without NATS set a replica routes on its own load alone.
type Replicas struct {
	NATS     string        `yaml:"nats"`     // nats://host:4222 (comma-separated for a cluster)
	Subject  string        `yaml:"subject"`  // default kvproxy.load; one per fleet
	ID       string        `yaml:"id"`       // default hostname-pid; unique per replica
	Interval time.Duration `yaml:"interval"` // how often each replica reports; default 100ms
	// CredsFile is a NATS user credentials file (its JWT and nkey seed),
	// for a server that authenticates so (Synadia Cloud, operator mode).
	// A user and password, or a token, go in the URL.
	CredsFile string `yaml:"creds_file"`
	// TLS verifies the NATS server by a private CA and presents a client
	// certificate to one that asks for it.
	TLS NATSTLS `yaml:"tls"`
}

// NATSTLS is the TLS of the connection to NATS. Any of it turns TLS on
// (tls:// does too, with the system's CAs).
type NATSTLS struct {
	CAFile   string `yaml:"ca_file"`   // PEM certificates of the CAs the server's certificate is verified by
	CertFile string `yaml:"cert_file"` // a client certificate, with key_file
	KeyFile  string `yaml:"key_file"`
}

// checkFiles adds what is wrong with the files the connection to NATS
// reads, which nats.go would report only when connecting, as a failure to
// connect retried forever.
func (r Replicas) checkFiles(add func(field, format string, a ...any)) {
	if f := r.CredsFile; f != "" {
		if b, err := os.ReadFile(f); err != nil {
			add("replicas.creds_file", "%s", err.Error())
		} else if err := checkCreds(b, time.Now()); err != nil {
			add("replicas.creds_file", "%s: %v", f, err)
		}
	}
	t := r.TLS
	if f := t.CAFile; f != "" {
		if b, err := os.ReadFile(f); err != nil {
			add("replicas.tls.ca_file", "%s", err.Error())
		} else if !x509.NewCertPool().AppendCertsFromPEM(b) {
			add("replicas.tls.ca_file", "no PEM certificate in %s", f)
		} else if last, ok := lastExpiry(b); ok && time.Now().After(last) {
			add("replicas.tls.ca_file", "%s: every certificate in it expired, the last at %s", f, last.UTC().Format(time.RFC3339))
		}
	}
	switch {
	case (t.CertFile == "") != (t.KeyFile == ""):
		add("replicas.tls", "cert_file and key_file go together")
	case t.CertFile != "":
		if pair, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile); err != nil {
			add("replicas.tls", "%s", strings.TrimPrefix(err.Error(), "tls: "))
		} else if leaf := pair.Leaf; leaf != nil && time.Now().After(leaf.NotAfter) {
			add("replicas.tls.cert_file", "%s: expired at %s", t.CertFile, leaf.NotAfter.UTC().Format(time.RFC3339))
		}
	}
}

// lastExpiry is when the last of the PEM certificates in b expires; ok is
// false when none parses.
func lastExpiry(b []byte) (last time.Time, ok bool) {
	for {
		var block *pem.Block
		if block, b = pem.Decode(b); block == nil {
			return last, ok
		}
		if c, err := x509.ParseCertificate(block.Bytes); err == nil && block.Type == "CERTIFICATE" {
			if !ok || c.NotAfter.After(last) {
				last, ok = c.NotAfter, true
			}
		}
	}
}

// checkCreds checks a NATS user credentials file as a server would: a
// user JWT, unexpired at now, and the nkey seed of its user.
func checkCreds(b []byte, now time.Time) error {
	const want = "not a NATS user credentials file (a user JWT and its nkey seed, as nsc writes them)"
	if !bytes.Contains(b, []byte("-----BEGIN")) {
		return errors.New(want) // nats.go would send the whole file as the JWT
	}
	token, err := nkeys.ParseDecoratedJWT(b)
	parts := strings.Split(token, ".")
	if err != nil || len(parts) != 3 {
		return errors.New(want)
	}
	var claims struct {
		Sub  string `json:"sub"`
		Exp  int64  `json:"exp"`
		Nbf  int64  `json:"nbf"`
		NATS struct {
			Bearer bool `json:"bearer_token"`
		} `json:"nats"`
	}
	if raw, err := base64.RawURLEncoding.DecodeString(parts[1]); err != nil || json.Unmarshal(raw, &claims) != nil {
		return errors.New(want + ": its JWT cannot be read")
	}
	kp, err := nkeys.ParseDecoratedUserNKey(b)
	if err != nil {
		return fmt.Errorf("%s: %v", want, err)
	}
	defer kp.Wipe()
	// A bearer token's seed signs nothing the server checks.
	if pub, err := kp.PublicKey(); !claims.NATS.Bearer && (err != nil || pub != claims.Sub) {
		return errors.New("its nkey seed is not its JWT's user's")
	}
	if claims.Exp != 0 && now.Unix() >= claims.Exp {
		return fmt.Errorf("its JWT expired at %s", time.Unix(claims.Exp, 0).UTC().Format(time.RFC3339))
	}
	if claims.Nbf != 0 && now.Unix() < claims.Nbf {
		return fmt.Errorf("its JWT is not valid until %s", time.Unix(claims.Nbf, 0).UTC().Format(time.RFC3339))
	}
	return nil
}

// Auth maps API keys to tenants. With no keys, every request is accepted as
// the anonymous tenant "".
type Auth struct {
	Keys []APIKey `yaml:"keys"`
	// AdminKeys guard /admin/* and /v1/kv_events. With none, those endpoints
	// are open only when Keys is empty too.
	AdminKeys []string `yaml:"admin_keys"`
	// MetricsKeys, when set, guard /metrics: it then takes one of them or
	// an admin key. With none, /metrics is open.
	MetricsKeys []string `yaml:"metrics_keys"`
	// CacheSaltSecret keys the HMAC that derives each tenant's cache_salt.
	CacheSaltSecret string `yaml:"cache_salt_secret"`
}

// APIKey is one client key.
type APIKey struct {
	Key    string `yaml:"key"`
	Tenant string `yaml:"tenant"`
}

// Tenant settings. A tenant named by a key but not listed here gets defaults.
type Tenant struct {
	Name string `yaml:"name"`
	// SharedCache opts the tenant into the shared cache namespace: its
	// prefixes are reused across tenants that also opt in.
	SharedCache       bool    `yaml:"shared_cache"`
	RequestsPerSecond float64 `yaml:"requests_per_second"`
	TokensPerMinute   float64 `yaml:"tokens_per_minute"`
	// MaxConcurrency caps the tenant's requests in flight (0: no cap).
	MaxConcurrency int `yaml:"max_concurrency"`
	// Priority, when set, is the tenant's requests' place in the queue
	// for a backend slot (vLLM's sense: lower comes first) and the most
	// urgent a request of it may ask for; unset, a request's own priority
	// (default 0) is taken as it is.
	Priority *int `yaml:"priority"`
	// Models, when set, are the only models (names or aliases of
	// models[]) the tenant may use, with their aliases and adapters; the
	// others do not exist for it. Unset: all.
	Models []string `yaml:"models"`
}

// Health configures active probes and passive ejection.
type Health struct {
	Interval time.Duration `yaml:"interval"`
	Timeout  time.Duration `yaml:"timeout"`
	Rise     int           `yaml:"rise"`
	Fall     int           `yaml:"fall"`
	// EjectBase is the first passive ejection; each consecutive one doubles
	// it up to EjectMax.
	EjectBase time.Duration `yaml:"eject_base"`
	EjectMax  time.Duration `yaml:"eject_max"`
	// ForgetAfter drops the index entries of a backend unhealthy this long.
	ForgetAfter time.Duration `yaml:"forget_after"`
}

// Model is one served model: how its prompts are tokenized and hashed.
type Model struct {
	Name    string   `yaml:"name"`
	Aliases []string `yaml:"aliases"`
	// Adapters are the LoRA adapters every backend of the model serves, by
	// the names requests give them (vLLM's --lora-modules NAME=PATH). A
	// request for one is routed among the model's backends, forwarded
	// with the adapter's name, and its blocks are cached apart from the
	// base model's, as the engine caches them.
	Adapters []string `yaml:"adapters"`
	// Tokenizer is cl100k_base, o200k_base, a path to a Hugging Face
	// tokenizer.json (or a model directory holding one), or "engine": ask
	// the backend's own /tokenize endpoint.
	Tokenizer string `yaml:"tokenizer"`
	// Template renders chat messages: chatml, llama3, raw, or a path to the
	// model's tokenizer_config.json (its chat_template).
	Template  string `yaml:"template"`
	BlockSize int    `yaml:"block_size"`
	// BytesPerBlock is the KV size of one block, for tier fetch costs.
	BytesPerBlock int64 `yaml:"bytes_per_block"`
	// TokenizerCacheMB bounds the tokens kept of rendered messages, so that
	// a conversation's earlier turns are not tokenized again (ids and the
	// text they are compared by). The heap it takes can reach about twice
	// this between garbage collections. Default DefaultTokenizerCacheMB.
	TokenizerCacheMB int `yaml:"tokenizer_cache_mb"`
}

// MaxRequestBodyLimit bounds limits.max_request_body_bytes.
const MaxRequestBodyLimit = 1 << 40

// DefaultTokenizerCacheMB is models[].tokenizer_cache_mb when not set.
const DefaultTokenizerCacheMB = 128

// Backend kinds.
const (
	KindVLLM   = "vllm"
	KindSGLang = "sglang"
	KindOpenAI = "openai"
	KindMock   = "mock"
)

// Backend roles (disaggregated prefill).
const (
	RoleBoth    = "both"
	RolePrefill = "prefill"
)

// Backend is one engine.
type Backend struct {
	ID    string `yaml:"id"`
	URL   string `yaml:"url"`
	Model string `yaml:"model"`
	Kind  string `yaml:"kind"`
	// ServedModel is the model name the engine expects; default the model's name.
	ServedModel string `yaml:"served_model"`
	// APIKey is sent to the engine as a bearer token (never the client's).
	APIKey string `yaml:"api_key"`
	// InsecureSkipVerify accepts any certificate from an https engine
	// (testing only: anyone on the path can then read the traffic).
	InsecureSkipVerify bool `yaml:"insecure_skip_verify"`
	// MaxConcurrency caps requests in flight on this engine (0: no cap).
	MaxConcurrency int `yaml:"max_concurrency"`
	// Role is RolePrefill for an engine that only computes prompts for
	// others to decode (disaggregated prefill); "" or RoleBoth for one
	// that serves whole requests, and decodes prompts a prefill engine
	// computed.
	Role string `yaml:"role"`
	// PriorityScheduling: the engine orders its queue by the requests'
	// priority (vLLM --scheduling-policy priority). The requests of a
	// tenant with a priority are sent it; others' go as they came.
	PriorityScheduling bool `yaml:"priority_scheduling"`
	// ForceIncludeUsage: the engine sends every stream's usage chunk
	// unasked (vLLM --enable-force-include-usage, SGLang
	// --stream-response-default-include-usage). Its clients get the chunk
	// as it comes; kvproxy asks such an engine for nothing.
	ForceIncludeUsage bool `yaml:"force_include_usage"`
	// KVEvents says how kvproxy learns what the engine caches.
	KVEvents KVEvents `yaml:"kv_events"`
	// Mock configures the simulated engine kvproxy starts for kind: mock.
	Mock MockEngine `yaml:"mock"`
	// Discover DiscoverDNS makes this entry a template (see Expand): one
	// backend per address its url's host resolves to, resolved again
	// every DiscoverInterval.
	Discover         string        `yaml:"discover"`
	DiscoverInterval time.Duration `yaml:"discover_interval"`
}

// DiscoverDNS is backends[].discover for a url whose host names the
// engines' addresses (a Kubernetes headless service).
const DiscoverDNS = "dns"

// KV event modes.
const (
	EventsNone = "none" // approximate: the router records its own decisions
	EventsZMQ  = "zmq"  // vLLM/SGLang ZMQ publisher
	EventsHTTP = "http" // pushed to POST /v1/kv_events
)

// KVEvents configures a backend's cache event feed.
type KVEvents struct {
	Mode     string `yaml:"mode"`
	Endpoint string `yaml:"endpoint"` // zmq: publisher, e.g. tcp://10.0.0.11:5557
	Replay   string `yaml:"replay"`   // zmq: replay ROUTER endpoint (optional)
	Topic    string `yaml:"topic"`    // zmq: topic filter ("" = all)
	// DPSize is the engine's data-parallel size: rank r publishes on the
	// endpoints' port + r, as vLLM does. 0 or 1: one rank.
	DPSize int `yaml:"dp_size"`
}

// MockEngine settings for a kind: mock backend, started in-process on the
// backend URL's loopback address.
type MockEngine struct {
	CacheBlocks         int     `yaml:"cache_blocks"`
	HostCacheBlocks     int     `yaml:"host_cache_blocks"`
	MaxNumSeqs          int     `yaml:"max_num_seqs"`
	MaxNumBatchedTokens int     `yaml:"max_num_batched_tokens"`
	Speedup             float64 `yaml:"speedup"`
	Seed                int64   `yaml:"seed"`
	MaxLoRAs            int     `yaml:"max_loras"` // adapters a batch may hold (vLLM --max-loras; default 1)
	// DuplicateBlocks keeps and reports every copy of a block, as vLLM does.
	DuplicateBlocks bool `yaml:"duplicate_blocks"`
}

// Router settings.
type Router struct {
	Policy         string        `yaml:"policy"`
	Temperature    float64       `yaml:"temperature"`
	IndexTTL       time.Duration `yaml:"index_ttl"`
	MaxIndexBlocks int           `yaml:"max_index_blocks"`
	Seed           int64         `yaml:"seed"`
	Cost           Cost          `yaml:"cost"`
	// OverlapWeight is kv_dynamo's weight of prefill blocks.
	OverlapWeight float64 `yaml:"overlap_weight"`
	// FetchUsPerMB is the time to bring a cached block up from a lower tier,
	// per MB of KV (a block is the model's bytes_per_block).
	FetchUsPerMB FetchCost `yaml:"fetch_us_per_mb"`
	// Calibrate refits the kv policy's coefficients per backend from
	// observed TTFTs (default true).
	Calibrate *bool `yaml:"calibrate"`
}

// FetchCost is a per-tier transfer time in µs per MB.
type FetchCost struct {
	Host   float64 `yaml:"host"`
	Disk   float64 `yaml:"disk"`
	Shared float64 `yaml:"shared"`
}

// Cost holds the kv policy's coefficients; zero means the router's default.
type Cost struct {
	PrefillMsPerToken float64 `yaml:"prefill_ms_per_token"`
	QueueMsPerToken   float64 `yaml:"queue_ms_per_token"`
	DecodeMsPerBlock  float64 `yaml:"decode_ms_per_block"`
}

// Limits protect the proxy from bad or huge input.
type Limits struct {
	MaxRequestBodyBytes int           `yaml:"max_request_body_bytes"`
	MaxHeaderBytes      int           `yaml:"max_header_bytes"`
	HeaderTimeout       time.Duration `yaml:"header_timeout"` // slowloris guard
	BodyTimeout         time.Duration `yaml:"body_timeout"`
	MaxMessages         int           `yaml:"max_messages"`
	MaxPromptTokens     int           `yaml:"max_prompt_tokens"`
	StreamIdleTimeout   time.Duration `yaml:"stream_idle_timeout"`
	UpstreamConnectTime time.Duration `yaml:"upstream_connect_timeout"`
	MaxConnsPerBackend  int           `yaml:"max_conns_per_backend"`
	// QueueTimeout bounds how long a request waits for a backend below its
	// max_concurrency; MaxQueue bounds how many wait.
	QueueTimeout time.Duration `yaml:"queue_timeout"`
	MaxQueue     int           `yaml:"max_queue"`
	// RetryBudget is the share of requests that may be retries (0..1).
	RetryBudget float64 `yaml:"retry_budget"`
	// DrainTimeout is how long SIGTERM and reloads wait for streams.
	DrainTimeout time.Duration `yaml:"drain_timeout"`
	// MigrationLimit is how many times a stream whose engine fails
	// mid-answer may be continued on another engine (0: never).
	MigrationLimit int `yaml:"migration_limit"`
	// MaxConnections caps the client connections open at once: more are
	// answered 503 and closed. 0: derived from the open files limit at
	// start (the proxy does it: the limit is the process's).
	MaxConnections int `yaml:"max_connections"`
	// IdleTimeout closes a client's keep-alive connection idle this long.
	IdleTimeout time.Duration `yaml:"idle_timeout"`
	// BodyMemoryMB bounds the memory held at once in bodies over 1 MiB:
	// request bodies, and engine answers read whole.
	BodyMemoryMB int `yaml:"body_memory_mb"`
}

// DefaultBodyMemoryMB is limits.body_memory_mb's default without a memory
// limit: 16 answers of the largest kvproxy reads whole.
const DefaultBodyMemoryMB = 1024

// MemoryLimit is the Go memory limit kvproxy runs under, in bytes (0:
// none): 90% of a container's, or GOMEMLIMIT. main sets it before any
// configuration is read. limits.body_memory_mb's default is then a quarter
// of it, up to DefaultBodyMemoryMB: kvproxy's RSS peaks near three times
// what the budget holds (BENCHMARKS.md), and 1024 in a 2 GiB container
// left it to the kernel's OOM killer.
var MemoryLimit int64

// defaultBodyMemoryMB is limits.body_memory_mb's default under
// MemoryLimit.
func defaultBodyMemoryMB() int {
	if MemoryLimit <= 0 {
		return DefaultBodyMemoryMB
	}
	return int(max(16, min(DefaultBodyMemoryMB, MemoryLimit>>20/4)))
}

// Policies the router knows; validated here so a typo fails at start.
var Policies = []string{"kv", "kv_dynamo", "round_robin", "least_load", "prefix_hash", "cache_aware"}

// Tokenizers and templates known to this build.
var (
	Tokenizers = []string{"cl100k_base", "o200k_base"}
	Templates  = []string{"chatml", "llama3", "raw"}
)

// Load reads, expands, parses, defaults and validates a config file.
func Load(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	c, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}

// Parse is Load without the file.
func Parse(b []byte) (*Config, error) {
	expanded, file, err := expandScalars(b)
	if err != nil {
		return nil, err
	}
	// Defaults where an explicit 0 means something are set before decoding,
	// so only an absent field gets them; the rest are filled after.
	c := Config{
		Limits: Limits{RetryBudget: 0.2, MaxQueue: 1024, DrainTimeout: 30 * time.Second},
		Health: Health{ForgetAfter: time.Minute},
	}
	dec := yaml.NewDecoder(bytes.NewReader(expanded))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, errors.New("empty config")
		}
		return nil, nameFields(expanded, file, err)
	}
	if err := wholeNumbers(file); err != nil {
		return nil, err
	}
	c.file = file
	c.applyDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// expandScalars expands ${ENV} references in YAML values only (never in
// comments or keys) and returns the document re-encoded, and its tree. The
// tree has the lines of b: the re-encoded document's differ (blank lines
// dropped, a value expanded to several lines).
func expandScalars(b []byte) ([]byte, *yaml.Node, error) {
	var root yaml.Node
	if err := yaml.Unmarshal(b, &root); err != nil {
		return nil, nil, err
	}
	if len(root.Content) == 0 {
		return nil, nil, errors.New("empty config")
	}
	if err := duplicateKey(&root, ""); err != nil {
		return nil, nil, err
	}
	var firstErr error
	var walk func(n *yaml.Node)
	walk = func(n *yaml.Node) {
		if n.Kind == yaml.MappingNode || n.Kind == yaml.SequenceNode {
			// Block style: each key of the re-encoded document on a line of
			// its own, which is how nameFields tells one field from the
			// next (`{idle_timeout: abc, body_memory_mb: 3}` was one line,
			// and its error named the last field).
			n.Style &^= yaml.FlowStyle
		}
		if n.Kind == yaml.ScalarNode && strings.Contains(n.Value, "${") {
			v, err := ExpandEnv([]byte(n.Value), os.LookupEnv)
			if err != nil && firstErr == nil {
				firstErr = fmt.Errorf("line %d: %w", n.Line, err)
			}
			n.Value = string(v)
			if n.Tag == "!!str" && n.Style == 0 {
				n.Tag = "" // let the expanded text resolve to its natural type
			}
		}
		for i, c := range n.Content {
			if n.Kind == yaml.MappingNode && i%2 == 0 {
				continue // keys are not expanded
			}
			walk(c)
		}
	}
	walk(&root)
	if firstErr != nil {
		return nil, nil, firstErr
	}
	out, err := yaml.Marshal(&root)
	return out, &root, err
}

// duplicateKey names a key a mapping of the file's tree n has twice, with
// both its lines. Found by the decoder instead, it was named at the first
// and its lines were those of the re-encoded document (the twenty-ninth
// session's trial: "limits (line 71): mapping key "limits" already
// defined at line 89", in a file of 76 lines).
func duplicateKey(n *yaml.Node, path string) error {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			if err := duplicateKey(c, path); err != nil {
				return err
			}
		}
	case yaml.MappingNode:
		seen := map[string]*yaml.Node{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i]
			p := k.Value
			if path != "" {
				p = path + "." + p
			}
			if first, ok := seen[k.Value]; ok && k.Value != "<<" {
				return fmt.Errorf("%s (line %d): defined again, first at line %d", p, k.Line, first.Line)
			}
			seen[k.Value] = k
			if err := duplicateKey(n.Content[i+1], p); err != nil {
				return err
			}
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			if err := duplicateKey(c, fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	}
	return nil
}

var (
	lineRef = regexp.MustCompile(`line (\d+): `)
	goType  = regexp.MustCompile(`field (\S+) not found in type \S+`)
	// Go's names of the config's types, in yaml's messages: "into
	// []config.Model" (models written as a mapping: the trial).
	goList   = regexp.MustCompile(`into \[\]\*?config\.\w+`)
	goStruct = regexp.MustCompile(`into \*?config\.\w+`)
)

// nameFields rewrites yaml's "line N: ..." messages about src (the
// re-encoded document) to name the field at that line, and its line in the
// file (whose tree is file), so a bad value reads "router.index_ttl (line
// 7): cannot unmarshal ...".
func nameFields(src []byte, file *yaml.Node, err error) error {
	msg := strings.ReplaceAll(err.Error(), "yaml: unmarshal errors:\n  ", "")
	msg = goType.ReplaceAllString(msg, "unknown field $1")
	msg = goList.ReplaceAllString(msg, "into a list")
	msg = goStruct.ReplaceAllString(msg, "into a mapping")
	msg = strings.ReplaceAll(msg, "time.Duration", "a duration (like 30s)")
	msg = strings.ReplaceAll(msg, "\n  ", "; ")
	var root yaml.Node
	if yaml.Unmarshal(src, &root) != nil {
		return errors.New(msg)
	}
	paths := map[int]string{}
	var walk func(n *yaml.Node, path string)
	walk = func(n *yaml.Node, path string) {
		switch n.Kind {
		case yaml.DocumentNode:
			for _, c := range n.Content {
				walk(c, path)
			}
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				p := n.Content[i].Value
				if path != "" {
					p = path + "." + p
				}
				paths[n.Content[i].Line] = p
				walk(n.Content[i+1], p)
			}
		case yaml.SequenceNode:
			for i, c := range n.Content {
				p := fmt.Sprintf("%s[%d]", path, i)
				if _, ok := paths[c.Line]; !ok {
					paths[c.Line] = p
				}
				walk(c, p)
			}
		}
	}
	walk(&root, "")
	msg = lineRef.ReplaceAllStringFunc(msg, func(m string) string {
		var line int
		fmt.Sscanf(m, "line %d: ", &line)
		if p, ok := paths[line]; ok {
			if l, _ := fieldAt(file, p); l > 0 {
				return fmt.Sprintf("%s (line %d): ", p, l)
			}
			return p + ": "
		}
		return "" // a line of src, not of the file
	})
	return errors.New(msg)
}

// Where is field, a path as Validate names it (models[0].tokenizer),
// with its line in the file when the config came from one: for errors
// found past Validate, as a tokenizer file that does not parse.
func (c *Config) Where(field string) string {
	if line, _ := fieldAt(c.file, field); line > 0 {
		return fmt.Sprintf("%s (line %d)", field, line)
	}
	return field
}

// fieldAt follows field, a path as Validate names it (backends[3].role),
// in the file whose tree is n, as far as the file has it. line is that of
// the last step found: the field's key, or if the file leaves it out, the
// nearest entry that encloses it (0: none; no file, or a top-level field
// left out). node is the field's value if the file has it.
func fieldAt(n *yaml.Node, field string) (line int, node *yaml.Node) {
	for _, step := range strings.FieldsFunc(field, func(r rune) bool { return r == '.' || r == '[' || r == ']' }) {
		n = resolved(n)
		var at *yaml.Node // the step's key, or its item
		switch {
		case n == nil:
		case n.Kind == yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == step {
					at, n = n.Content[i], n.Content[i+1]
					break
				}
			}
		case n.Kind == yaml.SequenceNode:
			if i, err := strconv.Atoi(step); err == nil && i >= 0 && i < len(n.Content) {
				at, n = n.Content[i], n.Content[i]
			}
		}
		if at == nil {
			return line, nil
		}
		line = at.Line
	}
	return line, n
}

// resolved is the node a document or an alias stands for.
func resolved(n *yaml.Node) *yaml.Node {
	for n != nil && (n.Kind == yaml.DocumentNode || n.Kind == yaml.AliasNode) {
		if n.Kind == yaml.AliasNode {
			n = n.Alias
		} else if len(n.Content) > 0 {
			n = n.Content[0]
		} else {
			n = nil
		}
	}
	return n
}

var envRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}`)

// ExpandEnv replaces ${NAME} and ${NAME:-default}. An unset variable without
// a default is an error naming it; $$ is not special.
func ExpandEnv(b []byte, lookup func(string) (string, bool)) ([]byte, error) {
	var missing []string
	out := envRef.ReplaceAllFunc(b, func(m []byte) []byte {
		sub := envRef.FindSubmatch(m)
		name := string(sub[1])
		if v, ok := lookup(name); ok {
			return []byte(v)
		}
		if sub[2] != nil {
			return sub[3]
		}
		missing = append(missing, name)
		return m
	})
	if len(missing) > 0 {
		return nil, fmt.Errorf("environment variable %s is not set (use ${%s:-default} for a default)", strings.Join(missing, ", "), missing[0])
	}
	return out, nil
}

// homePath is p with a leading ~/ made the home directory, as a shell
// would (and nats.go does to a credentials file, which -check reads first).
func homePath(p string) string {
	if rest, ok := strings.CutPrefix(p, "~/"); ok {
		if home, err := os.UserHomeDir(); err == nil {
			return filepath.Join(home, rest)
		}
	}
	return p
}

func (c *Config) applyDefaults() {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:8080"
	}
	if c.CORS.AllowedOrigins == nil {
		c.CORS.AllowedOrigins = []string{"*"}
	}
	if c.LogLevel == "" {
		c.LogLevel = "info"
	}
	for _, p := range []*string{&c.TLS.CertFile, &c.TLS.KeyFile, &c.Replicas.CredsFile,
		&c.Replicas.TLS.CAFile, &c.Replicas.TLS.CertFile, &c.Replicas.TLS.KeyFile} {
		*p = homePath(*p)
	}
	for i := range c.Models {
		m := &c.Models[i]
		m.Tokenizer, m.Template = homePath(m.Tokenizer), homePath(m.Template)
		if m.Tokenizer == "" {
			m.Tokenizer = "cl100k_base"
		}
		if m.Template == "" {
			m.Template = "chatml"
		}
		if m.BlockSize == 0 {
			m.BlockSize = kv.DefaultBlockSize
		}
		if m.BytesPerBlock == 0 && m.BlockSize > 0 { // a bad block_size is its own error, not this field's too
			// Llama-3.1-8B: 32 layers × 8 KV heads × 128 dims × 2 (K,V) × 2 bytes = 128 KiB/token.
			m.BytesPerBlock = int64(m.BlockSize) * 128 << 10
		}
		if m.TokenizerCacheMB == 0 {
			m.TokenizerCacheMB = DefaultTokenizerCacheMB
		}
	}
	for i := range c.Backends {
		b := &c.Backends[i]
		if b.Kind == "" {
			b.Kind = KindVLLM
		}
		if b.Model == "" && len(c.Models) == 1 {
			b.Model = c.Models[0].Name
		}
		if b.ServedModel == "" {
			b.ServedModel = b.Model
		}
	}
	if c.Router.Policy == "" {
		c.Router.Policy = "kv"
	}
	if c.Router.FetchUsPerMB.Host == 0 {
		c.Router.FetchUsPerMB.Host = 55
	}
	if c.Router.FetchUsPerMB.Disk == 0 {
		c.Router.FetchUsPerMB.Disk = 280
	}
	if c.Router.FetchUsPerMB.Shared == 0 {
		c.Router.FetchUsPerMB.Shared = 1800
	}
	if c.Router.IndexTTL == 0 {
		c.Router.IndexTTL = 120 * time.Second
	}
	if c.Limits.MaxRequestBodyBytes == 0 {
		c.Limits.MaxRequestBodyBytes = 32 << 20
	}
	if c.Limits.StreamIdleTimeout == 0 {
		c.Limits.StreamIdleTimeout = 5 * time.Minute
	}
	if c.Limits.UpstreamConnectTime == 0 {
		c.Limits.UpstreamConnectTime = 3 * time.Second
	}
	if c.Limits.MaxConnsPerBackend == 0 {
		c.Limits.MaxConnsPerBackend = 4096
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	defInt := func(d *int, v int) {
		if *d == 0 {
			*d = v
		}
	}
	defInt(&c.Limits.MaxHeaderBytes, 16<<10)
	defInt(&c.Limits.BodyMemoryMB, defaultBodyMemoryMB())
	def(&c.Limits.HeaderTimeout, 10*time.Second)
	def(&c.Limits.BodyTimeout, 60*time.Second)
	defInt(&c.Limits.MaxMessages, 4096)
	defInt(&c.Limits.MaxPromptTokens, 1<<20)
	def(&c.Limits.QueueTimeout, 10*time.Second)
	def(&c.Limits.IdleTimeout, 120*time.Second)
	def(&c.Health.Interval, 2*time.Second)
	def(&c.Health.Timeout, time.Second)
	defInt(&c.Health.Rise, 1)
	defInt(&c.Health.Fall, 2)
	def(&c.Health.EjectBase, time.Second)
	def(&c.Health.EjectMax, time.Minute)
	for i := range c.Backends {
		if c.Backends[i].KVEvents.Mode == "" {
			c.Backends[i].KVEvents.Mode = EventsNone
		}
		if c.Backends[i].Discover != "" {
			def(&c.Backends[i].DiscoverInterval, 10*time.Second)
		}
	}
}

// validListen reports whether addr is a listener's host:port, the port a
// number (0: any free one; an empty port would be that too, unsaid).
func validListen(addr string) bool {
	_, port, err := net.SplitHostPort(addr)
	if err != nil || port == "" || strings.Trim(port, "0123456789") != "" {
		return false
	}
	n, err := strconv.Atoi(port)
	return err == nil && n <= 65535
}

// sameListen reports whether listeners on a and b (both valid) would take
// the same port: the same one, not 0, on the same host or a wildcard one
// (which takes it on every address).
func sameListen(a, b string) bool {
	ha, sa, _ := net.SplitHostPort(a)
	hb, sb, _ := net.SplitHostPort(b)
	pa, _ := strconv.Atoi(sa)
	pb, _ := strconv.Atoi(sb)
	if pa != pb || pa == 0 {
		return false
	}
	host := func(h string) string {
		switch h {
		case "", "0.0.0.0", "::":
			return "*"
		case "localhost":
			return "127.0.0.1"
		}
		return h
	}
	ha, hb = host(ha), host(hb)
	return ha == hb || ha == "*" || hb == "*"
}

// Validate checks every field and reports all problems at once.
func (c *Config) Validate() error {
	var errs []string
	add := func(field, format string, a ...any) {
		msg := field + ": " + fmt.Sprintf(format, a...)
		if line, _ := fieldAt(c.file, field); line > 0 {
			msg += fmt.Sprintf(" (line %d)", line)
		}
		errs = append(errs, msg)
	}
	if !validListen(c.Listen) {
		add("listen", "want host:port, got %q", c.Listen)
	}
	if c.AdminListen != "" {
		if !validListen(c.AdminListen) {
			add("admin_listen", "want host:port, got %q", c.AdminListen)
		} else if sameListen(c.AdminListen, c.Listen) {
			add("admin_listen", "%q takes listen's port (%q): give the operators' listener a port of its own", c.AdminListen, c.Listen)
		}
	}
	if c.TLS.Enabled() {
		if c.TLS.CertFile == "" || c.TLS.KeyFile == "" {
			add("tls", "cert_file and key_file go together")
		} else if c.discovering {
			// An expansion's files were read with its templates: a change
			// of the engines found must not depend on them.
		} else if _, err := c.TLS.Load(); err != nil {
			add("tls", "%s", strings.TrimPrefix(err.Error(), "tls: "))
		}
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		add("log_level", "want debug, info, warn or error, got %q", c.LogLevel)
	}
	if len(c.Models) == 0 {
		add("models", "at least one model is required")
	}
	names := map[string]string{}
	for i, m := range c.Models {
		f := fmt.Sprintf("models[%d]", i)
		if m.Name == "" {
			add(f+".name", "required")
		}
		for j, n := range slices.Concat([]string{m.Name}, m.Aliases, m.Adapters) {
			field := f
			switch {
			case j > len(m.Aliases):
				field = fmt.Sprintf("%s.adapters[%d]", f, j-1-len(m.Aliases))
			case j > 0:
				field = fmt.Sprintf("%s.aliases[%d]", f, j-1)
			}
			if n == "" {
				if j > 0 {
					add(field, "must not be empty")
				}
				continue
			}
			if prev, ok := names[n]; ok {
				add(f, "name, alias or adapter %q already used by %s", n, prev)
			}
			names[n] = field
		}
		if !contains(Tokenizers, m.Tokenizer) && m.Tokenizer != TokenizerEngine && !fileExists(m.Tokenizer) {
			add(f+".tokenizer", "%s (want %s, engine, or the path of a tokenizer.json)", unknownOrMissing("tokenizer", m.Tokenizer), strings.Join(Tokenizers, ", "))
		}
		if !contains(Templates, m.Template) && !fileExists(m.Template) {
			add(f+".template", "%s (want %s, or the path of a tokenizer_config.json)", unknownOrMissing("template", m.Template), strings.Join(Templates, ", "))
		}
		if m.BlockSize < 1 || m.BlockSize > 4096 {
			add(f+".block_size", "must be between 1 and 4096, got %d", m.BlockSize)
		}
		if m.BytesPerBlock < 0 {
			add(f+".bytes_per_block", "must not be negative")
		}
		if m.TokenizerCacheMB < 1 || m.TokenizerCacheMB > 1<<16 {
			add(f+".tokenizer_cache_mb", "must be between 1 and 65536, got %d", m.TokenizerCacheMB)
		}
	}
	if len(c.Backends) == 0 && !c.discovering {
		add("backends", "at least one backend is required")
	}
	ids := map[string]int{}
	mockAddrs := map[string]int{}
	engineURLs := map[string]int{} // model, scheme://host:port → backend
	for i, b := range c.Backends {
		f := fmt.Sprintf("backends[%d]", i)
		if b.ID == "" {
			add(f+".id", "required")
		} else if strings.ContainsAny(b.ID, " \t\n#\"") {
			add(f+".id", "must not contain spaces, quotes or '#', got %q", b.ID)
		} else if j, ok := ids[b.ID]; ok {
			add(f+".id", "%q already used by backends[%d]", b.ID, j)
		}
		ids[b.ID] = i
		u, err := url.Parse(b.URL)
		if b.URL == "" {
			add(f+".url", "required")
		} else if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			add(f+".url", "want http://host:port or https://host[:port], got %q", b.URL)
		} else if u.Path != "" && u.Path != "/" {
			add(f+".url", "must not have a path (kvproxy appends /v1/...), got %q", b.URL)
		} else if p := u.Port(); p != "" && !validPort(p) {
			add(f+".url", "port must be 1-65535, got %q", b.URL)
		}
		if b.InsecureSkipVerify && (err != nil || u.Scheme != "https") {
			add(f+".insecure_skip_verify", "only applies to an https url")
		}
		switch b.Kind {
		case KindVLLM, KindSGLang, KindOpenAI:
		case KindMock:
			if err == nil && u.Host != "" {
				host := u.Hostname()
				if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
					add(f+".url", "a mock backend is started by kvproxy and must listen on loopback, got %q", host)
				}
				if u.Port() == "" {
					add(f+".url", "a mock backend needs an explicit port")
				}
				if u.Scheme != "http" {
					add(f+".url", "a mock backend serves plain http, got %q", b.URL)
				}
			}
		default:
			add(f+".kind", "want vllm, sglang, openai or mock, got %q", b.Kind)
		}
		if _, ok := names[b.Model]; b.Model == "" || !ok || !c.isModelName(b.Model) {
			switch m, isAlias := c.ModelByName(b.Model); {
			case b.Model == "" && len(c.Models) <= 1: // models says so (none, or one without a name)
			case b.Model == "":
				add(f+".model", "required with more than one model: one of models[].name")
			case isAlias:
				add(f+".model", "%q is an alias of model %q: a backend names its model by models[].name", b.Model, m.Name)
			default:
				add(f+".model", "must name one of models[].name, got %q", b.Model)
			}
		}
		switch b.KVEvents.Mode {
		case EventsNone, EventsHTTP:
		case EventsZMQ:
			ev := b.KVEvents
			if msg := checkZMQEndpoint(ev.Endpoint); msg != "" {
				add(f+".kv_events.endpoint", "zmq mode needs a publisher endpoint (%s), got %q", msg, ev.Endpoint)
			} else if ev.DPSize > 1 && !strings.HasPrefix(ev.Endpoint, "tcp://") {
				add(f+".kv_events.dp_size", "data-parallel ranks publish on port + rank: the endpoint must be tcp://, got %q", ev.Endpoint)
			} else if msg := checkZMQPorts(ev.Endpoint, ev.DPSize); msg != "" {
				add(f+".kv_events.dp_size", "%s", msg)
			}
			if ev.Replay != "" {
				if msg := checkZMQEndpoint(ev.Replay); msg != "" {
					add(f+".kv_events.replay", "want a replay endpoint (%s), got %q", msg, ev.Replay)
				} else if ev.DPSize > 1 && !strings.HasPrefix(ev.Replay, "tcp://") {
					add(f+".kv_events.dp_size", "data-parallel ranks replay on port + rank: the replay endpoint must be tcp://, got %q", ev.Replay)
				} else if msg := checkZMQPorts(ev.Replay, ev.DPSize); msg != "" {
					add(f+".kv_events.dp_size", "%s", msg)
				} else if msg := checkZMQRanges(ev.Endpoint, ev.Replay, ev.DPSize); msg != "" {
					add(f+".kv_events.replay", "%s", msg)
				}
			}
		default:
			add(f+".kv_events.mode", "want none, zmq or http, got %q", b.KVEvents.Mode)
		}
		if b.KVEvents.DPSize < 0 || b.KVEvents.DPSize > 1024 {
			add(f+".kv_events.dp_size", "must be between 0 and 1024")
		}
		if b.MaxConcurrency < 0 {
			add(f+".max_concurrency", "must not be negative")
		}
		switch b.Role {
		case "", RoleBoth:
		case RolePrefill:
			if b.Kind != KindVLLM && b.Kind != KindMock {
				add(f+".role", "disaggregated prefill speaks vLLM's kv_transfer_params: kind vllm or mock, got %q", b.Kind)
			}
		default:
			add(f+".role", "want both or prefill, got %q", b.Role)
		}
		switch {
		case b.Discover == "" && b.DiscoverInterval != 0:
			add(f+".discover_interval", "only applies with discover: dns")
		case b.Discover == "":
		case b.Discover != DiscoverDNS:
			add(f+".discover", "want dns, got %q", b.Discover)
		case b.Kind == KindMock:
			add(f+".discover", "a mock backend is started by kvproxy at its url: there is nothing to discover")
		case err == nil && u.Scheme == "https":
			add(f+".discover", "needs an http url: an https engine's certificate names its host, not the addresses it resolves to")
		case b.DiscoverInterval < time.Second:
			add(f+".discover_interval", "must be at least 1s, got %s", b.DiscoverInterval)
		case err == nil && u.User != nil:
			add(f+".url", "with discover, no user info in the url")
		case b.KVEvents.Mode == EventsZMQ && (!namesHost(b.KVEvents.Endpoint, u.Hostname()) || b.KVEvents.Replay != "" && !namesHost(b.KVEvents.Replay, u.Hostname())):
			add(f+".kv_events", "with discover, the endpoints must name the url's host %q: each engine publishes its own events at its address", u.Hostname())
		}
		if m := b.Mock; !finiteNonNegative(m.Speedup) || m.CacheBlocks < 0 || m.HostCacheBlocks < 0 || m.MaxNumSeqs < 0 || m.MaxNumBatchedTokens < 0 || m.MaxLoRAs < 0 {
			add(f+".mock", "values must be numbers, not negative")
		}
		if b.Kind == KindMock && err == nil && u.Host != "" {
			// What a mock binds: its url, and its event publisher's
			// endpoints (two sharing one passed -check and failed at
			// start: the trial).
			binds := [][2]string{{".url", u.Host}}
			if b.KVEvents.Mode == EventsZMQ {
				for _, ep := range [][2]string{{".kv_events.endpoint", b.KVEvents.Endpoint}, {".kv_events.replay", b.KVEvents.Replay}} {
					if addr, ok := strings.CutPrefix(ep[1], "tcp://"); ok {
						binds = append(binds, [2]string{ep[0], addr})
					}
				}
			}
			for _, bind := range binds {
				if j, ok := mockAddrs[bind[1]]; ok {
					add(f+bind[0], "mock backends[%d] already listens on %s", j, bind[1])
				}
				mockAddrs[bind[1]] = i
			}
		}
		// One engine listed twice for a model would count twice in its
		// load and health. (One server may serve several models, and a
		// provider be listed once per API key, for each key's limits.)
		if err == nil && u.Host != "" {
			key := b.Model + "\x00" + u.Scheme + "://" + strings.ToLower(u.Host) + "\x00" + b.APIKey
			if j, ok := engineURLs[key]; ok && b.Kind != KindMock {
				add(f+".url", "backends[%d] already serves model %q from %s (with the same api_key)", j, b.Model, b.URL)
			}
			engineURLs[key] = i
		}
	}
	// A prefill engine's work is decoded elsewhere: its model needs an
	// engine that serves whole requests.
	for i, b := range c.Backends {
		// Not of discovered engines: those that decode may come and go
		// (the templates were checked so when the file was read).
		if b.Role == RolePrefill && !c.discovering && !slices.ContainsFunc(c.Backends, func(o Backend) bool { return o.Model == b.Model && o.Role != RolePrefill }) {
			add(fmt.Sprintf("backends[%d].role", i), "model %q has no backend that decodes (role both) for its prefill engines", b.Model)
		}
	}
	if !contains(Policies, c.Router.Policy) {
		add("router.policy", "unknown policy %q (known: %s)", c.Router.Policy, strings.Join(Policies, ", "))
	}
	if f := c.Router.FetchUsPerMB; !finiteNonNegative(f.Host, f.Disk, f.Shared) {
		add("router.fetch_us_per_mb", "must be a number, not negative")
	}
	if !finiteNonNegative(c.Router.OverlapWeight) {
		add("router.overlap_weight", "must be a number, not negative")
	}
	if !finiteNonNegative(c.Router.Temperature) {
		add("router.temperature", "must be a number, not negative")
	}
	if c.Router.IndexTTL < 0 {
		add("router.index_ttl", "must not be negative")
	}
	if c.Router.MaxIndexBlocks < 0 {
		add("router.max_index_blocks", "must not be negative")
	}
	if cc := c.Router.Cost; !finiteNonNegative(cc.PrefillMsPerToken, cc.QueueMsPerToken, cc.DecodeMsPerBlock) {
		add("router.cost", "coefficients must be numbers, not negative")
	}
	if b := c.Limits.MaxRequestBodyBytes; b < 1024 || b > MaxRequestBodyLimit {
		// Above, "no limit" written as the largest integer wrapped where a
		// byte past the limit is read for: every chunked body was empty
		// (the review).
		add("limits.max_request_body_bytes", "must be between 1024 and %d (1 TiB), got %d", MaxRequestBodyLimit, b)
	}
	if c.Limits.MaxHeaderBytes < 1024 {
		add("limits.max_header_bytes", "must be at least 1024")
	}
	if c.Limits.MaxConnsPerBackend < 0 {
		add("limits.max_conns_per_backend", "must not be negative")
	}
	if c.Limits.MaxConnections < 0 {
		add("limits.max_connections", "must not be negative")
	}
	if c.Limits.BodyMemoryMB < 0 {
		add("limits.body_memory_mb", "must not be negative")
	}
	if c.Limits.MaxMessages < 1 {
		add("limits.max_messages", "must be positive")
	}
	if c.Limits.MaxPromptTokens < 1 {
		add("limits.max_prompt_tokens", "must be positive")
	}
	if c.Limits.MaxQueue < 0 {
		add("limits.max_queue", "must not be negative")
	}
	if c.Limits.MigrationLimit < 0 || c.Limits.MigrationLimit > 8 {
		add("limits.migration_limit", "must be between 0 and 8, got %d", c.Limits.MigrationLimit)
	}
	if !(c.Limits.RetryBudget >= 0 && c.Limits.RetryBudget <= 1) {
		add("limits.retry_budget", "must be between 0 and 1, got %g", c.Limits.RetryBudget)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"limits.header_timeout", c.Limits.HeaderTimeout}, {"limits.body_timeout", c.Limits.BodyTimeout},
		{"limits.stream_idle_timeout", c.Limits.StreamIdleTimeout}, {"limits.queue_timeout", c.Limits.QueueTimeout},
		{"limits.drain_timeout", c.Limits.DrainTimeout}, {"limits.upstream_connect_timeout", c.Limits.UpstreamConnectTime},
		{"limits.idle_timeout", c.Limits.IdleTimeout},
		{"health.interval", c.Health.Interval},
		{"health.timeout", c.Health.Timeout}, {"health.eject_base", c.Health.EjectBase},
		{"health.eject_max", c.Health.EjectMax}, {"health.forget_after", c.Health.ForgetAfter},
		{"replicas.interval", c.Replicas.Interval}} {
		if d.v < 0 {
			add(d.name, "must not be negative")
		}
	}
	if c.Health.Rise < 1 || c.Health.Fall < 1 {
		add("health", "rise and fall must be at least 1")
	}
	if iv := c.Health.Interval; iv > 0 && iv < 10*time.Millisecond {
		add("health.interval", "must be at least 10ms, got %v", iv) // else every engine is probed in a tight loop
	}
	for _, u := range strings.Split(c.Replicas.NATS, ",") {
		if u = strings.TrimSpace(u); u != "" && !strings.HasPrefix(u, "nats://") && !strings.HasPrefix(u, "tls://") {
			add("replicas.nats", "want nats://host:port or tls://host:port, got %q", u)
		} else if _, err := url.Parse(u); err != nil { // else the proxy fails to start, after validation passed
			add("replicas.nats", "%v", err)
		}
	}
	if sub := c.Replicas.Subject; sub != "" {
		for _, tok := range strings.Split(sub, ".") {
			if tok == "" || tok == "*" || tok == ">" || strings.ContainsAny(tok, " \t\r\n") {
				add("replicas.subject", "want a NATS subject of plain dot-separated tokens (no spaces, no * or > wildcards: every replica publishes and listens on it), got %q", sub)
				break
			}
		}
	}
	if iv := c.Replicas.Interval; iv > 0 && iv < 10*time.Millisecond || iv > 20*time.Second {
		// Above 20 s, peers (which cap a replica's interval there) would
		// drop a live replica's load between its reports.
		add("replicas.interval", "must be between 10ms and 20s, got %v", iv)
	}
	if !c.discovering && c.Replicas.NATS != "" { // an expansion's files were read with its templates; without NATS, warned of
		c.Replicas.checkFiles(add)
	}
	for i, p := range c.TrustedProxies {
		if parseNet(p) == nil {
			add(fmt.Sprintf("trusted_proxies[%d]", i), "want an IP address or a CIDR such as 10.0.0.0/8, got %q", p)
		}
	}
	for i, o := range c.CORS.AllowedOrigins {
		// As browsers send Origin: lower case, no path, no default port.
		u, err := url.Parse(o)
		if o != "*" && (err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" ||
			o != u.Scheme+"://"+u.Host || strings.ToLower(o) != o || !isASCII(o) || strings.HasSuffix(u.Host, ":") ||
			strings.HasPrefix(u.Port(), "0") || u.Scheme == "https" && u.Port() == "443" || u.Scheme == "http" && u.Port() == "80") {
			add(fmt.Sprintf("cors.allowed_origins[%d]", i), `want "*" or an origin as browsers send it, such as https://app.example.com (lower case, no path, no default port), got %q`, o)
		}
	}
	tenants := map[string]bool{}
	for i, t := range c.Tenants {
		f := fmt.Sprintf("tenants[%d]", i)
		if t.Name == "" {
			add(f+".name", "required")
		} else if tenants[t.Name] {
			add(f+".name", "%q listed twice", t.Name)
		}
		tenants[t.Name] = true
		if !finiteNonNegative(t.RequestsPerSecond) {
			add(f+".requests_per_second", "must be a number, not negative (0: no limit), got %g", t.RequestsPerSecond)
		}
		if !finiteNonNegative(t.TokensPerMinute) {
			add(f+".tokens_per_minute", "must be a number, not negative (0: no limit), got %g", t.TokensPerMinute)
		}
		if t.MaxConcurrency < 0 {
			add(f+".max_concurrency", "must not be negative (0: no cap)")
		}
		if t.Models != nil && len(t.Models) == 0 {
			add(f+".models", "lists no model: leave it out to allow every model")
		}
		for j, name := range t.Models {
			if _, ok := c.ModelByName(name); !ok {
				add(fmt.Sprintf("%s.models[%d]", f, j), "%q is not the name or alias of a configured model", name)
			}
		}
	}
	keys := map[string]bool{}
	for i, k := range c.Auth.Keys {
		f := fmt.Sprintf("auth.keys[%d]", i)
		if len(k.Key) < 8 {
			add(f+".key", "must be at least 8 characters")
		} else if keys[k.Key] {
			add(f+".key", "duplicate key") // never print a key
		}
		keys[k.Key] = true
		if k.Tenant == "" {
			add(f+".tenant", "required")
		}
	}
	for i, k := range c.Auth.AdminKeys {
		if len(k) < 8 {
			add(fmt.Sprintf("auth.admin_keys[%d]", i), "must be at least 8 characters")
		} else if keys[k] {
			add(fmt.Sprintf("auth.admin_keys[%d]", i), "is also a client key in auth.keys: that client would get the admin endpoints")
		}
	}
	for i, k := range c.Auth.MetricsKeys {
		if len(k) < 8 {
			add(fmt.Sprintf("auth.metrics_keys[%d]", i), "must be at least 8 characters")
		} else if keys[k] {
			add(fmt.Sprintf("auth.metrics_keys[%d]", i), "is also a client key in auth.keys: that client would read every tenant's metrics")
		}
	}
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "; "))
	}
	return nil
}

// MinSecretLen is the length below which auth.cache_salt_secret draws a
// warning: it keys the tenants' cache salts and response ids, and a short
// one can be guessed offline.
const MinSecretLen = 32

// Warnings are what in a valid configuration is likely a mistake: a key
// naming a tenant that tenants does not list (a typo runs that client
// with no limits); client keys without a long cache_salt_secret.
func (c *Config) Warnings() []string {
	var out []string
	switch s := c.Auth.CacheSaltSecret; {
	case len(c.Auth.Keys) == 0:
	case s == "":
		out = append(out, "auth.cache_salt_secret is not set: the Responses API's response ids last until kvproxy restarts and are valid at this replica only; set a random secret of at least 32 characters")
	case len(s) < MinSecretLen:
		out = append(out, fmt.Sprintf("auth.cache_salt_secret has %d characters: it keys the tenants' cache salts and response ids, and a short one can be guessed offline; use a random one of at least %d", len(s), MinSecretLen))
	}
	out = append(out, c.forcedUsageWarnings()...)
	limit := MemoryLimit >> 20
	defaulted := limit > 0 && c.Limits.BodyMemoryMB == defaultBodyMemoryMB() // left out, under a memory limit
	if need := (c.Limits.MaxRequestBodyBytes+(1<<20)-1)>>20 + 64; c.Limits.BodyMemoryMB > 0 && c.Limits.BodyMemoryMB < need {
		setting := fmt.Sprint(c.Limits.BodyMemoryMB)
		if defaulted {
			setting += fmt.Sprintf(", its default under kvproxy's memory limit of %d MiB", limit)
		}
		out = append(out, fmt.Sprintf("limits.body_memory_mb (%s) is under what one request may hold at once, its body (limits.max_request_body_bytes) and an answer read whole (up to 64 MiB): %d; such a request gets 413 or 502", setting, need))
	}
	if limit > 0 && 3*int64(c.Limits.BodyMemoryMB) > limit && !defaulted {
		out = append(out, fmt.Sprintf("limits.body_memory_mb (%d) is over a third of kvproxy's memory limit (%d MiB, from its container's or GOMEMLIMIT): its RSS peaks near three times what the budget holds, and could pass the limit with the budget full; its default there is a quarter, %d", c.Limits.BodyMemoryMB, limit, defaultBodyMemoryMB()))
	}
	served := map[string]bool{}
	for _, b := range c.Backends {
		if b.Kind != KindMock && b.Mock != (MockEngine{}) {
			out = append(out, fmt.Sprintf("backend %s: mock settings are for kind mock; a %s engine ignores them", b.ID, b.Kind))
		}
		served[b.Model] = true
	}
	for i, m := range c.Models {
		if !served[m.Name] {
			// Accepted without a word, its requests got 503 for ever (the
			// twenty-ninth session's trial).
			out = append(out, fmt.Sprintf("models[%d] (%s): no backend serves it (backends[].model): its requests get 503", i, m.Name))
		}
	}
	if len(c.Tenants) == 0 {
		return out
	}
	if len(c.Auth.Keys) == 0 {
		// Without keys no request has a tenant: every limit listed is idle.
		return append(out, "tenants are listed but auth.keys is empty: requests have no tenant, so no tenant's limits or models apply")
	}
	listed := map[string]bool{}
	for _, t := range c.Tenants {
		listed[t.Name] = true
	}
	for i, k := range c.Auth.Keys {
		if !listed[k.Tenant] {
			out = append(out, fmt.Sprintf("auth.keys[%d].tenant: %q is not in tenants, so it has no limits", i, k.Tenant))
			listed[k.Tenant] = true // once per tenant
		}
	}
	return out
}

// forcedUsageWarnings names the backends whose force_include_usage cannot
// hold (the simulated engine never forces the usage: its clients would get
// none; kvproxy asks an engine of kind openai for nothing anyway), and the
// models whose engines disagree on it: a client would get a stream's usage
// chunk or not by where it was routed, or moved.
func (c *Config) forcedUsageWarnings() []string {
	var out []string
	forced := map[string]map[bool]bool{} // model → the values its engines have
	for _, b := range c.Backends {
		if b.ForceIncludeUsage && (b.Kind == KindMock || b.Kind == KindOpenAI) {
			out = append(out, fmt.Sprintf("backend %s: force_include_usage is for engines of kind vllm or sglang started so; a %s engine is not", b.ID, b.Kind))
		}
		if b.Role == RolePrefill {
			continue // it streams nothing to clients
		}
		if forced[b.Model] == nil {
			forced[b.Model] = map[bool]bool{}
		}
		forced[b.Model][b.ForceIncludeUsage] = true
	}
	for _, m := range c.Models {
		if len(forced[m.Name]) == 2 {
			out = append(out, fmt.Sprintf("model %s: some of its backends set force_include_usage and some do not: a stream's client gets the usage chunk unasked or not by where it is routed", m.Name))
		}
	}
	return out
}

// checkZMQEndpoint says what is wrong with a ZMQ endpoint ("" if nothing):
// tcp://host:port (a numeric port) or ipc://path.
func checkZMQEndpoint(ep string) string {
	switch {
	case strings.HasPrefix(ep, "ipc://") && len(ep) > len("ipc://"):
		return ""
	case strings.HasPrefix(ep, "tcp://"):
		host, port, err := net.SplitHostPort(ep[len("tcp://"):])
		if err != nil || host == "" {
			return "tcp://host:port"
		}
		if host == "*" || host == "0.0.0.0" || host == "::" {
			return "the engine's address: " + host + " is what the engine binds, kvproxy connects"
		}
		if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
			return "a port between 1 and 65535"
		}
		return ""
	}
	return "tcp://host:port or ipc://path"
}

// checkZMQPorts says whether the ports of every data-parallel rank of a
// valid tcp endpoint (port + rank) exist.
func checkZMQPorts(ep string, dpSize int) string {
	if dpSize <= 1 || !strings.HasPrefix(ep, "tcp://") {
		return ""
	}
	_, port, _ := net.SplitHostPort(ep[len("tcp://"):])
	p, _ := strconv.Atoi(port)
	if p+dpSize-1 > 65535 {
		return fmt.Sprintf("rank %d would publish on port %d of %s: past 65535", dpSize-1, p+dpSize-1, ep)
	}
	return ""
}

// checkZMQRanges says whether a data-parallel engine's publisher ports
// (endpoint's port + rank) and replay ports (replay's port + rank) on one
// host overlap, as they do for vLLM's defaults 5557 and 5558 with two ranks.
func checkZMQRanges(endpoint, replay string, dpSize int) string {
	if !strings.HasPrefix(endpoint, "tcp://") || !strings.HasPrefix(replay, "tcp://") {
		return ""
	}
	h1, p1s, _ := net.SplitHostPort(endpoint[len("tcp://"):])
	h2, p2s, _ := net.SplitHostPort(replay[len("tcp://"):])
	p1, _ := strconv.Atoi(p1s)
	p2, _ := strconv.Atoi(p2s)
	n := max(dpSize, 1)
	if h1 != h2 || p1+n <= p2 || p2+n <= p1 {
		return ""
	}
	return fmt.Sprintf("ranks publish on ports %d–%d and replay on %d–%d of %s: the ranges overlap (give the replay a port at least dp_size above the endpoint's)", p1, p1+n-1, p2, p2+n-1, h1)
}

func (c *Config) isModelName(n string) bool {
	for _, m := range c.Models {
		if m.Name == n {
			return true
		}
	}
	return false
}

// ModelByName finds a model by name or alias.
func (c *Config) ModelByName(name string) (*Model, bool) {
	for i := range c.Models {
		m := &c.Models[i]
		if m.Name == name || contains(m.Aliases, name) {
			return m, true
		}
	}
	return nil, false
}

// TokenizerEngine asks the engines to tokenize (vLLM's POST /tokenize).
const TokenizerEngine = "engine"

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

// unknownOrMissing says why p, a value of a field (what) that takes a
// name or a path, names neither: "unknown tokenizer" told of a path that
// was a path, and did not say the file was missing (the trial). A value
// written as a path (with a slash, or a .json name) gets the reason it
// cannot be read; a Hugging Face repo id reads as one.
func unknownOrMissing(what, p string) string {
	if strings.ContainsRune(p, '/') || strings.HasSuffix(p, ".json") {
		if _, err := os.Stat(p); err != nil {
			return err.Error()
		}
	}
	return fmt.Sprintf("unknown %s %q", what, p)
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return p != "" && err == nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// finiteNonNegative reports whether every v is a number ≥ 0 (YAML's .nan and
// .inf are not: they pass a "< 0" check and break the router's arithmetic).
func finiteNonNegative(vs ...float64) bool {
	for _, v := range vs {
		if !(v >= 0) || math.IsInf(v, 1) {
			return false
		}
	}
	return true
}

// validPort reports whether p (a URL's port, digits only) is a TCP port.
func validPort(p string) bool {
	n, err := strconv.Atoi(p)
	return err == nil && n >= 1 && n <= 65535
}
