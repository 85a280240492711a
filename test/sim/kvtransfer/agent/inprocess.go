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

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
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

// InProcess is the half of the engine's role, run inside the stand-in engine's own process, as
// vLLM's connector worker runs its transfer engine: the KV memory is the process's own (a
// private file that dies with it), the local API is on a loopback port of the process, and a
// restarted engine starts with no transfer state, so no completion or KV of an earlier run can
// reach it.
type InProcess struct {
	// URL is the half's local API, for the engine's Link.
	URL string
	// KV is the engine's KV memory, shared with the half.
	KV *kvfile.File
	// Producer is the prefill engine's half; nil on a decode engine.
	Producer *Producer

	dir    string
	api    *http.Server
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
}

// InProcessConfig is what StartInProcess needs. It sets the KV, Log and Metrics of the half it
// starts, and a producer's DataAddr.
type InProcessConfig struct {
	Role vllm.KVRole
	// Producer configures a kv_producer's half, Consumer a kv_consumer's; their timeouts
	// default to vLLM's.
	Producer ProducerConfig
	Consumer ConsumerConfig
	Log      logr.Logger
	// Blocks and BlockBytes size the KV memory.
	Blocks, BlockBytes int
	// DataListen is where a producer's data plane binds (host:port; port 0 picks one, as
	// vLLM's transfer engine does), on the address consumers dial.
	DataListen string
	// KVFormat is the engine's KV format (Config.KVFormat).
	KVFormat string
}

// StartInProcess starts the half of cfg.Role for one engine process; Close stops it and frees
// its memory.
func StartInProcess(ctx context.Context, cfg InProcessConfig, reg prometheus.Registerer) (_ *InProcess, err error) {
	if cfg.Role != vllm.KVProducer && cfg.Role != vllm.KVConsumer {
		return nil, fmt.Errorf("agent: role must be %s or %s, got %q", vllm.KVProducer, vllm.KVConsumer, cfg.Role)
	}
	dir, err := os.MkdirTemp("", "kvtransfer-")
	if err != nil {
		return nil, fmt.Errorf("kv memory: %w", err)
	}
	p := &InProcess{dir: dir, done: make(chan struct{})}
	var data net.Listener
	defer func() {
		if err != nil {
			if data != nil {
				data.Close()
			}
			p.Close()
		}
	}()
	if p.KV, err = kvfile.Open(filepath.Join(dir, "kv.blocks"), cfg.Blocks, cfg.BlockBytes); err != nil {
		return nil, err
	}
	common := Config{KV: p.KV, Log: cfg.Log, Metrics: reg, KVFormat: cfg.KVFormat}
	var handler http.Handler
	var serve func(context.Context) error
	switch cfg.Role {
	case vllm.KVProducer:
		if cfg.DataListen == "" {
			return nil, errors.New("a producer needs the address its data plane binds")
		}
		pc := cfg.Producer
		pc.Config = common
		setDefault(&pc.HoldTimeout, DefaultHoldTimeout)
		setDefault(&pc.ReadyTimeout, DefaultReadyTimeout)
		setDefault(&pc.TombstoneTTL, DefaultTombstoneTTL)
		setDefault(&pc.SendTimeout, DefaultPullTimeout)
		if data, err = net.Listen("tcp", cfg.DataListen); err != nil {
			return nil, fmt.Errorf("transfer engine: %w", err)
		}
		pc.DataAddr = data.Addr().String()
		if p.Producer, err = NewProducer(pc); err != nil {
			return nil, err
		}
		handler = p.Producer.Handler(prometheus.NewRegistry())
		serve = func(ctx context.Context) error { return p.Producer.Serve(ctx, data) }
	case vllm.KVConsumer:
		cc := cfg.Consumer
		cc.Config = common
		setDefault(&cc.PullTimeout, DefaultPullTimeout)
		var consumer *Consumer
		if consumer, err = NewConsumer(cc); err != nil {
			return nil, err
		}
		handler = consumer.Handler(prometheus.NewRegistry())
		serve = consumer.Serve
	}
	local, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("agent api: %w", err)
	}
	p.URL = "http://" + local.Addr().String()
	p.api = &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = p.api.Serve(local) }()
	ctx, p.cancel = context.WithCancel(ctx)
	go func() {
		defer close(p.done)
		if err := serve(ctx); err != nil && cfg.Log.GetSink() != nil {
			cfg.Log.Error(err, "in-process transfer engine stopped")
		}
	}()
	return p, nil
}

// Registry is the bootstrap registry a producer engine serves (vLLM's Mooncake bootstrap
// server, or the NIXL side channel), with this worker registered: it takes only the engine's
// own dp x tp x pp ranks, each at its own address (vLLM takes anything).
func (p *InProcess) Registry(dp, tp, pp int) (*bootstrap.Registry, error) {
	if p.Producer == nil {
		return nil, errors.New("agent: only a kv_producer's transfer engine registers in a bootstrap registry")
	}
	r := bootstrap.NewRegistry()
	r.Limits = bootstrap.RegistryLimits{DP: max(dp, 1), TP: max(tp, 1), PP: max(pp, 1), SameHost: true}
	if err := r.Register(p.Producer.Registration()); err != nil {
		return nil, fmt.Errorf("register the transfer engine: %w", err)
	}
	return r, nil
}

// Close stops the half and frees its KV memory.
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
