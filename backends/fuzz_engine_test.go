package backends

// Fuzz targets (twenty-sixth session's fuzzing trial) for engine-facing
// parsers of this package that had none: the ZMTP frame follower (bufConn)
// and the /metrics page parser.

import (
	"encoding/binary"
	"math"
	"testing"
)

// FuzzZMQFrameFollower: the follower never panics, and refuses a stream
// exactly when one of its frames (after the 64-byte greeting) announces
// more than MaxZMQFrame, however the stream is split into reads.
func FuzzZMQFrameFollower(f *testing.F) {
	long := make([]byte, 9)
	long[0] = 0x02
	binary.BigEndian.PutUint64(long[1:], MaxZMQFrame+1)
	f.Add(append(make([]byte, zmtpGreeting), 0x04, 3, 'a', 'b', 'c', 0x01, 0), uint8(5))
	f.Add(append(make([]byte, zmtpGreeting), long...), uint8(1))
	f.Fuzz(func(t *testing.T, stream []byte, cut uint8) {
		ref := refFramesOK(stream)
		c := &bufConn{skip: zmtpGreeting}
		var err error
		for b, n := stream, int(cut)%13+1; len(b) > 0 && err == nil; {
			k := min(n, len(b))
			err = c.follow(b[:k])
			b = b[k:]
		}
		if (err == nil) != ref {
			t.Fatalf("follower error %v, reference ok %v", err, ref)
		}
	})
}

// refFramesOK walks the frames of stream plainly.
func refFramesOK(b []byte) bool {
	if len(b) <= zmtpGreeting {
		return true
	}
	b = b[zmtpGreeting:]
	for len(b) > 0 {
		need := 2
		if b[0]&0x02 != 0 {
			need = 9
		}
		if len(b) < need {
			return true
		}
		size := uint64(b[1])
		if need == 9 {
			size = binary.BigEndian.Uint64(b[1:9])
		}
		if size > MaxZMQFrame {
			return false
		}
		b = b[need:]
		if uint64(len(b)) < size {
			return true
		}
		b = b[size:]
	}
	return true
}

// FuzzEngineMetrics: any /metrics page gives figures in range (usage in
// [0, 1], counts not negative) or an error.
func FuzzEngineMetrics(f *testing.F) {
	f.Add([]byte("# HELP x\nvllm:num_requests_waiting{engine=\"0\"} 3\nvllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2 1700000000\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.5\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1\nvllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 1.7e9\n"))
	f.Add([]byte("sglang:num_queue_reqs 1e308\nsglang:num_queue_reqs 1e308\nvllm:gpu_cache_usage_perc -5\n"))
	f.Fuzz(func(t *testing.T, page []byte) {
		m, ranks, err := ParseEngineRanks(page, nil)
		if err != nil {
			return
		}
		for _, x := range append([]EngineMetrics{m}, func() (ms []EngineMetrics) {
			for _, r := range ranks {
				ms = append(ms, r.EngineMetrics)
			}
			return
		}()...) {
			if x.Waiting < 0 || x.Running < 0 || math.IsNaN(x.KVUsage) || x.KVUsage < 0 || x.KVUsage > 1 || x.CacheBlocks < 0 {
				t.Fatalf("out of range: %+v", x)
			}
		}
		for i, r := range ranks {
			if r.Rank < 0 || r.Rank > MaxDPRank || i > 0 && ranks[i-1].Rank >= r.Rank {
				t.Fatalf("ranks %+v", ranks)
			}
		}
		if m1, err := ParseEngineMetrics(page); err != nil || m1.Waiting != m.Waiting {
			t.Fatalf("ParseEngineMetrics differs: %+v %v", m1, err)
		}
	})
}
