// Package agent is the stand-in engines' transfer engine, run in the engine's own process
// (inprocess.go), in two halves: the prefill engine's Producer (producer.go) serves pulls on
// its data plane (producer_serve.go), the decode engine's Consumer (consumer.go) pulls KV
// blocks over TCP (consumer_pull.go) on kept data connections (consumer_conns.go), both with
// the frames of wire.go. Each half owns its connector core (kvtransfer.Producer or
// kvtransfer.Puller), serves only its own routes of the local API its engine calls
// (test/sim/kvtransfer/link), and queues its reports for the engine (api.go). The engine
// serves the bootstrap registry the producer is registered in, as vLLM's does.
package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/kvfile"
)

// Config is what both halves need.
type Config struct {
	// KV is the engine's KV-cache memory.
	KV *kvfile.File
	// ExpireEvery is how often deadlines are checked.
	ExpireEvery time.Duration
	Log         logr.Logger
	// Metrics is where the half registers its collectors; nil means a private registry.
	Metrics prometheus.Registerer
	// KVFormat names the layout of the engine's KV (model, dtypes, block size, sharding, the
	// engine's version): a consumer of another format cannot read this one's blocks, and a
	// pull across formats fails loudly. Empty: not checked.
	KVFormat string
}

// complete checks c and fills its defaults.
func (c *Config) complete() error {
	if c.KV == nil {
		return errors.New("agent: a KV file is required")
	}
	if c.ExpireEvery <= 0 {
		c.ExpireEvery = 100 * time.Millisecond
	}
	if c.Metrics == nil {
		c.Metrics = prometheus.NewRegistry()
	}
	return nil
}

// half is what the two halves share: the run's epoch, the reports the engine drains, and
// readiness.
type half struct {
	epoch  string
	events *eventQueue
	ready  atomic.Bool
}

func newHalf() half { return half{epoch: randomID(), events: newEventQueue()} }

// Epoch identifies this run of the agent; an engine that sees it change knows the agent's state
// (pulls in flight, held transfers) was lost.
func (h *half) Epoch() string { return h.epoch }

// runExpiry marks the half ready, then calls expire every cfg.ExpireEvery until ctx ends.
func (h *half) runExpiry(ctx context.Context, cfg Config, expire func()) {
	h.ready.Store(true)
	t := time.NewTicker(cfg.ExpireEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			expire()
		}
	}
}

func randomID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
