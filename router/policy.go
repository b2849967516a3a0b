package router

import (
	"math"
	"sort"
	"strings"
)

// Snapshot is what a policy sees of one request: the available workers in
// WorkerID order with their overlap, load and kv-model cost already filled.
type Snapshot struct {
	Req         *Request
	Cands       []Candidate
	BlockSize   int
	Seed        uint64  // deterministic per request until the next Commit: tie-breaks, sampling
	Version     uint64  // changes when workers or their availability change
	Partial     bool    // Cands leaves out available workers (Request.Avoid): not the membership of Version
	Temperature float64 // Config.Temperature
}

// Policy picks a worker. Pick must have no side effects visible to routing
// (caches are fine): it may rewrite Cands[i].Score and returns an index into
// Cands (never empty). Commit is told about every committed decision, for
// policies that keep state (round_robin's cursor, cache_aware's tree).
type Policy interface {
	Pick(s *Snapshot) int
	Commit(req *Request, d *Decision)
}

// workerForgetter is implemented by policies that keep per-worker state
// (cache_aware's tree); RemoveWorker calls it, with no Commit running.
type workerForgetter interface {
	forgetWorker(w WorkerID)
}

// policies maps Config.Policy names to constructors, which validate their
// part of the config and fill its defaults.
var policies = map[string]func(cfg *Config) (Policy, error){
	"kv":          newKVPolicy,
	"kv_dynamo":   newDynamoPolicy,
	"round_robin": newRoundRobinPolicy,
	"least_load":  newLeastLoadPolicy,
	"prefix_hash": newPrefixHashPolicy,
	"cache_aware": newCacheAwarePolicy,
}

// PolicyNames lists the known policy names, sorted, comma-separated.
func PolicyNames() string {
	names := make([]string, 0, len(policies))
	for n := range policies {
		names = append(names, n)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// pickLowest returns the index of the lowest Score. Exact ties are broken by
// s.Seed; with temperature > 0 it samples with probability ∝ exp(−x/T), x the
// score normalised to [0, 1] over the candidates.
func pickLowest(s *Snapshot, temperature float64) int {
	c := s.Cands
	lo, hi := math.Inf(1), math.Inf(-1)
	ties := 0
	for i := range c {
		switch v := c[i].Score; {
		case v < lo:
			lo, ties = v, 1
		case v == lo:
			ties++
		}
		hi = math.Max(hi, c[i].Score)
	}
	if temperature > 0 && hi > lo && !math.IsInf(hi, 1) {
		sum := 0.0
		for i := range c {
			sum += math.Exp(-(c[i].Score - lo) / (hi - lo) / temperature)
		}
		u := float64(s.Seed>>11) / (1 << 53) * sum
		for i := range c {
			u -= math.Exp(-(c[i].Score - lo) / (hi - lo) / temperature)
			if u < 0 {
				return i
			}
		}
		return len(c) - 1
	}
	if ties == 0 { // every score NaN: no order to follow
		return int(s.Seed % uint64(len(c)))
	}
	k := int(s.Seed % uint64(ties))
	for i := range c {
		if c[i].Score == lo {
			if k == 0 {
				return i
			}
			k--
		}
	}
	return 0
}
