// PrefixAware routing: each pool's engines ranked by the prompt prefixes they were sent.

package router

import (
	"encoding/json"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"pdcluster.dev/pdcluster-operator/internal/router/prefix"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// prefixRouting is the router's PrefixAware state: an index per pool of the prompt prefixes
// each engine was sent (a prefill engine that holds a prompt's prefix skips computing it; a
// decode engine pulls fewer blocks), and what its metrics count.
type prefixRouting struct {
	pools map[leg]*prefix.Index
	slack int
	// promptChunks and matchedChunks count, by pool, the chunks of the prompts routed and
	// those the picked engine held; passedOver the picks that left an engine holding more
	// for its load.
	promptChunks, matchedChunks, passedOver *prometheus.CounterVec
	indexChunks                             *prometheus.GaugeVec
	// counts are each pool's series of those counters, looked up once.
	counts map[leg]prefixCounts
}

// prefixCounts are one pool's series of prefixRouting's counters (GET /routing reads them too).
type prefixCounts struct{ prompt, matched, passedOver prometheus.Counter }

// newPrefixRouting is the state of routing, or nil when it does not weigh prefixes (KVEvents
// keeps it as its estimate for text prompts and untrusted events).
func newPrefixRouting(routing *routerconfig.Routing) *prefixRouting {
	if routing == nil || (routing.Strategy != routerconfig.RoutingPrefixAware && routing.Strategy != routerconfig.RoutingKVEvents) {
		return nil
	}
	cfg := prefix.Config{ChunkBytes: int(routing.ChunkBytes), MaxChunks: int(routing.MaxChunks), Capacity: int(routing.ChunksPerEngine)}
	p := &prefixRouting{
		pools: map[leg]*prefix.Index{legPrefill: prefix.New(cfg), legDecode: prefix.New(cfg)},
		slack: int(routing.LoadSlack),
		promptChunks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_prefix_prompt_chunks_total",
			Help: "Chunks of the prompts routed by prefix (routing.strategy PrefixAware), by pool: with pdcluster_router_prefix_matched_chunks_total, the share of prompt the picked engines held.",
		}, []string{"pool"}),
		matchedChunks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_prefix_matched_chunks_total",
			Help: "Leading prompt chunks the picked engine had been sent before (routing.strategy PrefixAware), by pool.",
		}, []string{"pool"}),
		passedOver: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_prefix_load_bound_total",
			Help: "Picks that left an engine holding more of the prompt because it had more than loadSlack requests in flight above the least loaded engine, by pool.",
		}, []string{"pool"}),
		indexChunks: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "pdcluster_router_prefix_index_chunks",
			Help: "Prompt chunk hashes the router remembers for the pool's engines (bounded by chunksPerEngine each).",
		}, []string{"pool"}),
		counts: map[leg]prefixCounts{},
	}
	for _, l := range []leg{legPrefill, legDecode} {
		p.counts[l] = prefixCounts{p.promptChunks.WithLabelValues(string(l)), p.matchedChunks.WithLabelValues(string(l)), p.passedOver.WithLabelValues(string(l))}
	}
	return p
}

// Describe and Collect export the counters and each pool's index size, read at the scrape.
func (p *prefixRouting) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range []prometheus.Collector{p.promptChunks, p.matchedChunks, p.passedOver, p.indexChunks} {
		c.Describe(ch)
	}
}

func (p *prefixRouting) Collect(ch chan<- prometheus.Metric) {
	for l, ix := range p.pools {
		p.indexChunks.WithLabelValues(string(l)).Set(float64(ix.Size()))
	}
	for _, c := range []prometheus.Collector{p.promptChunks, p.matchedChunks, p.passedOver, p.indexChunks} {
		c.Collect(ch)
	}
}

// retain forgets the engines no longer in pools.
func (p *prefixRouting) retain(pools *Pools) {
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

// promptHashes are a request's prompt chunk hashes: the raw JSON of its prompt (completions)
// or messages (chat) under its model, as the client sent them (two prompts that share a start
// share the start of their JSON).
func (p *prefixRouting) promptHashes(body map[string]json.RawMessage) []uint64 {
	text := body["prompt"]
	if text == nil {
		text = body["messages"]
	}
	return p.pools[legPrefill].Hashes(body["model"], text)
}

// preference ranks l's n engines (url(i) the i-th) for this request, or is nil without
// PrefixAware routing or a prompt long enough to hash.
func (x *exchange) preference(l leg, n int, url func(int) string) *preference {
	if x.r.kv != nil {
		if pref := x.kvPreference(l, n, url); pref != nil {
			return pref
		}
	}
	p := x.r.prefix
	if p == nil || len(x.hashes) == 0 {
		return nil
	}
	matched := make([]int, n)
	p.pools[l].Match(x.hashes, url, matched)
	return &preference{matched: matched, slack: p.slack}
}

// pickedFor records that the engine at url was picked for this request's prompt: it holds it
// now (vLLM caches what it computes or pulls), and the pick is counted by what pref weighed.
func (x *exchange) pickedFor(l leg, pk picked, url string, pref *preference) {
	p := x.r.prefix
	estimated := p != nil && len(x.hashes) > 0
	if estimated {
		p.pools[l].Record(url, x.hashes)
	}
	switch {
	case pref != nil && pref.fromEvents:
		x.r.kv.picked(l, pref, pk)
	case estimated:
		c := p.counts[l]
		c.prompt.Add(float64(len(x.hashes)))
		c.matched.Add(float64(pk.matched))
		if pk.passedOver {
			c.passedOver.Inc()
		}
	}
}

// counterValue is a counter's value, as the metrics show it.
func counterValue(c prometheus.Counter) int64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return 0
	}
	return int64(m.GetCounter().GetValue())
}

// serveRouting answers GET /routing: what the picked engines held of the prompts routed since
// the router started, by pool.
func (r *Router) serveRouting(w http.ResponseWriter, _ *http.Request) {
	var out routerconfig.RoutingCounts
	for l, pool := range map[leg]*routerconfig.PoolRoutingCounts{legPrefill: &out.Prefill, legDecode: &out.Decode} {
		c := r.prefix.counts[l]
		pool.PromptChunks, pool.HeldChunks = counterValue(c.prompt), counterValue(c.matched)
		if r.kv != nil {
			k := r.kv.counts[l]
			pool.PromptBlocks, pool.HeldBlocks = counterValue(k.prompt), counterValue(k.matched)
			index, lag := r.kv.state(l)
			pool.IndexBlocks, pool.EventsLagMilliseconds = int64(index), lag.Milliseconds()
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}
