package proxy

import (
	"strconv"

	"github.com/goccy/go-json"
	"github.com/valyala/fasthttp"

	"github.com/kvproxy/kvproxy/kv"
	"github.com/kvproxy/kvproxy/router"
)

type candidateJSON struct {
	WorkerID      string  `json:"worker_id"`
	InstanceID    uint64  `json:"instance_id"`
	OverlapBlocks int     `json:"overlap_blocks"`
	CostMs        float64 `json:"cost_ms"` // the kv cost model's predicted TTFT, whatever the policy
	Score         float64 `json:"score"`   // the policy's own, lower wins
}

type decisionJSON struct {
	WorkerID   string `json:"worker_id"`
	InstanceID uint64 `json:"instance_id"`
	Policy     string `json:"policy"` // the one that chose (router.policy)
	// the prefill engine a disaggregated request would be computed on
	// (Dynamo names it prefill_worker_id too)
	PrefillWorkerID   string          `json:"prefill_worker_id,omitempty"`
	PrefillInstanceID uint64          `json:"prefill_instance_id,omitempty"`
	OverlapBlocks     int             `json:"overlap_blocks"`
	TotalBlocks       int             `json:"total_blocks"`
	PredictedTTFTms   float64         `json:"predicted_ttft_ms"`
	TokenIDs          []uint32        `json:"token_ids"`
	BlockHashes       []string        `json:"block_hashes"` // the router's, as /admin/index/lookup takes them: decimal strings, since JavaScript's numbers hold 53 bits
	Candidates        []candidateJSON `json:"candidates"`
}

// writeDecision answers a dry-run (nvext.annotations: ["query_instance_id"]).
// Streaming requests get Dynamo's SSE form: the instance id and the token
// ids as annotated events (SSE comments), then [DONE].
func (s *Server) writeDecision(ctx *fasthttp.RequestCtx, stream bool, policy string, d router.Decision, prefill *router.Decision, tokens []uint32, hashes []kv.BlockHash) {
	ctx.Response.Header.Set(WorkerHeader, d.Name)
	if prefill != nil {
		ctx.Response.Header.Set("X-Kvproxy-Prefill-Worker", prefill.Name)
	}
	if tokens == nil {
		tokens = []uint32{}
	}

	if stream {
		ctx.Response.Header.SetContentType("text/event-stream")
		ctx.Response.Header.Set("Cache-Control", "no-cache")
		b := make([]byte, 0, 64+len(tokens)*7)
		b = append(b, "event: worker_instance_id\n: "...)
		b = strconv.AppendQuote(b, strconv.FormatUint(d.InstanceID, 10))
		b = append(b, "\n\nevent: token_data\n: "...)
		tj, _ := json.Marshal(tokens)
		b = append(b, tj...)
		b = append(b, "\n\n"...)
		b = append(b, doneEvent...)
		ctx.SetBody(b)
		return
	}
	out := decisionJSON{
		WorkerID:        d.Name,
		InstanceID:      d.InstanceID,
		Policy:          policy,
		OverlapBlocks:   d.Overlap,
		TotalBlocks:     d.Total,
		PredictedTTFTms: d.PredictedTTFTms,
		TokenIDs:        tokens,
		BlockHashes:     make([]string, len(hashes)),
		Candidates:      make([]candidateJSON, len(d.Candidates)),
	}
	if prefill != nil {
		out.PrefillWorkerID, out.PrefillInstanceID = prefill.Name, prefill.InstanceID
	}
	for i, h := range hashes {
		out.BlockHashes[i] = strconv.FormatUint(uint64(h), 10)
	}
	for i, c := range d.Candidates {
		out.Candidates[i] = candidateJSON{WorkerID: c.Name, InstanceID: router.InstanceID(c.Name), OverlapBlocks: c.Overlap, CostMs: c.CostMs, Score: c.Score}
	}
	b, _ := json.Marshal(out)
	ctx.Response.Header.SetContentType("application/json")
	ctx.SetBody(b)
}
