// KVEvents routing: each pool's engines ranked by the blocks their own KV cache events say they
// hold, for prompts given as token ids; PrefixAware's estimate otherwise.

package router

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/router/kvevents"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// trustAfterLoss is how long a pool routes by estimate after one of its engines lost events:
// the index rebuilds from the engine's later events (vLLM reports the cached blocks a request
// reuses as stored again), which takes some traffic.
const trustAfterLoss = time.Minute

// kvRouting is the router's KVEvents state: an index and a follower per pool, fed by each
// engine's publisher (one per data-parallel rank).
type kvRouting struct {
	endpoints routerconfig.KVEventsEndpoints
	// ports are engines' own ports where Config gave them (by engine URL).
	ports  map[string]KVEventsPorts
	follow map[leg]*kvevents.Follower

	mu sync.Mutex
	// running are the followed sources by key (pool, engine URL, rank); ranks each pool's
	// engines' index keys.
	running map[string]context.CancelFunc
	ranks   map[leg]map[string][]string

	promptBlocks, matchedBlocks, fallbacks    *prometheus.CounterVec
	unvouchedBlocks                           *prometheus.CounterVec
	counts                                    map[leg]kvCounts
	connected, indexBlocks, lag               *prometheus.Desc
	lost, restarts, orphaned, panics, refused *prometheus.Desc
	evicted                                   *prometheus.Desc
}

type kvCounts struct {
	prompt, matched, noTokens, untrusted, overBudget, unvouched prometheus.Counter
}

// KVEventsPorts are one engine's KV events publisher and replay ports (rank 0's).
type KVEventsPorts struct{ Port, ReplayPort int32 }

// newKVRouting follows the engines' KV events into an index per pool, of at most indexBlocks
// blocks each (0: blocksPerEngine per engine alone).
func newKVRouting(routing *routerconfig.Routing, ports map[string]KVEventsPorts, indexBlocks int64) *kvRouting {
	if routing == nil || routing.Strategy != routerconfig.RoutingKVEvents || routing.KVEvents == nil {
		return nil
	}
	e := *routing.KVEvents
	k := &kvRouting{
		endpoints: e,
		ports:     ports,
		follow:    map[leg]*kvevents.Follower{},
		running:   map[string]context.CancelFunc{},
		ranks:     map[leg]map[string][]string{},
		promptBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_kv_events_prompt_blocks_total",
			Help: "Full KV blocks of the token-id prompts routed by the engines' KV events (routing.strategy KVEvents), by pool: with pdcluster_router_kv_events_matched_blocks_total, the share of prompt the picked engines held.",
		}, []string{"pool"}),
		matchedBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_kv_events_matched_blocks_total",
			Help: "Leading KV blocks of the prompt the picked engine's events said it held (routing.strategy KVEvents), by pool.",
		}, []string{"pool"}),
		unvouchedBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_kv_events_unvouched_blocks_total",
			Help: "Leading KV blocks of routed prompts that an engine's events claimed but this router never sent that engine (routing.strategy KVEvents), by pool: not counted for the pick. Many mean the engines' caches fill from elsewhere (another router replica, direct clients) or an engine claims what it does not hold.",
		}, []string{"pool"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_kv_events_estimated_total",
			Help: "Requests routed by PrefixAware's estimate instead of the engines' KV events, by pool and reason: text (the prompt is not token ids), untrusted (an engine of the pool is not connected, has stated no block size, or lost events in the last minute), budget (the router's budget of request bytes in flight could not hold the prompt's token ids, 4 bytes each).",
		}, []string{"pool", "reason"}),
		connected:   prometheus.NewDesc("pdcluster_router_kv_events_connected_publishers", "KV events publishers (one per engine and data-parallel rank) the router is connected to, by pool: until every one of the pool's is, the pool routes by estimate (pdcluster_router_kv_events_estimated_total{reason=\"untrusted\"}).", []string{"pool"}, nil),
		indexBlocks: prometheus.NewDesc("pdcluster_router_kv_events_index_blocks", "KV blocks the engines' events say they hold, by pool (bounded by blocksPerEngine per engine and rank, and in all by the router's memory limit).", []string{"pool"}, nil),
		lag:         prometheus.NewDesc("pdcluster_router_kv_events_lag_seconds", "The longest time an engine's last KV event batch took from the engine to the router's index, by pool.", []string{"pool"}, nil),
		lost:        prometheus.NewDesc("pdcluster_router_kv_events_lost_total", "Times KV events were lost past an engine's replay buffer (its index dropped, the pool estimated for a minute), by pool.", []string{"pool"}, nil),
		restarts:    prometheus.NewDesc("pdcluster_router_kv_events_restarts_total", "Times an engine's KV events sequence went back or its connection dropped (its index dropped and rebuilt from its replay), by pool.", []string{"pool"}, nil),
		orphaned:    prometheus.NewDesc("pdcluster_router_kv_events_orphaned_blocks_total", "Stored KV blocks skipped because the router never saw the block before them, by pool.", []string{"pool"}, nil),
		panics:      prometheus.NewDesc("pdcluster_router_kv_events_panics_total", "KV event batches whose decoding or applying panicked and was recovered (the engine's index dropped, the pool estimated for a minute), by pool: a bug, or an engine sending what no check foresaw.", []string{"pool"}, nil),
		refused:     prometheus.NewDesc("pdcluster_router_kv_events_refused_total", "KV events connections the router closed for what the engine wrote (a message past the size cap, a malformed ZMTP handshake, or none in time; the engine's index dropped, the pool estimated for a minute), by pool.", []string{"pool"}, nil),
		evicted:     prometheus.NewDesc("pdcluster_router_kv_events_index_evicted_blocks_total", "KV blocks the router's index gave up, by pool, to stay within its share of the router's memory limit (3/16 a pool; the engine holding the most gives one up): the engines hold more than the router can follow (raise spec.router.resources.limits.memory).", []string{"pool"}, nil),
		counts:      map[leg]kvCounts{},
	}
	for _, l := range []leg{legPrefill, legDecode} {
		k.follow[l] = &kvevents.Follower{Index: kvevents.NewIndex(int(e.BlocksPerEngine), int(indexBlocks)), Topic: e.Topic}
		k.ranks[l] = map[string][]string{}
		k.counts[l] = kvCounts{
			k.promptBlocks.WithLabelValues(string(l)), k.matchedBlocks.WithLabelValues(string(l)),
			k.fallbacks.WithLabelValues(string(l), "text"), k.fallbacks.WithLabelValues(string(l), "untrusted"),
			k.fallbacks.WithLabelValues(string(l), "budget"), k.unvouchedBlocks.WithLabelValues(string(l)),
		}
	}
	return k
}

// RunKVEvents follows the KV events of every engine in the pools until ctx ends, starting and
// stopping subscriptions as the pools change. Without routing.strategy KVEvents it returns.
func (r *Router) RunKVEvents(ctx context.Context) {
	k := r.kv
	if k == nil {
		return
	}
	for _, f := range k.follow {
		f.Log = r.log.WithName("kv-events")
	}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		if p := r.pools.Load(); p != nil {
			k.sync(ctx, p)
		}
		select {
		case <-ctx.Done():
			k.mu.Lock()
			for _, stop := range k.running {
				stop()
			}
			k.mu.Unlock()
			return
		case <-t.C:
		}
	}
}

// kvSource is one publisher to follow, for pool l.
type kvSource struct {
	l   leg
	src kvevents.Source
}

// sources are the publishers of every rank of every engine in pools, by "<pool> <index key>",
// and each pool's index keys by engine URL: a data-parallel pod's rank r publishes on its
// engine's ports plus r, keyed "<url>#r" (rank 0 by its URL).
func (k *kvRouting) sources(pools *Pools) (map[string]kvSource, map[leg]map[string][]string) {
	want := map[string]kvSource{}
	ranks := map[leg]map[string][]string{legPrefill: {}, legDecode: {}}
	add := func(l leg, engine string, n int) {
		u, err := url.Parse(engine)
		if err != nil {
			return
		}
		base, ok := k.ports[engine]
		if !ok {
			base = KVEventsPorts{k.endpoints.Port, k.endpoints.ReplayPort}
		}
		for rank := range max(n, 1) {
			key := engine
			if rank > 0 {
				key += "#" + strconv.Itoa(rank)
			}
			ranks[l][engine] = append(ranks[l][engine], key)
			at := func(port int32) string {
				return "tcp://" + net.JoinHostPort(u.Hostname(), strconv.Itoa(int(port)+rank))
			}
			want[string(l)+" "+key] = kvSource{l, kvevents.Source{Engine: key, Endpoint: at(base.Port), Replay: at(base.ReplayPort)}}
		}
	}
	for _, pf := range pools.Prefill {
		add(legPrefill, pf.URL, pf.DataParallel)
	}
	for _, d := range pools.Decode {
		add(legDecode, d, 1)
	}
	return want, ranks
}

// sync follows every rank of every engine in pools and stops following the others.
func (k *kvRouting) sync(ctx context.Context, pools *Pools) {
	want, ranks := k.sources(pools)
	k.mu.Lock()
	defer k.mu.Unlock()
	k.ranks = ranks
	for key, stop := range k.running {
		if _, ok := want[key]; !ok {
			stop()
			delete(k.running, key)
		}
	}
	for key, s := range want {
		if _, ok := k.running[key]; ok {
			continue
		}
		c, stop := context.WithCancel(ctx)
		k.running[key] = stop
		go k.follow[s.l].Follow(c, s.src)
	}
}

// promptTokens are a completion's prompt token ids (a list of ints, or a batch of one such
// list), or nil: a text prompt or a chat has no token ids the router can read without a
// tokenizer. The ids' memory, 4 bytes each, is charged first (charge false: nil, and
// overBudget): the body budget counts the body's copies, not what parsing it makes (issue 56:
// 8 MiB of token ids a request took a router's memory past its budget).
func promptTokens(body map[string]json.RawMessage, charge func(bytes int64) bool) (ids []uint32, overBudget bool) {
	raw := body["prompt"]
	if len(raw) < 2 || raw[0] != '[' {
		return nil, false
	}
	// At most one id per comma, and one more: sized once, never grown.
	n := bytes.Count(raw, []byte{','}) + 1
	if !charge(4 * int64(n)) {
		return nil, true
	}
	ids = make([]uint32, 0, n)
	if err := json.Unmarshal(raw, &ids); err == nil {
		return ids, false
	}
	batch := [][]uint32{ids}
	if err := json.Unmarshal(raw, &batch); err == nil && len(batch) == 1 {
		return batch[0], false
	}
	return nil, false
}

// kvPreference is l's preference from the engines' events, or nil when the pool routes by
// estimate (counted by why).
func (x *exchange) kvPreference(l leg, n int, urlOf func(int) string) *preference {
	k := x.r.kv
	c := k.counts[l]
	if x.tokens == nil {
		if x.tokensOverBudget {
			c.overBudget.Inc()
		} else {
			c.noTokens.Inc()
		}
		return nil
	}
	f := k.follow[l]
	k.mu.Lock()
	ranks := k.ranks[l]
	k.mu.Unlock()
	keys := make([][]string, n)
	for i := range n {
		if keys[i] = ranks[urlOf(i)]; len(keys[i]) == 0 { // pooled since the last sync: not followed yet
			c.untrusted.Inc()
			return nil
		}
	}
	// The pool's block size is what its engines' events state (one --block-size for the
	// PDCluster); an engine connected that cached nothing yet holds nothing.
	size, agree := f.Index.CommonBlockSize(keys)
	if !agree || size == 0 || !f.Trusted(keys, time.Now(), trustAfterLoss) {
		c.untrusted.Inc()
		return nil
	}
	// A pod's match is its best rank's: the router does not pick the rank.
	matched := make([]int, n)
	blocks := f.Index.MatchLeading(x.tokens, size, keys, matched)
	c.unvouched.Add(float64(x.vouch(l, urlOf, size, matched)))
	return &preference{matched: matched, slack: x.r.prefix.slack, blocks: blocks, fromEvents: true}
}

// vouch caps each engine's matched blocks at what this router itself sent it of the prompt
// (PrefixAware's record of what it sent each engine, which KVEvents keeps) and returns the
// blocks it took off. An engine's events are its own word: one that claims a prefix clients
// share drew its pool's traffic to itself (issue 56: 40 of 40 requests) from the engines the
// prompts went to. Capped, it wins a prompt only where an honest engine in its place would
// hold it: after the router sent it there. Blocks past the prompt's hashed start (maxChunks of
// chunkBytes) are vouched for by a record of the whole start.
func (x *exchange) vouch(l leg, urlOf func(int) string, blockSize int, matched []int) (unvouched int) {
	if !slices.ContainsFunc(matched, func(m int) bool { return m > 0 }) {
		return 0 // no claim to vouch for: the record need not be read
	}
	p := x.r.prefix
	sent := make([]int, len(matched))
	if len(x.hashes) > 0 {
		p.pools[l].Match(x.hashes, urlOf, sent)
	}
	raw := x.body["prompt"]
	for i, m := range matched {
		if m == 0 || (len(x.hashes) > 0 && sent[i] == len(x.hashes)) {
			continue
		}
		// The whole token ids in the chunks sent: one before each comma.
		end := min(sent[i]*p.pools[l].ChunkBytes(), len(raw))
		if vouched := bytes.Count(raw[:end], []byte{','}) / blockSize; vouched < m {
			matched[i], unvouched = vouched, unvouched+m-vouched
		}
	}
	return unvouched
}

// picked counts a pick made by the engines' events.
func (k *kvRouting) picked(l leg, pref *preference, pk picked) {
	c := k.counts[l]
	c.prompt.Add(float64(pref.blocks))
	c.matched.Add(float64(pk.matched))
}

// state is pool l's index size in blocks and its events' lag: the longest an engine's latest
// batch took to reach the router.
func (k *kvRouting) state(l leg) (index int, lag time.Duration) {
	f := k.follow[l]
	for _, s := range f.Streams() {
		lag = max(lag, s.Lag)
	}
	return f.Index.Size(), lag
}

func (k *kvRouting) Describe(ch chan<- *prometheus.Desc) {
	k.promptBlocks.Describe(ch)
	k.matchedBlocks.Describe(ch)
	k.fallbacks.Describe(ch)
	k.unvouchedBlocks.Describe(ch)
	for _, d := range []*prometheus.Desc{k.connected, k.indexBlocks, k.lag, k.lost, k.restarts, k.orphaned, k.panics, k.refused, k.evicted} {
		ch <- d
	}
}

func (k *kvRouting) Collect(ch chan<- prometheus.Metric) {
	k.promptBlocks.Collect(ch)
	k.matchedBlocks.Collect(ch)
	k.fallbacks.Collect(ch)
	k.unvouchedBlocks.Collect(ch)
	for l, f := range k.follow {
		var connected, lost, restarts, orphaned, panics, refused int
		for _, s := range f.Streams() {
			if s.Connected {
				connected++
			}
			lost += s.Lost
			restarts += s.Restarts + s.Reconnects
			orphaned += s.BlocksOrphaned
			panics += s.Panics
			refused += s.Refused
		}
		index, lag := k.state(l)
		pool := string(l)
		ch <- prometheus.MustNewConstMetric(k.connected, prometheus.GaugeValue, float64(connected), pool)
		ch <- prometheus.MustNewConstMetric(k.indexBlocks, prometheus.GaugeValue, float64(index), pool)
		ch <- prometheus.MustNewConstMetric(k.lag, prometheus.GaugeValue, lag.Seconds(), pool)
		ch <- prometheus.MustNewConstMetric(k.lost, prometheus.CounterValue, float64(lost), pool)
		ch <- prometheus.MustNewConstMetric(k.restarts, prometheus.CounterValue, float64(restarts), pool)
		ch <- prometheus.MustNewConstMetric(k.orphaned, prometheus.CounterValue, float64(orphaned), pool)
		ch <- prometheus.MustNewConstMetric(k.panics, prometheus.CounterValue, float64(panics), pool)
		ch <- prometheus.MustNewConstMetric(k.refused, prometheus.CounterValue, float64(refused), pool)
		ch <- prometheus.MustNewConstMetric(k.evicted, prometheus.CounterValue, float64(f.Index.Evicted()), pool)
	}
}
