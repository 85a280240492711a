// Package agent is the stand-in engines' transfer engine, run in the engine's own process
// (inprocess.go): it owns the connector core (Puller or Producer), moves KV blocks between
// agents over TCP (wire.go), serves the Mooncake bootstrap registry on a producer whose engine
// does not (Config.EngineRegisters), and exposes a local API for its engine plus /healthz,
// /readyz and /metrics (api.go). The producer's side serves pulls (producer_serve.go); the
// consumer's side pulls (consumer_pull.go) over kept data connections (consumer_conns.go).
package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/connector/bootstrap"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/kvfile"
)

// Config configures an Agent.
type Config struct {
	Role vllm.KVRole
	// KV is the engine's KV-cache memory.
	KV *kvfile.File
	// EngineID names this producer in the bootstrap registry; a fresh one per start when empty,
	// so consumers never reach a restarted producer under a stale id.
	EngineID string
	// DataAddr is the producer's data-plane address as consumers dial it (host:port).
	DataAddr string
	// Bootstrap is the registry to register with (http://host:port); empty means this agent
	// serves the registry itself (producer rank 0, as in vLLM), unless EngineRegisters.
	Bootstrap string
	// EngineRegisters leaves the registry to the engine: it serves the bootstrap server (vLLM
	// binds VLLM_MOONCAKE_BOOTSTRAP_PORT itself) and registers this producer from GET
	// /v1/info. The agent then neither serves a registry nor registers anywhere, so it never
	// writes into a real vLLM's registry.
	EngineRegisters bool
	// DPRank, TPRank, PPRank locate this producer worker.
	DPRank, TPRank, PPRank int
	// ConsumerRank and Consumers are this consumer's rank and how many consumer ranks pull
	// each transfer from each producer worker (the TP fan-in).
	ConsumerRank kvtransfer.ConsumerRank
	Consumers    int
	// HoldTimeout, ReadyTimeout and TombstoneTTL configure the Producer; PullTimeout the Puller.
	HoldTimeout, ReadyTimeout, TombstoneTTL, PullTimeout time.Duration
	// UnknownTransferGrace is how long a consumer asks again when the producer has not heard
	// of the transfer yet (the prefill leg is still on its way).
	UnknownTransferGrace time.Duration
	// ExpireEvery is how often deadlines are checked.
	ExpireEvery time.Duration
	// SendDelay slows each block sent, to simulate a slow link (tests use it to catch a
	// transfer in flight).
	SendDelay time.Duration
	// UngatedCompletions reproduces the seed bug: drained notify-only pulls are reported to the
	// scheduler as finished receiving. Only for demonstrating the failure.
	UngatedCompletions bool
	Log                logr.Logger
	// Metrics is where the agent registers its collectors; nil means a private registry.
	Metrics prometheus.Registerer
}

// Agent is one connector agent.
type Agent struct {
	cfg      Config
	epoch    string
	puller   *kvtransfer.Puller
	producer *kvtransfer.Producer
	registry *bootstrap.Registry // non-nil when this agent serves the bootstrap registry
	boot     *bootstrap.Client
	events   *eventQueue
	metrics  *metrics
	dialer   net.Dialer
	conns    peerConns
	peers    peerCounts // open data connections per consumer address (producer)

	mu      sync.Mutex
	waiters map[waiterKey]chan kvtransfer.Decision
	// early are pulls that came before their prefill request (the concurrent flow): they wait
	// for its Expect or Ready, by transfer, instead of being sent away to ask again.
	early map[kvtransfer.TransferID]chan struct{}
	ready bool
}

type waiterKey struct {
	transfer kvtransfer.TransferID
	consumer kvtransfer.ConsumerRank
}

// New validates cfg and builds an agent; Serve starts it.
func New(cfg Config) (*Agent, error) {
	if cfg.Role != vllm.KVProducer && cfg.Role != vllm.KVConsumer {
		return nil, fmt.Errorf("agent: role must be %s or %s, got %q", vllm.KVProducer, vllm.KVConsumer, cfg.Role)
	}
	if cfg.KV == nil {
		return nil, errors.New("agent: a KV file is required")
	}
	if cfg.Consumers <= 0 {
		cfg.Consumers = 1
	}
	if cfg.UnknownTransferGrace <= 0 {
		cfg.UnknownTransferGrace = 10 * time.Second
	}
	if cfg.ExpireEvery <= 0 {
		cfg.ExpireEvery = 100 * time.Millisecond
	}
	a := &Agent{cfg: cfg, epoch: randomID(), events: newEventQueue(), boot: bootstrap.NewClient(), waiters: map[waiterKey]chan kvtransfer.Decision{}, early: map[kvtransfer.TransferID]chan struct{}{}}
	a.dialer.Timeout = 5 * time.Second
	var err error
	switch cfg.Role {
	case vllm.KVProducer:
		if cfg.DataAddr == "" {
			return nil, errors.New("agent: a producer needs its data address")
		}
		if a.cfg.EngineID == "" {
			a.cfg.EngineID = "engine-" + randomID()[:12]
		}
		switch {
		case cfg.EngineRegisters && cfg.Bootstrap != "":
			return nil, errors.New("agent: a bootstrap registry to register with and engine registration exclude each other")
		case cfg.Bootstrap == "" && !cfg.EngineRegisters:
			a.registry = bootstrap.NewRegistry()
		}
		a.producer, err = kvtransfer.NewProducer(kvtransfer.ProducerConfig{
			Sink: kvtransfer.ReleaseFunc(a.onRelease), Rank: kvtransfer.ProducerRank(cfg.TPRank),
			HoldTimeout: cfg.HoldTimeout, ReadyTimeout: cfg.ReadyTimeout, TombstoneTTL: cfg.TombstoneTTL,
		})
	case vllm.KVConsumer:
		a.puller, err = kvtransfer.NewPuller(kvtransfer.PullerConfig{Sink: kvtransfer.CompletionFunc(a.onCompletion), Timeout: cfg.PullTimeout})
	}
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	reg := cfg.Metrics
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	if a.metrics, err = newMetrics(a, reg); err != nil {
		return nil, fmt.Errorf("agent: metrics: %w", err)
	}
	return a, nil
}

func randomID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// EngineID is the producer's engine id in the bootstrap registry.
func (a *Agent) EngineID() string { return a.cfg.EngineID }

// Epoch identifies this run of the agent; an engine that sees it change knows the agent's state
// (pulls in flight, held transfers) was lost.
func (a *Agent) Epoch() string { return a.epoch }

// Serve runs the agent until ctx ends: the data plane on data (producers only; nil for
// consumers), the expiry loop, and, for a producer, its registration with the bootstrap
// registry. The HTTP side is Handler, served by the caller.
func (a *Agent) Serve(ctx context.Context, data net.Listener) error {
	defer a.conns.closeAll()
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if a.cfg.Role == vllm.KVProducer {
		if data == nil {
			return errors.New("agent: a producer needs a data listener")
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-ctx.Done()
			data.Close()
		}()
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.acceptPeers(ctx, data)
		}()
		if err := a.register(ctx); err != nil {
			return err
		}
	}
	a.mu.Lock()
	a.ready = true
	a.mu.Unlock()
	t := time.NewTicker(a.cfg.ExpireEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			a.expire()
		}
	}
}

// registration is this producer's entry in the bootstrap registry.
func (a *Agent) registration() bootstrap.Registration {
	return bootstrap.Registration{EngineID: a.cfg.EngineID, DPRank: a.cfg.DPRank, TPRank: a.cfg.TPRank, PPRank: a.cfg.PPRank, Addr: "tcp://" + a.cfg.DataAddr}
}

// Info is what GET /v1/info answers.
func (a *Agent) Info() agentapi.Info {
	info := agentapi.Info{Epoch: a.epoch, KVBlocks: a.cfg.KV.Blocks(), BlockBytes: a.cfg.KV.BlockBytes()}
	if a.producer != nil && a.cfg.EngineRegisters {
		reg := a.registration()
		info.Registration = &reg
	}
	return info
}

func (a *Agent) register(ctx context.Context) error {
	if a.cfg.EngineRegisters {
		return nil // the engine registers this producer from GET /v1/info
	}
	reg := a.registration()
	if a.registry != nil {
		return a.registry.Register(reg)
	}
	return bootstrap.Register(ctx, &http.Client{Timeout: 5 * time.Second}, a.cfg.Bootstrap, reg, 5)
}

func (a *Agent) expire() {
	if a.puller != nil {
		a.puller.Expire()
	}
	if a.producer != nil {
		a.dispatch(a.producer.Expire())
	}
}

// onCompletion is the Puller's sink: completions queue for the engine.
func (a *Agent) onCompletion(c kvtransfer.Completion) {
	a.metrics.completed(c)
	a.events.push(agentapi.CompletionOf(c), nil)
}

// onRelease is the Producer's sink.
func (a *Agent) onRelease(r kvtransfer.Release) {
	a.metrics.released(r)
	a.events.push(nil, &agentapi.Release{Request: r.Request, Transfer: r.Transfer, Blocks: r.Blocks, Reason: string(r.Reason)})
}

// dispatch hands decisions for parked pulls to the connections waiting for them.
func (a *Agent) dispatch(ds []kvtransfer.Decision) {
	for _, d := range ds {
		k := waiterKey{d.Pull.Transfer, d.Pull.Consumer}
		a.mu.Lock()
		ch, ok := a.waiters[k]
		delete(a.waiters, k)
		a.mu.Unlock()
		if ok {
			ch <- d // buffered: the waiting connection always takes it
			continue
		}
		// Nobody waits (cannot happen while every parked pull has a connection), but a send
		// decision must still end, or the transfer's blocks stay pinned.
		if d.Action == kvtransfer.ActionSend {
			a.producer.SendDone(d.Pull.Transfer, d.Pull.Consumer, d.Pull.Consumers, errors.New("no connection for parked pull"))
		}
	}
}
