package router

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Pools are the engines requests are spread over.
type Pools struct {
	Prefill []Prefill
	Decode  []string
}

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
	var p Pools
	prefill, ips, err := urls(fc.PrefillHost, fc.EnginePort)
	if err != nil {
		return Pools{}, err
	}
	for i, u := range prefill {
		pf := Prefill{URL: u}
		if fc.BootstrapPort > 0 {
			pf.Bootstrap = "http://" + net.JoinHostPort(ips[i], strconv.Itoa(int(fc.BootstrapPort)))
		}
		p.Prefill = append(p.Prefill, pf)
	}
	if p.Decode, _, err = urls(fc.DecodeHost, fc.EnginePort); err != nil {
		return Pools{}, err
	}
	return p, nil
}
