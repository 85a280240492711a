// Package launch starts one pod's `vllm serve` of an engine replica that spans several pods (a
// LeaderWorkerSet group), from typed values instead of shell: it resolves the leader's address
// to an IP (vLLM binds and advertises IPs; a DNS name it cannot bind), computes this pod's rank
// from its index in the group, points the connectors' side channels at the pod's IP, and then
// execs vLLM with the flags of its layout.
package launch

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// Layout is how a replica spreads over its pods.
type Layout string

const (
	// LayoutDataParallel: data-parallel ranks across pods with hybrid load balancing; every
	// pod serves its own ranks and the leader's rank 0 hosts the coordinator.
	LayoutDataParallel Layout = "data-parallel"
	// LayoutModel: one model sharded (tensor x pipeline) across pods on vLLM's multiprocessing
	// backend; the leader serves, the other pods run its workers, headless.
	LayoutModel Layout = "model"
)

// Group is this pod's place in its replica.
type Group struct {
	Layout Layout
	// Size is the replica's pods; Index this pod's (0: the leader).
	Size, Index int
	// Leader is the leader's address as LeaderWorkerSet gives it (a DNS name).
	Leader string
	// PodIP is this pod's IP, where its side channels listen.
	PodIP string
	// LocalRanks are the data-parallel ranks each pod runs (LayoutDataParallel).
	LocalRanks int
	// Port is the leader's data-parallel RPC port (LayoutDataParallel) or torch.distributed
	// master port (LayoutModel).
	Port int32
}

// FromEnv reads the group from LeaderWorkerSet's variables and the pod's IP (POD_IP, from
// the downward API); layout, localRanks and port are the rendered flags'.
func FromEnv(getenv func(string) string, layout Layout, localRanks, port int) (Group, error) {
	// The port as given, checked before it is narrowed: 2^32+29550 is not port 29550.
	if port < 1 || port > 65535 {
		return Group{}, fmt.Errorf("port %d: want 1 to 65535", port)
	}
	g := Group{Layout: layout, Leader: getenv(vllm.EnvLWSLeaderAddress), PodIP: getenv("POD_IP"), LocalRanks: localRanks, Port: int32(port)}
	var err error
	if g.Size, err = strconv.Atoi(getenv(vllm.EnvLWSGroupSize)); err != nil {
		return g, fmt.Errorf("%s %q: %w", vllm.EnvLWSGroupSize, getenv(vllm.EnvLWSGroupSize), err)
	}
	if g.Index, err = strconv.Atoi(getenv(vllm.EnvLWSWorkerIndex)); err != nil {
		return g, fmt.Errorf("%s %q: %w", vllm.EnvLWSWorkerIndex, getenv(vllm.EnvLWSWorkerIndex), err)
	}
	return g, g.validate()
}

// maxGroup bounds a group's pods and a pod's data-parallel ranks (the CRD allows 64 of each),
// so that this pod's first rank, index x local ranks, cannot wrap.
const maxGroup = 1 << 16

func (g Group) validate() error {
	switch {
	case g.Layout != LayoutDataParallel && g.Layout != LayoutModel:
		return fmt.Errorf("layout %q: want %s or %s", g.Layout, LayoutDataParallel, LayoutModel)
	case g.Size < 2 || g.Size > maxGroup:
		return fmt.Errorf("%s %d: a replica across pods has 2 to %d", vllm.EnvLWSGroupSize, g.Size, maxGroup)
	case g.Index < 0 || g.Index >= g.Size:
		return fmt.Errorf("%s %d is outside the group of %d", vllm.EnvLWSWorkerIndex, g.Index, g.Size)
	case g.Leader == "":
		return fmt.Errorf("%s is empty: the pod is not in a LeaderWorkerSet group", vllm.EnvLWSLeaderAddress)
	case net.ParseIP(g.PodIP) == nil:
		return fmt.Errorf("POD_IP %q is not an IP", g.PodIP)
	case g.Layout == LayoutDataParallel && (g.LocalRanks < 1 || g.LocalRanks > maxGroup):
		return fmt.Errorf("data-parallel ranks per pod %d: want 1 to %d", g.LocalRanks, maxGroup)
	case g.Port < 1 || g.Port > 65535:
		return fmt.Errorf("port %d: want 1 to 65535", g.Port)
	}
	return nil
}

// Resolver resolves a host name to addresses (net.DefaultResolver.LookupHost).
type Resolver func(ctx context.Context, host string) ([]string, error)

// ResolveLeader resolves host to an IP, retrying every interval for up to timeout: the
// leader's DNS record appears only once its pod has an IP. It never returns an empty address:
// past the timeout the error names the address and the last failure.
func ResolveLeader(ctx context.Context, resolve Resolver, host string, timeout, interval time.Duration) (string, error) {
	if ip := net.ParseIP(host); ip != nil {
		return ip.String(), nil
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		addrs, err := resolve(ctx, host)
		for _, a := range addrs {
			if ip := net.ParseIP(a); ip != nil {
				return ip.String(), nil
			}
		}
		if err == nil {
			err = errors.New("no IP address")
		}
		last = err
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("the leader's address %s did not resolve within %s: %w", host, timeout, last)
		case <-time.After(interval):
		}
	}
}

// Args are the flags this pod adds to `vllm serve`, the leader at leaderIP.
func (g Group) Args(leaderIP string) []string {
	port := strconv.Itoa(int(g.Port))
	if g.Layout == LayoutDataParallel {
		return []string{
			vllm.FlagDataParallelHybridLB,
			vllm.FlagDataParallelSizeLocal, strconv.Itoa(g.LocalRanks),
			vllm.FlagDataParallelStartRank, strconv.Itoa(g.Index * g.LocalRanks),
			vllm.FlagDataParallelAddress, leaderIP,
			vllm.FlagDataParallelRPCPort, port,
		}
	}
	args := []string{
		vllm.FlagExecutor, vllm.ExecutorMultiproc,
		vllm.FlagNNodes, strconv.Itoa(g.Size),
		vllm.FlagNodeRank, strconv.Itoa(g.Index),
		vllm.FlagMasterAddr, leaderIP,
		vllm.FlagMasterPort, port,
	}
	if g.Index > 0 {
		args = append(args, vllm.FlagHeadless) // only the leader serves
	}
	return args
}

// Env are the variables this pod's vLLM needs beside the pod's own: its side channels (the
// Mooncake workers' and NIXL's) on the pod's IP, which peers on other nodes reach.
func (g Group) Env() []string {
	return []string{vllm.EnvHostIP + "=" + g.PodIP, vllm.EnvNixlSideChannelHost + "=" + g.PodIP}
}
