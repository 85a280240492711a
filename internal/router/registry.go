// Which entries of a prefill's bootstrap registry the router trusts.

package router

import (
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
)

// Reasons an entry of a bootstrap registry is refused (pdcluster_router_bootstrap_entries_refused_total).
const (
	// refusedRank: a data-parallel rank the prefill pod does not run.
	refusedRank = "rank"
	// refusedAddress: a worker whose address is not on the prefill pod.
	refusedAddress = "address"
)

// refusal is one entry of a registry the router does not use, and why.
type refusal struct {
	dp, reason, detail string
}

// admitTopology keeps the entries of t that the prefill pod at host can own: a data-parallel
// rank below ranks (0: 1) whose every worker registered an address on host. vLLM's registry
// takes any registration from anyone who reaches its port, and vLLM does not check the KV it
// pulls: a rank registered by a stranger at its own address would hand decode the stranger's
// KV. The refusals are sorted by rank.
func admitTopology(t bootstrap.Topology, host string, ranks int) (bootstrap.Topology, []refusal) {
	ranks = max(ranks, 1)
	podIP := net.ParseIP(host)
	kept := make(bootstrap.Topology, len(t))
	var refused []refusal
	for dp, e := range t {
		if n, err := strconv.Atoi(dp); err != nil || n < 0 || n >= ranks || strconv.Itoa(n) != dp {
			refused = append(refused, refusal{dp, refusedRank, fmt.Sprintf("the pod runs data-parallel ranks 0..%d", ranks-1)})
			continue
		}
		if bad := foreignWorker(e, podIP); bad != "" {
			refused = append(refused, refusal{dp, refusedAddress, fmt.Sprintf("worker at %q is not on the prefill pod %s", bad, host)})
			continue
		}
		kept[dp] = e
	}
	slices.SortFunc(refused, func(a, b refusal) int { return strings.Compare(a.dp, b.dp) })
	return kept, refused
}

// foreignWorker returns an address of e's workers that is not on podIP (tcp://IP:port, as
// vLLM's make_zmq_path writes it), or "" when all are; an entry without workers has none to
// pull from and is foreign too.
func foreignWorker(e bootstrap.Engine, podIP net.IP) string {
	n := 0
	for _, pps := range e.WorkerAddr {
		for _, addr := range pps {
			n++
			u, err := url.Parse(addr)
			if err != nil || podIP == nil || !podIP.Equal(net.ParseIP(u.Hostname())) {
				return addr
			}
		}
	}
	if n == 0 {
		return "(no worker)"
	}
	return ""
}

// refusalLogEvery spaces the log lines about refused registry entries: a poisoned registry is
// read again every bootstrapRefresh, and the metric counts each time.
const refusalLogEvery = 10 * time.Second

// admitRegistry is the bootstrap client's Admit: the entries of the registry at addr (the
// prefill pod's bootstrap URL) that admitTopology keeps for that pod's data-parallel ranks.
func (r *Router) admitRegistry(addr string, t bootstrap.Topology) bootstrap.Topology {
	u, err := url.Parse(addr)
	if err != nil {
		return nil
	}
	kept, refused := admitTopology(t, u.Hostname(), r.pools.Load().dataParallel[addr])
	for _, f := range refused {
		r.metrics.registryRefused.WithLabelValues(f.reason).Inc()
	}
	if len(refused) > 0 {
		now := time.Now()
		if last := r.refusalLogged.Load(); last == 0 || now.Sub(time.Unix(0, last)) >= refusalLogEvery {
			r.refusalLogged.Store(now.UnixNano())
			f := refused[0]
			r.log.Info("refused entries of a prefill's bootstrap registry: someone registered ranks the engine does not run",
				"registry", addr, "refused", len(refused), "dpRank", f.dp, "reason", f.reason, "detail", f.detail)
		}
	}
	return kept
}
