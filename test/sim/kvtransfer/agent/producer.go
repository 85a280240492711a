package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
)

// ProducerConfig configures the prefill engine's half.
type ProducerConfig struct {
	Config
	// EngineID names this producer in the bootstrap registry; a fresh one per start when empty,
	// so consumers never reach a restarted producer under a stale id.
	EngineID string
	// DataAddr is the data-plane address as consumers dial it (host:port).
	DataAddr string
	// DPRank, TPRank, PPRank locate this producer worker.
	DPRank, TPRank, PPRank int
	// Consumers is how many consumer ranks pull each transfer from this worker (the decode
	// pool's tensor parallelism, the TP fan-in).
	Consumers int
	// HoldTimeout, ReadyTimeout and TombstoneTTL configure the connector core
	// (kvtransfer.Producer).
	HoldTimeout, ReadyTimeout, TombstoneTTL time.Duration
	// SendTimeout bounds writing one pull's blocks to its consumer (a minute when unset).
	SendTimeout time.Duration
	// SendDelay slows each block sent, to simulate a slow link (fault injection: tests use it
	// to catch a transfer in flight).
	SendDelay time.Duration
}

// Producer is the prefill engine's half: it holds finished prefills' blocks for consumers and
// serves their pulls on the data plane.
type Producer struct {
	half
	cfg     ProducerConfig
	core    *kvtransfer.Producer
	metrics *producerMetrics
	peers   peerCounts // open data connections per consumer address

	mu      sync.Mutex
	waiters map[waiterKey]chan kvtransfer.Decision
	// early are pulls that came before their prefill request (the concurrent flow): they wait
	// for its Expect or Ready, by transfer, instead of being sent away to ask again.
	early map[kvtransfer.TransferID]chan struct{}
}

type waiterKey struct {
	transfer kvtransfer.TransferID
	consumer kvtransfer.ConsumerRank
}

// NewProducer validates cfg and builds the producer half; Serve starts it.
func NewProducer(cfg ProducerConfig) (*Producer, error) {
	if err := cfg.complete(); err != nil {
		return nil, err
	}
	if cfg.DataAddr == "" {
		return nil, errors.New("agent: a producer needs its data address")
	}
	if cfg.EngineID == "" {
		cfg.EngineID = "engine-" + randomID()[:12]
	}
	if cfg.Consumers <= 0 {
		cfg.Consumers = 1
	}
	if cfg.SendTimeout <= 0 {
		cfg.SendTimeout = time.Minute
	}
	p := &Producer{half: newHalf(), cfg: cfg, waiters: map[waiterKey]chan kvtransfer.Decision{}, early: map[kvtransfer.TransferID]chan struct{}{}}
	var err error
	p.core, err = kvtransfer.NewProducer(kvtransfer.ProducerConfig{
		Sink: kvtransfer.ReleaseFunc(p.onRelease), Rank: kvtransfer.ProducerRank(cfg.TPRank),
		HoldTimeout: cfg.HoldTimeout, ReadyTimeout: cfg.ReadyTimeout, TombstoneTTL: cfg.TombstoneTTL,
	})
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if p.metrics, err = newProducerMetrics(p, cfg.Metrics); err != nil {
		return nil, fmt.Errorf("agent: metrics: %w", err)
	}
	return p, nil
}

// EngineID is the producer's engine id in the bootstrap registry.
func (p *Producer) EngineID() string { return p.cfg.EngineID }

// Registration is this producer's entry in the bootstrap registry its engine serves.
func (p *Producer) Registration() bootstrap.Registration {
	return bootstrap.Registration{EngineID: p.cfg.EngineID, DPRank: p.cfg.DPRank, TPRank: p.cfg.TPRank, PPRank: p.cfg.PPRank, Addr: "tcp://" + p.cfg.DataAddr}
}

// Serve runs the producer until ctx ends: the data plane on data and the expiry loop. The HTTP
// side is Handler, served by the caller.
func (p *Producer) Serve(ctx context.Context, data net.Listener) error {
	if data == nil {
		return errors.New("agent: a producer needs a data listener")
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wg.Add(2)
	go func() {
		defer wg.Done()
		<-ctx.Done()
		data.Close()
	}()
	go func() {
		defer wg.Done()
		p.acceptPeers(ctx, data)
	}()
	p.runExpiry(ctx, p.cfg.Config, func() { p.dispatch(p.core.Expire()) })
	return nil
}

// Handler serves the producer's local API (expect, ready, abort, events), /healthz, /readyz and
// /metrics. gatherer is what /metrics serves.
func (p *Producer) Handler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	p.routes(mux, gatherer)
	op := func(op func(agentapi.Hold) []kvtransfer.Decision) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			var h agentapi.Hold
			if !decode(w, r, &h) {
				return
			}
			if h.Transfer == "" {
				http.Error(w, "transfer_id is required", http.StatusBadRequest)
				return
			}
			p.dispatch(op(h))
			writeJSON(w, agentapi.EpochReply{Epoch: p.epoch})
		}
	}
	mux.HandleFunc("POST "+agentapi.PathExpect, op(func(h agentapi.Hold) []kvtransfer.Decision {
		p.core.Expect(h.Transfer, h.Request)
		p.wakeEarly(h.Transfer)
		return nil
	}))
	mux.HandleFunc("POST "+agentapi.PathReady, op(func(h agentapi.Hold) []kvtransfer.Decision {
		d := p.core.Ready(h.Transfer, h.Request, h.Blocks)
		p.wakeEarly(h.Transfer)
		return d
	}))
	mux.HandleFunc("POST "+agentapi.PathAbort, op(func(h agentapi.Hold) []kvtransfer.Decision {
		return p.core.Abort(h.Transfer)
	}))
	return mux
}

// onRelease is the core's sink: releases queue for the engine.
func (p *Producer) onRelease(r kvtransfer.Release) {
	p.metrics.released(r)
	p.events.push(nil, &agentapi.Release{Request: r.Request, Transfer: r.Transfer, Blocks: r.Blocks, Reason: string(r.Reason)})
}

// dispatch hands decisions for parked pulls to the connections waiting for them.
func (p *Producer) dispatch(ds []kvtransfer.Decision) {
	for _, d := range ds {
		k := waiterKey{d.Pull.Transfer, d.Pull.Consumer}
		p.mu.Lock()
		ch, ok := p.waiters[k]
		delete(p.waiters, k)
		p.mu.Unlock()
		if ok {
			ch <- d // buffered: the waiting connection always takes it
			continue
		}
		// Nobody waits (cannot happen while every parked pull has a connection), but a send
		// decision must still end, or the transfer's blocks stay pinned.
		if d.Action == kvtransfer.ActionSend {
			p.core.SendDone(d.Pull.Transfer, d.Pull.Consumer, d.Pull.Consumers, errors.New("no connection for parked pull"))
		}
	}
}
