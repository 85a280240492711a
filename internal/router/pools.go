package router

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Pools are the engines requests are spread over. With Revisions, a request goes to the pools
// of one KV revision, never across two: Prefill and Decode are then every revision's engines
// together (what /ready and the metrics count), and a revision serves only with both pools.
type Pools struct {
	Prefill []Prefill
	Decode  []string
	// Revisions are the engines by KV revision (router.json's revisions); empty: one set.
	Revisions []Revision
	// Domains are the engines' topology domains by URL (router.json's domains: pairing).
	Domains map[string]string

	// Set by SetPools: the domains with an engine in both pools; each prefill's data-parallel
	// ranks by its bootstrap URL (registry.go).
	pairable     map[string]bool
	dataParallel map[string]int
}

// Revision is one KV revision's engines.
type Revision struct {
	Name    string
	Prefill []Prefill
	Decode  []string

	// Set by SetPools: the revision's pools as a request uses them, its request counter, and
	// whether a request can go to it (both pools, and under Required pairing a domain with
	// both within the revision).
	pools    *Pools
	requests prometheus.Counter
	takes    bool
}

// serves reports whether the revision has an engine in both pools.
func (r *Revision) serves() bool { return len(r.Prefill) > 0 && len(r.Decode) > 0 }

// Lookup resolves a host name to addresses (net.DefaultResolver.LookupHost in production).
type Lookup func(ctx context.Context, host string) ([]string, error)

// ResolvePools turns the config's headless Service names into one endpoint per ready pod,
// sorted so that round-robin order does not change between two resolutions.
func ResolvePools(ctx context.Context, fc routerconfig.File, lookup Lookup) (Pools, error) {
	urls := func(host string, port int32) ([]string, []string, error) {
		ips, err := lookup(ctx, host)
		if err != nil {
			return nil, nil, fmt.Errorf("resolve %s: %w", host, err)
		}
		slices.Sort(ips)
		var out []string
		for _, ip := range ips {
			out = append(out, "http://"+net.JoinHostPort(ip, strconv.Itoa(int(port))))
		}
		return out, ips, nil
	}
	prefillOf := func(host string, ranks int32) ([]Prefill, error) {
		prefill, ips, err := urls(host, fc.EnginePort)
		if err != nil {
			return nil, err
		}
		var out []Prefill
		for i, u := range prefill {
			pf := Prefill{URL: u, DataParallel: int(ranks)}
			if fc.BootstrapPort > 0 {
				pf.Bootstrap = "http://" + net.JoinHostPort(ips[i], strconv.Itoa(int(fc.BootstrapPort)))
			}
			out = append(out, pf)
		}
		return out, nil
	}
	decodeOf := func(host string) ([]string, error) {
		d, _, err := urls(host, fc.EnginePort)
		return d, err
	}
	// A Service without a ready pod has no DNS name (a new revision starting, an old one
	// drained, a domain without a pod of that pool): that pool is empty. Any other failure
	// keeps the last pools (the caller's).
	notFound := func(err error) bool {
		dnsErr, ok := errors.AsType[*net.DNSError](err)
		return ok && dnsErr.IsNotFound
	}
	// Domains: each domain's Services list the engines in it.
	var domains map[string]string
	if fc.Pairing != nil {
		domains = map[string]string{}
		for _, dh := range fc.AllDomains() {
			for _, host := range []string{dh.PrefillHost, dh.DecodeHost} {
				in, err := decodeOf(host)
				if err != nil && !notFound(err) {
					return Pools{}, err
				}
				for _, u := range in {
					domains[u] = dh.Domain
				}
			}
		}
	}
	if len(fc.Revisions) == 0 {
		p := Pools{Domains: domains}
		var err error
		if p.Prefill, err = prefillOf(fc.PrefillHost, fc.PrefillDataParallel); err != nil && !notFound(err) {
			return Pools{}, err
		}
		if p.Decode, err = decodeOf(fc.DecodeHost); err != nil && !notFound(err) {
			return Pools{}, err
		}
		return p, nil
	}
	out := Pools{Domains: domains}
	for _, rh := range fc.Revisions {
		rev := Revision{Name: rh.Revision}
		var err error
		if rev.Prefill, err = prefillOf(rh.PrefillHost, rh.PrefillDataParallel); err != nil && !notFound(err) {
			return Pools{}, err
		}
		if rev.Decode, err = decodeOf(rh.DecodeHost); err != nil && !notFound(err) {
			return Pools{}, err
		}
		out.Revisions = append(out.Revisions, rev)
	}
	return out, nil
}
