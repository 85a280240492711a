package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"

	"pdcluster.dev/pdcluster-operator/test/sim/vllmcli"
)

// groupPlan is this pod's part in a replica across pods: vLLM's engines of all its pods join
// one data-parallel group (hybrid load balancing: the coordinator at --data-parallel-address:
// --data-parallel-rpc-port, on the pod of rank 0) or one torch.distributed world (a model
// sharded over --nnodes: the store at --master-addr:--master-port, on node 0) before any of
// them serves.
type groupPlan struct {
	// leader: this pod hosts the coordinator, on addr; the others dial addr.
	leader bool
	addr   string
	// members are the group's pods; self names this one (its first rank, or its node rank).
	members int
	self    string
	what    string
}

// planGroup is s's group, or false for an engine on one pod.
func planGroup(s *vllmcli.Serve) (groupPlan, bool) {
	g := s.Group
	switch {
	case g.HybridLB && s.DataParallel > g.DataParallelLocal:
		addr := g.DataParallelAddress
		if addr == "" {
			addr = "127.0.0.1" // vLLM's default for the multiprocessing backend
		}
		return groupPlan{
			leader: g.DataParallelStartRank == 0, addr: net.JoinHostPort(addr, strconv.Itoa(g.DataParallelRPCPort)),
			members: s.DataParallel / g.DataParallelLocal, self: "rank " + strconv.Itoa(g.DataParallelStartRank),
			what: "data-parallel coordinator",
		}, true
	case g.NNodes > 1:
		return groupPlan{
			leader: g.NodeRank == 0, addr: net.JoinHostPort(g.MasterAddr, strconv.Itoa(g.MasterPort)),
			members: g.NNodes, self: "node " + strconv.Itoa(g.NodeRank), what: "torch.distributed store",
		}, true
	}
	return groupPlan{}, false
}

// groupJoinTimeout is how long a pod waits for its group, as vLLM's engines wait for their
// handshake (VLLM_ENGINE_READY_TIMEOUT_S, 600 s).
const groupJoinTimeout = 10 * time.Minute

// errGroupLost ends an engine whose group lost a pod: vLLM's collectives (the data-parallel
// all-reduce, MoE's all-to-all, the tensor shards' NCCL) fail with it and the engine dies.
var errGroupLost = errors.New("EngineDeadError: the engine's group lost a pod")

// joinGroup returns once every pod of p joined, and then reports on lost the first pod lost
// (or the coordinator) until engine ends (a SIGTERM: every pod of a group gets its own, and
// each drains). listen binds the leader's address (an address this pod does not have
// fails the start, as vLLM's bind does).
func joinGroup(engine context.Context, p groupPlan, listen func(addr, what string) (net.Listener, error), lost chan<- error, log logr.Logger) error {
	ctx, cancel := context.WithTimeout(engine, groupJoinTimeout)
	defer cancel()
	if p.leader {
		l, err := listen(p.addr, p.what)
		if err != nil {
			return err
		}
		var conns []net.Conn
		joined := map[string]bool{}
		go func() { <-ctx.Done(); _ = l.Close() }()
		for len(joined) < p.members-1 {
			c, err := l.Accept()
			if err != nil {
				return fmt.Errorf("%s on %s: %d of %d pods joined: %w", p.what, p.addr, len(joined)+1, p.members, err)
			}
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			line, err := bufio.NewReader(c).ReadString('\n')
			if err != nil || joined[line] {
				_ = c.Close()
				continue
			}
			_ = c.SetReadDeadline(time.Time{})
			joined[line] = true
			conns = append(conns, c)
			log.Info("a pod joined the group", "pod", strings.TrimSpace(line), "joined", len(joined)+1, "of", p.members)
		}
		for _, c := range conns {
			if _, err := c.Write([]byte("ready\n")); err != nil {
				return fmt.Errorf("%s: a pod left while the group formed: %w", p.what, err)
			}
			go watch(engine, c, lost)
		}
		return nil
	}
	var d net.Dialer
	for {
		c, err := d.DialContext(ctx, "tcp", p.addr)
		if err == nil {
			_ = c.SetDeadline(time.Now().Add(groupJoinTimeout))
			if _, err = c.Write([]byte(p.self + "\n")); err == nil {
				var line string
				if line, err = bufio.NewReader(c).ReadString('\n'); err == nil && line == "ready\n" {
					_ = c.SetDeadline(time.Time{})
					log.Info("joined the group", "coordinator", p.addr, "pods", p.members)
					go watch(engine, c, lost)
					return nil
				}
			}
			_ = c.Close()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the %s at %s did not take this pod (%s) within %s: %w", p.what, p.addr, p.self, groupJoinTimeout, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// watch reports on lost when the peer at c goes (nothing is sent after the group formed), and
// closes c when this engine ends, as its process's exit would.
func watch(engine context.Context, c net.Conn, lost chan<- error) {
	stop := context.AfterFunc(engine, func() { _ = c.Close() })
	defer stop()
	_, err := c.Read(make([]byte, 1))
	_ = c.Close()
	if engine.Err() != nil {
		return
	}
	select {
	case lost <- fmt.Errorf("%w (%s: %v)", errGroupLost, c.RemoteAddr(), err):
	default:
	}
}
