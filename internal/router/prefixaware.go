// PrefixAware routing: each pool's engines ranked by the prompt prefixes they were sent.

package router

import (
	"context"
	"encoding/json"
	"sync/atomic"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/router/prefix"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// prefixAware is the PrefixAware strategy: an index per pool of the prompt prefixes each
// engine was sent (a prefill engine that holds a prompt's prefix skips computing it; a decode
// engine pulls fewer blocks), and what it counts. KVEvents keeps one as its estimate.
type prefixAware struct {
	pools map[leg]*prefix.Index
	slack int
	// byPool are each pool's counts (GET /routing and the metrics read them).
	byPool map[leg]*prefixCounts

	promptChunks, matchedChunks, passedOver, indexChunks *prometheus.Desc
}

// prefixCounts are one pool's counts since the router started: chunks of the prompts routed,
// those the picked engine held, and the picks that left an engine holding more for its load.
type prefixCounts struct{ prompt, matched, passedOver atomic.Int64 }

func newPrefixAware(routing *routerconfig.Routing) *prefixAware {
	cfg := prefix.Config{ChunkBytes: int(routing.ChunkBytes), MaxChunks: int(routing.MaxChunks), Capacity: int(routing.ChunksPerEngine)}
	pool := []string{"pool"}
	return &prefixAware{
		pools:  map[leg]*prefix.Index{legPrefill: prefix.New(cfg), legDecode: prefix.New(cfg)},
		slack:  int(routing.LoadSlack),
		byPool: map[leg]*prefixCounts{legPrefill: {}, legDecode: {}},
		promptChunks: prometheus.NewDesc("pdcluster_router_prefix_prompt_chunks_total",
			"Chunks of the prompts routed by prefix (routing.strategy PrefixAware), by pool: with pdcluster_router_prefix_matched_chunks_total, the share of prompt the picked engines held.", pool, nil),
		matchedChunks: prometheus.NewDesc("pdcluster_router_prefix_matched_chunks_total",
			"Leading prompt chunks the picked engine had been sent before (routing.strategy PrefixAware), by pool.", pool, nil),
		passedOver: prometheus.NewDesc("pdcluster_router_prefix_load_bound_total",
			"Picks that left an engine holding more of the prompt because it had more than loadSlack requests in flight above the least loaded engine, by pool.", pool, nil),
		indexChunks: prometheus.NewDesc("pdcluster_router_prefix_index_chunks",
			"Prompt chunk hashes the router remembers for the pool's engines (bounded by chunksPerEngine each).", pool, nil),
	}
}

func (p *prefixAware) prepare(body map[string]json.RawMessage, _ func(int64) bool) scorer {
	return &prefixRequest{p: p, hashes: p.promptHashes(body)}
}

// promptHashes are a request's prompt chunk hashes: the raw JSON of its prompt (completions)
// or messages (chat) under its model, as the client sent them (two prompts that share a start
// share the start of their JSON).
func (p *prefixAware) promptHashes(body map[string]json.RawMessage) []uint64 {
	text := body["prompt"]
	if text == nil {
		text = body["messages"]
	}
	return p.pools[legPrefill].Hashes(body["model"], text)
}

// retain forgets the engines no longer in pools.
func (p *prefixAware) retain(pools *Pools) {
	prefills := map[string]bool{}
	for _, pf := range pools.Prefill {
		prefills[pf.URL] = true
	}
	decodes := map[string]bool{}
	for _, d := range pools.Decode {
		decodes[d] = true
	}
	p.pools[legPrefill].Retain(func(u string) bool { return prefills[u] })
	p.pools[legDecode].Retain(func(u string) bool { return decodes[u] })
}

func (p *prefixAware) run(context.Context, func() *Pools, logr.Logger) {}

func (p *prefixAware) routingCounts() (routerconfig.RoutingCounts, bool) {
	var out routerconfig.RoutingCounts
	for l, pool := range map[leg]*routerconfig.PoolRoutingCounts{legPrefill: &out.Prefill, legDecode: &out.Decode} {
		c := p.byPool[l]
		pool.PromptChunks, pool.HeldChunks = c.prompt.Load(), c.matched.Load()
	}
	return out, true
}

func (p *prefixAware) collectors() []prometheus.Collector { return []prometheus.Collector{p} }

// Describe and Collect export the counts and each pool's index size, read at the scrape.
func (p *prefixAware) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{p.promptChunks, p.matchedChunks, p.passedOver, p.indexChunks} {
		ch <- d
	}
}

func (p *prefixAware) Collect(ch chan<- prometheus.Metric) {
	for l, c := range p.byPool {
		pool := string(l)
		ch <- prometheus.MustNewConstMetric(p.promptChunks, prometheus.CounterValue, float64(c.prompt.Load()), pool)
		ch <- prometheus.MustNewConstMetric(p.matchedChunks, prometheus.CounterValue, float64(c.matched.Load()), pool)
		ch <- prometheus.MustNewConstMetric(p.passedOver, prometheus.CounterValue, float64(c.passedOver.Load()), pool)
		ch <- prometheus.MustNewConstMetric(p.indexChunks, prometheus.GaugeValue, float64(p.pools[l].Size()), pool)
	}
}

// prefixRequest is one request's PrefixAware state: its prompt's chunk hashes (none for a
// prompt too short to hash: no preference).
type prefixRequest struct {
	p      *prefixAware
	hashes []uint64
}

func (q *prefixRequest) score(l leg, n int, url func(int) string) *preference {
	if len(q.hashes) == 0 {
		return nil
	}
	matched := make([]int, n)
	q.p.pools[l].Match(q.hashes, url, matched)
	return &preference{matched: matched, slack: q.p.slack}
}

// record notes the engine at url holds the prompt now (vLLM caches what it computes or pulls)
// and counts the pick.
func (q *prefixRequest) record(l leg, pk picked, url string, _ *preference) {
	if len(q.hashes) == 0 {
		return
	}
	q.sent(l, url)
	c := q.p.byPool[l]
	c.prompt.Add(int64(len(q.hashes)))
	c.matched.Add(int64(pk.matched))
	if pk.passedOver {
		c.passedOver.Add(1)
	}
}

// sent records that the engine at url of pool l was sent the prompt.
func (q *prefixRequest) sent(l leg, url string) { q.p.pools[l].Record(url, q.hashes) }
