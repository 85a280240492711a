package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/connector/bootstrap"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/kvfile"
)

// Defaults of the transfer engine's timeouts, as vLLM's Mooncake connector has them
// (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT 480 s; a pull gives up after 540 s).
const (
	DefaultHoldTimeout  = 480 * time.Second
	DefaultReadyTimeout = 480 * time.Second
	DefaultPullTimeout  = 540 * time.Second
	DefaultTombstoneTTL = 600 * time.Second
)

// InProcess is an agent run inside the stand-in engine's own process, as vLLM's connector
// worker runs its transfer engine: the KV memory is the process's own (a private file that
// dies with it), the local API is on a loopback port of the process, and a restarted engine
// starts with no transfer state, so no completion or KV of an earlier run can reach it.
type InProcess struct {
	// URL is the agent's local API, for the engine's Link.
	URL string
	// KV is the engine's KV memory, shared with the agent.
	KV *kvfile.File
	// Agent is the agent; on a producer Agent.registration() is what the engine registers.
	Agent *Agent

	dir    string
	api    *http.Server
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
}

// InProcessConfig is what StartInProcess needs beyond the agent's Config (whose KV,
// DataAddr and EngineRegisters it sets).
type InProcessConfig struct {
	Agent Config
	// Blocks and BlockBytes size the KV memory.
	Blocks, BlockBytes int
	// DataListen is where a producer's data plane binds (host:port; port 0 picks one, as
	// vLLM's transfer engine does), on the address consumers dial.
	DataListen string
}

// StartInProcess starts an agent for one engine process; Close stops it and frees its memory.
func StartInProcess(ctx context.Context, cfg InProcessConfig, reg prometheus.Registerer) (_ *InProcess, err error) {
	dir, err := os.MkdirTemp("", "kvtransfer-")
	if err != nil {
		return nil, fmt.Errorf("kv memory: %w", err)
	}
	p := &InProcess{dir: dir, done: make(chan struct{})}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	if p.KV, err = kvfile.Open(filepath.Join(dir, "kv.blocks"), cfg.Blocks, cfg.BlockBytes); err != nil {
		return nil, err
	}
	ac := cfg.Agent
	ac.KV, ac.Metrics = p.KV, reg
	setDefault(&ac.HoldTimeout, DefaultHoldTimeout)
	setDefault(&ac.ReadyTimeout, DefaultReadyTimeout)
	setDefault(&ac.PullTimeout, DefaultPullTimeout)
	setDefault(&ac.TombstoneTTL, DefaultTombstoneTTL)
	var data net.Listener
	if ac.Role == vllm.KVProducer {
		if cfg.DataListen == "" {
			return nil, errors.New("a producer needs the address its data plane binds")
		}
		if data, err = net.Listen("tcp", cfg.DataListen); err != nil {
			return nil, fmt.Errorf("transfer engine: %w", err)
		}
		ac.DataAddr = data.Addr().String()
		if ac.Bootstrap == "" {
			ac.EngineRegisters = true // the engine serves the bootstrap server and registers it
		}
	}
	if p.Agent, err = New(ac); err != nil {
		if data != nil {
			data.Close()
		}
		return nil, err
	}
	local, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		if data != nil {
			data.Close()
		}
		return nil, fmt.Errorf("agent api: %w", err)
	}
	p.URL = "http://" + local.Addr().String()
	p.api = &http.Server{Handler: p.Agent.Handler(prometheus.NewRegistry()), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = p.api.Serve(local) }()
	ctx, p.cancel = context.WithCancel(ctx)
	go func() {
		defer close(p.done)
		if err := p.Agent.Serve(ctx, data); err != nil && ac.Log.GetSink() != nil {
			ac.Log.Error(err, "in-process transfer agent stopped")
		}
	}()
	return p, nil
}

// Registration is what a producer engine registers in its bootstrap server.
func (p *InProcess) Registration() bootstrap.Registration { return p.Agent.registration() }

// Close stops the agent and frees its KV memory.
func (p *InProcess) Close() {
	p.once.Do(func() {
		if p.cancel != nil {
			p.cancel()
			<-p.done
		}
		if p.api != nil {
			_ = p.api.Close()
		}
		if p.KV != nil {
			p.KV.Close()
		}
		_ = os.RemoveAll(p.dir)
	})
}

func setDefault(d *time.Duration, def time.Duration) {
	if *d <= 0 {
		*d = def
	}
}
