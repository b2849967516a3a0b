// Command kvmock runs a fleet of simulated vLLM engines on consecutive
// loopback ports, for manual runs, e2e tests and benchmarks:
//
//	kvmock -n 4 -base-port 9000
//
// Engine i is called mock-i and listens on base-port+i (any free port when
// base-port is 0). With -kv-events, engine i also publishes its KV cache
// events in vLLM's ZMQ format on kv-events-base-port+2i, with the replay
// socket on the next port. One line per engine is logged at start; SIGINT
// or SIGTERM stops them all.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/mockengine"
)

func main() {
	log.SetFlags(log.LstdFlags | log.Lmicroseconds | log.LUTC)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], nil); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		log.Print("kvmock: ", err)
		stop()
		os.Exit(1)
	}
}

// endpoints is where one engine can be reached.
type endpoints struct {
	HTTP           string // host:port
	Events, Replay string // ZMQ endpoints, "" without -kv-events
}

// run starts the engines, calls ready with their endpoints, and serves
// until ctx ends.
func run(ctx context.Context, args []string, ready func([]endpoints)) error {
	d := mockengine.DefaultConfig()
	fs := flag.NewFlagSet("kvmock", flag.ContinueOnError)
	n := fs.Int("n", 4, "number of engines")
	basePort := fs.Int("base-port", 9000, "port of engine 0; engine i listens on base-port+i (0: any free ports)")
	host := fs.String("host", "127.0.0.1", "address to listen on")
	model := fs.String("model", d.Model, "served model name")
	loras := fs.String("lora-modules", "", "comma-separated LoRA adapter names served beside the model (vLLM's --lora-modules names); their blocks are cached apart and reported with lora_name")
	maxLoras := fs.Int("max-loras", 1, "LoRA adapters a batch may hold (vLLM's --max-loras); a request of another waits for a place")
	cacheBlocks := fs.Int("cache-blocks", d.CacheBlocks, "KV cache capacity per engine, in blocks")
	hostBlocks := fs.Int("host-cache-blocks", 0, "host (CPU) tier capacity per engine, in blocks (0: off)")
	dupBlocks := fs.Bool("duplicate-blocks", false, "keep and report every copy of a block, as vLLM does (a prompt cached whole computes its last block again)")
	blockSize := fs.Int("block-size", d.BlockSize, "tokens per KV block")
	speedup := fs.Float64("speedup", d.Speedup, "time compression: a step of d takes d/speedup")
	speeds := fs.String("speeds", "", "comma-separated relative speed per engine, e.g. 1,1,0.5,0.5 for a heterogeneous fleet (default all 1)")
	seed := fs.Int64("seed", d.Seed, "seed of generated lengths and words")
	maxSeqs := fs.Int("max-num-seqs", d.MaxNumSeqs, "running sequences per step at most")
	maxBatched := fs.Int("max-num-batched-tokens", d.MaxNumBatchedTokens, "tokens per step at most (chunked prefill)")
	tokenizer := fs.String("tokenizer", d.Tokenizer, "tokenizer: cl100k_base, o200k_base, or the path of a tokenizer.json")
	template := fs.String("template", d.Template, "chat template: chatml, llama3, raw, or the path of a tokenizer_config.json")
	events := fs.Bool("kv-events", false, "publish vLLM-format KV events over ZMQ (PUB and replay ROUTER per engine)")
	eventsPort := fs.Int("kv-events-base-port", 5557, "engine i publishes on port base+2i and serves replay on base+2i+1 (0: any free ports)")
	eventsTopic := fs.String("kv-events-topic", "", "ZMQ topic of the event frames")
	eventsEnc := fs.String("kv-events-encoding", "array", "event encoding: array (msgspec array_like, older vLLM) or map (newer vLLM)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *n < 1 {
		return fmt.Errorf("-n must be at least 1")
	}
	if *basePort < 0 || *basePort+*n-1 > 65535 {
		return fmt.Errorf("-base-port %d leaves no room for %d engines", *basePort, *n)
	}
	speed, err := parseSpeeds(*speeds, *n)
	if err != nil {
		return err
	}
	var enc kv.VLLMEncoding
	switch *eventsEnc {
	case "array":
		enc = kv.VLLMArrays
	case "map":
		enc = kv.VLLMMaps
	default:
		return fmt.Errorf("-kv-events-encoding %q: want array or map", *eventsEnc)
	}
	if *events && (*eventsPort < 0 || *eventsPort+2**n-1 > 65535) {
		return fmt.Errorf("-kv-events-base-port %d leaves no room for %d engines", *eventsPort, *n)
	}

	engines := make([]*mockengine.Engine, 0, *n)
	pubs := make([]*mockengine.Publisher, 0, *n)
	addrs := make([]endpoints, 0, *n)
	defer func() {
		for _, e := range engines {
			e.Close() // no more events once the scheduler stops
		}
		for _, p := range pubs {
			p.Close()
		}
	}()
	for i := 0; i < *n; i++ {
		cfg := mockengine.Config{
			ID: "mock-" + strconv.Itoa(i), Model: *model,
			BlockSize: *blockSize, CacheBlocks: *cacheBlocks, HostCacheBlocks: *hostBlocks, DuplicateBlocks: *dupBlocks,
			MaxNumSeqs: *maxSeqs, MaxNumBatchedTokens: *maxBatched,
			Speedup: *speedup * speed[i], Seed: *seed,
			Tokenizer: *tokenizer, Template: *template,
		}
		if *loras != "" {
			cfg.LoRAModules, cfg.MaxLoRAs = strings.Split(*loras, ","), *maxLoras
		}
		var pub *mockengine.Publisher
		if *events {
			pubPort, replayPort := 0, 0
			if *eventsPort != 0 {
				pubPort, replayPort = *eventsPort+2*i, *eventsPort+2*i+1
			}
			var err error
			pub, err = mockengine.NewPublisher(mockengine.PublisherConfig{
				Endpoint:       "tcp://" + net.JoinHostPort(*host, strconv.Itoa(pubPort)),
				ReplayEndpoint: "tcp://" + net.JoinHostPort(*host, strconv.Itoa(replayPort)),
				Topic:          *eventsTopic,
				Encoding:       enc,
			})
			if err != nil {
				return err
			}
			pubs = append(pubs, pub)
			cfg.OnEvents = pub.OnEvents // one batch per scheduler step, as vLLM
		}
		e, err := mockengine.New(cfg)
		if err != nil {
			return err
		}
		engines = append(engines, e)
		port := 0
		if *basePort != 0 {
			port = *basePort + i
		}
		addr, err := e.Start(net.JoinHostPort(*host, strconv.Itoa(port)))
		if err != nil {
			return err
		}
		ep := endpoints{HTTP: addr}
		evInfo := ""
		if pub != nil {
			ep.Events, ep.Replay = pub.Endpoint(), pub.ReplayEndpoint()
			evInfo = fmt.Sprintf(", kv events %s replay %s", ep.Events, ep.Replay)
		}
		addrs = append(addrs, ep)
		c := e.Config()
		copies := ""
		if c.DuplicateBlocks {
			copies = ", every copy of a block kept"
		}
		log.Printf("kvmock: engine %s model %s listening on http://%s (cache %d blocks of %d tokens%s, host tier %d blocks, max_num_seqs %d, speedup %g%s)",
			c.ID, c.Model, addr, c.CacheBlocks, c.BlockSize, copies, c.HostCacheBlocks, c.MaxNumSeqs, c.Speedup, evInfo)
	}
	if ready != nil {
		ready(addrs)
	}
	<-ctx.Done()
	log.Printf("kvmock: stopping %d engines", len(engines))
	return nil
}

// parseSpeeds reads -speeds: one positive factor per engine.
func parseSpeeds(list string, n int) ([]float64, error) {
	speed := make([]float64, n)
	for i := range speed {
		speed[i] = 1
	}
	if list == "" {
		return speed, nil
	}
	parts := strings.Split(list, ",")
	if len(parts) != n {
		return nil, fmt.Errorf("-speeds has %d values for %d engines", len(parts), n)
	}
	for i, p := range parts {
		v, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("-speeds value %q: want a positive number", p)
		}
		speed[i] = v
	}
	return speed, nil
}
