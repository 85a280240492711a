// Command connector is the connector agent run beside each engine (see connector/agent).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector"
	"pdcluster.dev/pdcluster-operator/connector/agent"
	"pdcluster.dev/pdcluster-operator/connector/kvfile"
	"pdcluster.dev/pdcluster-operator/connector/localapi"
)

// options are the command-line settings besides the agent's own Config.
type options struct {
	role, listen, publicListen, dataListen, kvPath string
	blocks, blockBytes, consumerRank               int
	zap                                            zap.Options
}

// parseFlags is separate from main so a test can check that the arguments the operator renders
// for the sidecar are ones this command accepts.
func parseFlags(args []string) (agent.Config, options, error) {
	var cfg agent.Config
	var o options
	fs := flag.NewFlagSet("connector", flag.ContinueOnError)
	fs.StringVar(&o.role, "role", "", "kv_producer (prefill) or kv_consumer (decode)")
	fs.StringVar(&o.listen, "listen", "127.0.0.1:7100", "local engine API (and /healthz, /readyz, /metrics and, on a producer that hosts it, the bootstrap registry /register, /query): host:port or unix:///path/to/socket")
	fs.StringVar(&o.publicListen, "public-listen", "", "HTTP address other pods and the kubelet reach: /healthz, /readyz, /metrics and, on a producer that hosts it, the bootstrap registry (the local API stays on --listen); empty: none")
	fs.StringVar(&o.dataListen, "data-listen", "127.0.0.1:7200", "TCP address of the data plane (producer)")
	fs.StringVar(&cfg.DataAddr, "advertise-data", "", "data-plane address consumers dial (default: --data-listen)")
	fs.StringVar(&o.kvPath, "kv-file", "", "KV-cache file shared with the engine")
	fs.IntVar(&o.blocks, "kv-blocks", 0, "KV blocks in the file")
	fs.IntVar(&o.blockBytes, "block-bytes", 4096, "bytes per KV block")
	fs.StringVar(&cfg.EngineID, "engine-id", "", "producer engine id (default: a fresh id per start)")
	fs.StringVar(&cfg.Bootstrap, "bootstrap", "", "bootstrap registry to register with (http://host:port); empty: serve it here, unless --engine-registers")
	fs.BoolVar(&cfg.EngineRegisters, "engine-registers", false, "producer: the engine serves the bootstrap server (vLLM binds VLLM_MOONCAKE_BOOTSTRAP_PORT itself) and registers this agent from GET /v1/info; serve and register nothing here")
	fs.IntVar(&cfg.DPRank, "dp-rank", 0, "producer data-parallel rank")
	fs.IntVar(&cfg.TPRank, "tp-rank", 0, "producer tensor-parallel rank")
	fs.IntVar(&cfg.PPRank, "pp-rank", 0, "producer pipeline-parallel rank")
	fs.IntVar(&o.consumerRank, "consumer-rank", 0, "consumer tensor-parallel rank")
	fs.IntVar(&cfg.Consumers, "consumers", 1, "consumer ranks that pull each transfer from each producer worker")
	fs.DurationVar(&cfg.HoldTimeout, "hold-timeout", 480*time.Second, "free held blocks no consumer came for after this long")
	fs.DurationVar(&cfg.ReadyTimeout, "ready-timeout", 480*time.Second, "how long a pull may wait for prefill to finish")
	fs.DurationVar(&cfg.PullTimeout, "pull-timeout", 540*time.Second, "fail a pull after this long (longer than the producer's ready timeout)")
	fs.DurationVar(&cfg.TombstoneTTL, "tombstone-ttl", 600*time.Second, "remember released transfers this long, to answer late pulls")
	fs.DurationVar(&cfg.UnknownTransferGrace, "unknown-transfer-grace", 10*time.Second, "how long a consumer retries a pull the producer has not heard of yet")
	fs.DurationVar(&cfg.SendDelay, "send-delay", 0, "delay before each block sent (simulates a slow link)")
	fs.BoolVar(&cfg.UngatedCompletions, "unsafe-ungated-completions", false, "reproduce the seed bug: report notify-only pulls as finished receiving (kills vLLM)")
	fs.BoolVar(&cfg.Gate.Required, "require-gate", false, "be unready unless the engine's completion gate (the pdgate vLLM plugin) heartbeats on the local API")
	fs.DurationVar(&cfg.Gate.StartupGrace, "gate-startup-grace", 15*time.Minute, "with --require-gate: how long after start the gate may stay silent (model loading)")
	fs.DurationVar(&cfg.Gate.HeartbeatTimeout, "gate-heartbeat-timeout", 30*time.Second, "with --require-gate: how stale the gate's last heartbeat may be")
	o.zap.BindFlags(fs)
	err := fs.Parse(args)
	return cfg, o, err
}

func main() {
	cfg, o, err := parseFlags(os.Args[1:])
	if err != nil {
		os.Exit(2) // the FlagSet printed why
	}
	log := zap.New(zap.UseFlagOptions(&o.zap)).WithValues("role", o.role)
	if err := run(cfg, o, log); err != nil {
		log.Error(err, "connector agent failed")
		os.Exit(1)
	}
}

// withRun is cfg with what run adds to the flags: the role, the KV file, the consumer rank and
// the logger (without which the agent logs nothing after its start line).
func withRun(cfg agent.Config, o options, kv *kvfile.File, log logr.Logger) agent.Config {
	cfg.Role, cfg.KV, cfg.ConsumerRank, cfg.Log = v1alpha1.KVRole(o.role), kv, connector.ConsumerRank(o.consumerRank), log
	return cfg
}

func run(cfg agent.Config, o options, log logr.Logger) error {
	if o.kvPath == "" || o.blocks <= 0 {
		return errors.New("--kv-file and --kv-blocks are required")
	}
	kv, err := kvfile.Open(o.kvPath, o.blocks, o.blockBytes)
	if err != nil {
		return err
	}
	defer kv.Close()
	cfg = withRun(cfg, o, kv, log)
	var data net.Listener
	if cfg.Role == v1alpha1.KVProducer {
		if data, err = net.Listen("tcp", o.dataListen); err != nil {
			return fmt.Errorf("data plane: %w", err)
		}
		if cfg.DataAddr == "" {
			cfg.DataAddr = data.Addr().String()
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg.Metrics = reg
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	servers := []struct {
		addr    string
		handler http.Handler
	}{{o.listen, a.Handler(reg)}, {o.publicListen, a.PublicHandler(reg)}}
	var running []*http.Server
	defer func() {
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, srv := range running {
			_ = srv.Shutdown(shutdown)
		}
	}()
	for _, s := range servers {
		if s.addr == "" {
			continue
		}
		l, err := localapi.Listen(s.addr)
		if err != nil {
			return fmt.Errorf("http %s: %w", s.addr, err)
		}
		srv := &http.Server{Handler: s.handler, ReadHeaderTimeout: 10 * time.Second}
		running = append(running, srv)
		go func() { _ = srv.Serve(l) }()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log.Info("connector agent serving", "http", o.listen, "public", o.publicListen, "data", cfg.DataAddr, "engineID", a.EngineID(), "epoch", a.Epoch())
	return a.Serve(ctx, data)
}
