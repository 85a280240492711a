// Pairing by topology: a request's prefill and decode from one domain (a rack, an NVLink
// domain, an RDMA fabric), where its KV crosses the fastest links.

package router

import (
	"encoding/json"
	"net/http"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// noPairableDomain is the 503 of Required pairing when no domain has both pools.
const noPairableDomain = "no topology domain has a ready engine in both pools: spec.scheduling.pairing.mode Required sends a request to one domain's prefill and decode, never across two"

// domainsOf marks the domains of p that have an engine in both pools: only those can pair a
// request within themselves.
func domainsOf(p *Pools) map[string]bool {
	prefill := map[string]bool{}
	for _, e := range p.Prefill {
		if d := p.Domains[e.URL]; d != "" {
			prefill[d] = true
		}
	}
	both := map[string]bool{}
	for _, u := range p.Decode {
		if d := p.Domains[u]; prefill[d] {
			both[d] = true
		}
	}
	return both
}

// pairablePrefill narrows avoid, under Required pairing, to the prefill engines of a domain
// with a decode engine: one elsewhere could not be paired.
func (x *exchange) pairablePrefill(avoid func(string) bool) func(string) bool {
	if x.r.cfg.Pairing != routerconfig.PairingRequired {
		return avoid
	}
	p := x.pools
	return func(u string) bool { return (avoid != nil && avoid(u)) || !p.pairable[p.Domains[u]] }
}

// pickDecode picks the decode engine of an attempt whose prefill engine is prefillURL: with
// pairing, one in that engine's domain, else (Preferred) any, counting which; pref, when not
// nil, is the request's preference among them.
func (x *exchange) pickDecode(avoid func(string) bool, prefillURL string, pairing bool, pref *preference) (picked, bool) {
	p, b := x.pools, x.r.decode
	url := func(i int) string { return p.Decode[i] }
	if !pairing {
		return b.pick(len(p.Decode), url, avoid, pref)
	}
	if domain := p.Domains[prefillURL]; domain != "" {
		same := func(u string) bool { return (avoid != nil && avoid(u)) || p.Domains[u] != domain }
		if dp, ok := b.pick(len(p.Decode), url, same, pref); ok {
			x.r.metrics.samePairs.Add(1)
			return dp, true
		}
	}
	if x.r.cfg.Pairing == routerconfig.PairingRequired {
		return picked{}, false
	}
	dp, ok := b.pick(len(p.Decode), url, avoid, pref)
	if ok {
		x.r.metrics.crossPairs.Add(1)
	}
	return dp, ok
}

// servePairs answers GET /pairs: the pair counts by locality since the router started.
func (r *Router) servePairs(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(routerconfig.PairCounts{SameDomain: r.metrics.samePairs.Load(), CrossDomain: r.metrics.crossPairs.Load()})
}
