// The pick seam: a routing strategy ranks each pool's engines for one request, in the cycle
// GAIE's and llm-d's schedulers name (prepare the request, score a leg's candidates, record the
// pick). It is chosen once in New from router.json's routing.strategy, as the flow is: nothing
// on the request path asks which it is.

package router

import (
	"context"
	"encoding/json"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// strategy weighs what the engines hold of a request's prompt: leastInFlight (nothing),
// prefixAware (the prompt prefixes the router sent each engine), kvEvents (what the engines'
// own KV cache events say they hold, prefixAware's estimate where they cannot say).
type strategy interface {
	// prepare reads what the strategy weighs of a request's body, once, into the request's
	// own state; charge takes the memory of what it parses from the router's body budget.
	prepare(body map[string]json.RawMessage, charge func(bytes int64) bool) scorer
	// retain forgets the engines no longer in pools.
	retain(pools *Pools)
	// run follows what the strategy reads of the engines themselves (KVEvents' publishers)
	// until ctx ends; pools gives the router's pools of the moment.
	run(ctx context.Context, pools func() *Pools, log logr.Logger)
	// routingCounts are GET /routing's answer, what the picked engines held of the prompts
	// routed since the router started; false when the strategy weighs nothing (no route).
	routingCounts() (routerconfig.RoutingCounts, bool)
	// collectors are the strategy's metrics.
	collectors() []prometheus.Collector
}

// scorer is one request's strategy state, kept over all its attempts.
type scorer interface {
	// score ranks leg l's n candidates (url(i) the i-th) for the request; nil: no preference,
	// the balance alone picks.
	score(l leg, n int, url func(int) string) *preference
	// record notes that pk, the engine at url, was picked for leg l after score gave pref.
	record(l leg, pk picked, url string, pref *preference)
}

// newStrategy is routing's strategy (validated: Config.Validate).
func newStrategy(routing *routerconfig.Routing, ports map[string]KVEventsPorts, indexBlocks int64) strategy {
	if routing == nil {
		return leastInFlight{}
	}
	switch routing.Strategy {
	case routerconfig.RoutingPrefixAware:
		return newPrefixAware(routing)
	case routerconfig.RoutingKVEvents:
		return newKVEvents(routing, ports, indexBlocks)
	}
	return leastInFlight{}
}

// leastInFlight weighs nothing: the balance alone picks (routing.strategy LeastInFlight, or
// no routing).
type leastInFlight struct{}

func (leastInFlight) prepare(map[string]json.RawMessage, func(int64) bool) scorer {
	return noPreference{}
}
func (leastInFlight) retain(*Pools)                                   {}
func (leastInFlight) run(context.Context, func() *Pools, logr.Logger) {}
func (leastInFlight) routingCounts() (routerconfig.RoutingCounts, bool) {
	return routerconfig.RoutingCounts{}, false
}
func (leastInFlight) collectors() []prometheus.Collector { return nil }

type noPreference struct{}

func (noPreference) score(leg, int, func(int) string) *preference { return nil }
func (noPreference) record(leg, picked, string, *preference)      {}

// legSlot is l's place in a request's per-leg state.
func legSlot(l leg) int {
	if l == legDecode {
		return 1
	}
	return 0
}
