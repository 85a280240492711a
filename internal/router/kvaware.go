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
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/router/kvevents"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// trustAfterLoss is how long a pool routes by estimate after one of its engines lost events:
// the index rebuilds from the engine's later events (vLLM reports the cached blocks a request
// reuses as stored again), which takes some traffic.
const trustAfterLoss = time.Minute

// kvEvents is the KVEvents strategy: an index and a follower per pool, fed by each engine's
// publisher (one per data-parallel rank), and PrefixAware's state as its estimate for text
// prompts and pools whose events it cannot trust (and as its record of what the router sent
// each engine, which vouches for what the events claim).
type kvEvents struct {
	estimate  *prefixAware
	endpoints routerconfig.KVEventsEndpoints
	// ports are engines' own ports where Config gave them (by engine URL).
	ports  map[string]KVEventsPorts
	follow map[leg]*kvevents.Follower

	mu sync.Mutex
	// running are the followed sources by key (pool, engine URL, rank); ranks each pool's
	// engines' index keys.
	running map[string]context.CancelFunc
	ranks   map[leg]map[string][]string

	// byPool are each pool's counts (GET /routing and the metrics read them).
	byPool                                                 map[leg]*kvCounts
	promptBlocks, matchedBlocks, unvouchedBlocks, fallback *prometheus.Desc
	connected, indexBlocks, lag                            *prometheus.Desc
	lost, restarts, orphaned, panics, refused              *prometheus.Desc
	evicted                                                *prometheus.Desc
}

// kvCounts are one pool's counts since the router started: the full blocks of the token-id
// prompts routed by the events, those the picked engine held, those an engine claimed
// unvouched, and the requests routed by estimate instead, by reason.
type kvCounts struct {
	prompt, matched, unvouched      atomic.Int64
	noTokens, untrusted, overBudget atomic.Int64
}

// KVEventsPorts are one engine's KV events publisher and replay ports (rank 0's).
type KVEventsPorts struct{ Port, ReplayPort int32 }

// newKVEvents follows the engines' KV events into an index per pool, of at most indexBlocks
// blocks each (0: blocksPerEngine per engine alone).
func newKVEvents(routing *routerconfig.Routing, ports map[string]KVEventsPorts, indexBlocks int64) *kvEvents {
	e := *routing.KVEvents
	pool := []string{"pool"}
	k := &kvEvents{
		estimate:  newPrefixAware(routing),
		endpoints: e,
		ports:     ports,
		follow:    map[leg]*kvevents.Follower{},
		running:   map[string]context.CancelFunc{},
		ranks:     map[leg]map[string][]string{},
		byPool:    map[leg]*kvCounts{legPrefill: {}, legDecode: {}},
		promptBlocks: prometheus.NewDesc("pdcluster_router_kv_events_prompt_blocks_total",
			"Full KV blocks of the token-id prompts routed by the engines' KV events (routing.strategy KVEvents), by pool: with pdcluster_router_kv_events_matched_blocks_total, the share of prompt the picked engines held.", pool, nil),
		matchedBlocks: prometheus.NewDesc("pdcluster_router_kv_events_matched_blocks_total",
			"Leading KV blocks of the prompt the picked engine's events said it held (routing.strategy KVEvents), by pool.", pool, nil),
		unvouchedBlocks: prometheus.NewDesc("pdcluster_router_kv_events_unvouched_blocks_total",
			"Leading KV blocks of routed prompts that an engine's events claimed but this router never sent that engine (routing.strategy KVEvents), by pool: not counted for the pick. Many mean the engines' caches fill from elsewhere (another router replica, direct clients) or an engine claims what it does not hold.", pool, nil),
		fallback: prometheus.NewDesc("pdcluster_router_kv_events_estimated_total",
			"Requests routed by PrefixAware's estimate instead of the engines' KV events, by pool and reason: text (the prompt is not token ids), untrusted (an engine of the pool is not connected, has stated no block size, or lost events in the last minute), budget (the router's budget of request bytes in flight could not hold the prompt's token ids, 4 bytes each).", []string{"pool", "reason"}, nil),
		connected:   prometheus.NewDesc("pdcluster_router_kv_events_connected_publishers", "KV events publishers (one per engine and data-parallel rank) the router is connected to, by pool: until every one of the pool's is, the pool routes by estimate (pdcluster_router_kv_events_estimated_total{reason=\"untrusted\"}).", []string{"pool"}, nil),
		indexBlocks: prometheus.NewDesc("pdcluster_router_kv_events_index_blocks", "KV blocks the engines' events say they hold, by pool (bounded by blocksPerEngine per engine and rank, and in all by the router's memory limit).", []string{"pool"}, nil),
		lag:         prometheus.NewDesc("pdcluster_router_kv_events_lag_seconds", "The longest time an engine's last KV event batch took from the engine to the router's index, by pool.", []string{"pool"}, nil),
		lost:        prometheus.NewDesc("pdcluster_router_kv_events_lost_total", "Times KV events were lost past an engine's replay buffer (its index dropped, the pool estimated for a minute), by pool.", []string{"pool"}, nil),
		restarts:    prometheus.NewDesc("pdcluster_router_kv_events_restarts_total", "Times an engine's KV events sequence went back or its connection dropped (its index dropped and rebuilt from its replay), by pool.", []string{"pool"}, nil),
		orphaned:    prometheus.NewDesc("pdcluster_router_kv_events_orphaned_blocks_total", "Stored KV blocks skipped because the router never saw the block before them, by pool.", []string{"pool"}, nil),
		panics:      prometheus.NewDesc("pdcluster_router_kv_events_panics_total", "KV event batches whose decoding or applying panicked and was recovered (the engine's index dropped, the pool estimated for a minute), by pool: a bug, or an engine sending what no check foresaw.", []string{"pool"}, nil),
		refused:     prometheus.NewDesc("pdcluster_router_kv_events_refused_total", "KV events connections the router closed for what the engine wrote (a message past the size cap, a malformed ZMTP handshake, or none in time; the engine's index dropped, the pool estimated for a minute), by pool.", []string{"pool"}, nil),
		evicted:     prometheus.NewDesc("pdcluster_router_kv_events_index_evicted_blocks_total", "KV blocks the router's index gave up, by pool, to stay within its share of the router's memory limit (3/16 a pool; the engine holding the most gives one up): the engines hold more than the router can follow (raise spec.router.resources.limits.memory).", []string{"pool"}, nil),
	}
	for _, l := range []leg{legPrefill, legDecode} {
		k.follow[l] = &kvevents.Follower{Index: kvevents.NewIndex(int(e.BlocksPerEngine), int(indexBlocks)), Topic: e.Topic}
		k.ranks[l] = map[string][]string{}
	}
	return k
}

// run follows the KV events of every engine in the pools until ctx ends, starting and
// stopping subscriptions as the pools change.
func (k *kvEvents) run(ctx context.Context, pools func() *Pools, log logr.Logger) {
	for _, f := range k.follow {
		f.Log = log.WithName("kv-events")
	}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		if p := pools(); p != nil {
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

// retain forgets the engines no longer in pools from the estimate's record; their followers
// stop at the next sync.
func (k *kvEvents) retain(pools *Pools) { k.estimate.retain(pools) }

// kvSource is one publisher to follow, for pool l.
type kvSource struct {
	l   leg
	src kvevents.Source
}

// sources are the publishers of every rank of every engine in pools, by "<pool> <index key>",
// and each pool's index keys by engine URL: a data-parallel pod's rank r publishes on its
// engine's ports plus r, keyed "<url>#r" (rank 0 by its URL).
func (k *kvEvents) sources(pools *Pools) (map[string]kvSource, map[leg]map[string][]string) {
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
func (k *kvEvents) sync(ctx context.Context, pools *Pools) {
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

func (k *kvEvents) prepare(body map[string]json.RawMessage, charge func(int64) bool) scorer {
	q := &kvRequest{k: k, estimate: prefixRequest{p: k.estimate, hashes: k.estimate.promptHashes(body)}, prompt: body["prompt"], blocks: [2]int{-1, -1}}
	q.tokens, q.overBudget = promptTokens(body, charge)
	return q
}

// kvRequest is one request's KVEvents state: its prompt's token ids (none for a text prompt;
// overBudget when the body budget could not hold them), its estimate's, and by leg what the
// last score weighed: the prompt's full blocks by the events, or -1 for the estimate.
type kvRequest struct {
	k          *kvEvents
	estimate   prefixRequest
	prompt     json.RawMessage
	tokens     []uint32
	overBudget bool
	blocks     [2]int
}

func (q *kvRequest) score(l leg, n int, url func(int) string) *preference {
	if pref, blocks := q.fromEvents(l, n, url); pref != nil {
		q.blocks[legSlot(l)] = blocks
		return pref
	}
	q.blocks[legSlot(l)] = -1
	return q.estimate.score(l, n, url)
}

// record notes the engine holds the prompt now in the estimate's record (what vouches for its
// events later) and counts the pick by what weighed it: the estimate records and counts a pick
// it made itself.
func (q *kvRequest) record(l leg, pk picked, url string, pref *preference) {
	blocks := q.blocks[legSlot(l)]
	if blocks < 0 {
		q.estimate.record(l, pk, url, pref)
		return
	}
	if len(q.estimate.hashes) > 0 {
		q.estimate.sent(l, url)
	}
	c := q.k.byPool[l]
	c.prompt.Add(int64(blocks))
	c.matched.Add(int64(pk.matched))
}

// fromEvents is l's preference from the engines' events and the prompt's full blocks, or nil
// when the pool routes by estimate (counted by why).
func (q *kvRequest) fromEvents(l leg, n int, urlOf func(int) string) (*preference, int) {
	k := q.k
	c := k.byPool[l]
	if q.tokens == nil {
		if q.overBudget {
			c.overBudget.Add(1)
		} else {
			c.noTokens.Add(1)
		}
		return nil, 0
	}
	f := k.follow[l]
	k.mu.Lock()
	ranks := k.ranks[l]
	k.mu.Unlock()
	keys := make([][]string, n)
	for i := range n {
		if keys[i] = ranks[urlOf(i)]; len(keys[i]) == 0 { // pooled since the last sync: not followed yet
			c.untrusted.Add(1)
			return nil, 0
		}
	}
	// The pool's block size is what its engines' events state (one --block-size for the
	// PDCluster); an engine connected that cached nothing yet holds nothing.
	size, agree := f.Index.CommonBlockSize(keys)
	if !agree || size == 0 || !f.Trusted(keys, time.Now(), trustAfterLoss) {
		c.untrusted.Add(1)
		return nil, 0
	}
	// A pod's match is its best rank's: the router does not pick the rank.
	matched := make([]int, n)
	blocks := f.Index.MatchLeading(q.tokens, size, keys, matched)
	c.unvouched.Add(int64(q.vouch(l, urlOf, size, matched)))
	return &preference{matched: matched, slack: k.estimate.slack}, blocks
}

// vouch caps each engine's matched blocks at what this router itself sent it of the prompt
// (the estimate's record of what it sent each engine) and returns the blocks it took off. An
// engine's events are its own word: one that claims a prefix clients share drew its pool's
// traffic to itself (issue 56: 40 of 40 requests) from the engines the prompts went to. Capped,
// it wins a prompt only where an honest engine in its place would hold it: after the router
// sent it there. Blocks past the prompt's hashed start (maxChunks of chunkBytes) are vouched
// for by a record of the whole start.
func (q *kvRequest) vouch(l leg, urlOf func(int) string, blockSize int, matched []int) (unvouched int) {
	if !slices.ContainsFunc(matched, func(m int) bool { return m > 0 }) {
		return 0 // no claim to vouch for: the record need not be read
	}
	index, hashes := q.k.estimate.pools[l], q.estimate.hashes
	sent := make([]int, len(matched))
	if len(hashes) > 0 {
		index.Match(hashes, urlOf, sent)
	}
	for i, m := range matched {
		if m == 0 || (len(hashes) > 0 && sent[i] == len(hashes)) {
			continue
		}
		// The whole token ids in the chunks sent: one before each comma.
		end := min(sent[i]*index.ChunkBytes(), len(q.prompt))
		if vouched := bytes.Count(q.prompt[:end], []byte{','}) / blockSize; vouched < m {
			matched[i], unvouched = vouched, unvouched+m-vouched
		}
	}
	return unvouched
}

// routingCounts are the estimate's counts and the events', with each pool's index size and
// its events' lag.
func (k *kvEvents) routingCounts() (routerconfig.RoutingCounts, bool) {
	out, _ := k.estimate.routingCounts()
	for l, pool := range map[leg]*routerconfig.PoolRoutingCounts{legPrefill: &out.Prefill, legDecode: &out.Decode} {
		c := k.byPool[l]
		pool.PromptBlocks, pool.HeldBlocks = c.prompt.Load(), c.matched.Load()
		index, lag := k.state(l)
		pool.IndexBlocks, pool.EventsLagMilliseconds = int64(index), lag.Milliseconds()
	}
	return out, true
}

func (k *kvEvents) collectors() []prometheus.Collector {
	return []prometheus.Collector{k.estimate, k}
}

// state is pool l's index size in blocks and its events' lag: the longest an engine's latest
// batch took to reach the router.
func (k *kvEvents) state(l leg) (index int, lag time.Duration) {
	f := k.follow[l]
	for _, s := range f.Streams() {
		lag = max(lag, s.Lag)
	}
	return f.Index.Size(), lag
}

func (k *kvEvents) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{k.promptBlocks, k.matchedBlocks, k.unvouchedBlocks, k.fallback, k.connected, k.indexBlocks, k.lag, k.lost, k.restarts, k.orphaned, k.panics, k.refused, k.evicted} {
		ch <- d
	}
}

func (k *kvEvents) Collect(ch chan<- prometheus.Metric) {
	for l, f := range k.follow {
		pool := string(l)
		c := k.byPool[l]
		for d, n := range map[*prometheus.Desc]*atomic.Int64{k.promptBlocks: &c.prompt, k.matchedBlocks: &c.matched, k.unvouchedBlocks: &c.unvouched} {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(n.Load()), pool)
		}
		for reason, n := range map[string]*atomic.Int64{"text": &c.noTokens, "untrusted": &c.untrusted, "budget": &c.overBudget} {
			ch <- prometheus.MustNewConstMetric(k.fallback, prometheus.CounterValue, float64(n.Load()), pool, reason)
		}
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
