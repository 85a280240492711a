// KV revisions: a request's prefill and decode come from one revision, never two.

package router

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// pickRevision chooses the KV revision a request goes to, among those that take one (an engine
// in both pools; under Required pairing, in one domain), at random weighted by their engines
// (so traffic follows the ready pods as a rollout moves them), and returns its pools; without
// pick, the first that takes one, not counted. nil, with the reason, when none does.
func (r *Router) pickRevision(all *Pools, pick bool) (*Pools, string) {
	if i := slices.IndexFunc(all.Revisions, func(rev Revision) bool { return rev.takes }); i >= 0 && !pick {
		return all.Revisions[i].pools, ""
	}
	if len(all.Revisions) == 1 && all.Revisions[0].takes {
		all.Revisions[0].requests.Inc()
		return all.Revisions[0].pools, ""
	}
	total := 0
	for i := range all.Revisions {
		if rev := &all.Revisions[i]; rev.takes {
			total += len(rev.Prefill) + len(rev.Decode)
		}
	}
	if total == 0 {
		if r.cfg.Pairing == routerconfig.PairingRequired && slices.ContainsFunc(all.Revisions, func(rev Revision) bool { return rev.serves() }) {
			return nil, noPairableDomain
		}
		var parts []string
		for _, rev := range all.Revisions {
			parts = append(parts, fmt.Sprintf("%s: %d prefill, %d decode", rev.Name, len(rev.Prefill), len(rev.Decode)))
		}
		return nil, "no KV revision has a ready engine in both pools (" + strings.Join(parts, "; ") +
			"): a request's prefill and decode must share one, so it is not sent across revisions"
	}
	n := rand.IntN(total)
	for i := range all.Revisions {
		rev := &all.Revisions[i]
		if !rev.takes {
			continue
		}
		if n -= len(rev.Prefill) + len(rev.Decode); n < 0 {
			rev.requests.Inc()
			return rev.pools, ""
		}
	}
	return nil, "unreachable"
}
