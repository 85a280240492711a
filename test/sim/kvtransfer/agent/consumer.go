package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
)

// ConsumerConfig configures the decode engine's half.
type ConsumerConfig struct {
	Config
	// Rank is this consumer's rank and Consumers how many consumer ranks pull each transfer
	// from each producer worker (the TP fan-in).
	Rank      kvtransfer.ConsumerRank
	Consumers int
	// PullTimeout fails a pull not done after this long (the connector core's timeout).
	PullTimeout time.Duration
	// UnknownTransferGrace is how long a consumer asks again when the producer has not heard
	// of the transfer yet (the prefill leg is still on its way).
	UnknownTransferGrace time.Duration
	// UngatedCompletions reproduces the seed bug: drained notify-only pulls are reported to the
	// scheduler as finished receiving (fault injection, to demonstrate the failure).
	UngatedCompletions bool
	// OnTransfer, when set, hears each pull task that moved blocks: how long the blocks took
	// from the first to the result, and how many bytes (vLLM's connectors record the same
	// per transfer in vllm:<connector>_xfer_time_seconds and _bytes_transferred).
	OnTransfer func(d time.Duration, bytes int)
}

// Consumer is the decode engine's half: it pulls the blocks of each request from its
// producer's workers into the engine's KV memory and reports the pulls the scheduler waits for.
type Consumer struct {
	half
	cfg     ConsumerConfig
	core    *kvtransfer.Puller
	metrics *consumerMetrics
	boot    *bootstrap.Client
	dialer  net.Dialer
	conns   peerConns
}

// NewConsumer validates cfg and builds the consumer half; Serve starts it.
func NewConsumer(cfg ConsumerConfig) (*Consumer, error) {
	if err := cfg.complete(); err != nil {
		return nil, err
	}
	if cfg.Consumers <= 0 {
		cfg.Consumers = 1
	}
	if cfg.UnknownTransferGrace <= 0 {
		cfg.UnknownTransferGrace = 10 * time.Second
	}
	c := &Consumer{half: newHalf(), cfg: cfg, boot: bootstrap.NewClient()}
	c.dialer.Timeout = 5 * time.Second
	var err error
	if c.core, err = kvtransfer.NewPuller(kvtransfer.PullerConfig{Sink: kvtransfer.CompletionFunc(c.onCompletion), Timeout: cfg.PullTimeout}); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if c.metrics, err = newConsumerMetrics(c, cfg.Metrics); err != nil {
		return nil, fmt.Errorf("agent: metrics: %w", err)
	}
	return c, nil
}

// Serve runs the consumer's expiry loop until ctx ends; pulls run from Handler's requests.
func (c *Consumer) Serve(ctx context.Context) error {
	defer c.conns.closeAll()
	c.runExpiry(ctx, c.cfg.Config, func() { c.core.Expire() })
	return nil
}

// Handler serves the consumer's local API (pulls, events), /healthz, /readyz and /metrics.
// gatherer is what /metrics serves.
func (c *Consumer) Handler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	c.routes(mux, gatherer)
	mux.HandleFunc("POST "+agentapi.PathPulls, func(w http.ResponseWriter, r *http.Request) {
		var p agentapi.Pull
		if !decode(w, r, &p) {
			return
		}
		if p.Request == "" || p.Transfer == "" {
			http.Error(w, "request_id and transfer_id are required", http.StatusBadRequest)
			return
		}
		if err := c.startPull(r.Context(), p.Meta()); err != nil {
			status := http.StatusInternalServerError
			if errors.Is(err, kvtransfer.ErrDuplicateRequest) {
				status = http.StatusConflict
			}
			http.Error(w, err.Error(), status)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		_ = json.NewEncoder(w).Encode(agentapi.EpochReply{Epoch: c.epoch})
	})
	return mux
}

// onCompletion is the core's sink: completions queue for the engine.
func (c *Consumer) onCompletion(comp kvtransfer.Completion) {
	c.metrics.completed(comp)
	c.events.push(agentapi.CompletionOf(comp), nil)
}
