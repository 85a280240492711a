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

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/connector"
	"pdcluster.dev/pdcluster-operator/connector/agent"
	"pdcluster.dev/pdcluster-operator/connector/kvfile"
)

func main() {
	var cfg agent.Config
	var role, listen, dataListen, kvPath string
	var blocks, blockBytes, consumerRank int
	flag.StringVar(&role, "role", "", "kv_producer (prefill) or kv_consumer (decode)")
	flag.StringVar(&listen, "listen", "127.0.0.1:7100", "HTTP address: local engine API, /healthz, /readyz, /metrics and, on a producer that hosts it, the bootstrap registry (/register, /query)")
	flag.StringVar(&dataListen, "data-listen", "127.0.0.1:7200", "TCP address of the data plane (producer)")
	flag.StringVar(&cfg.DataAddr, "advertise-data", "", "data-plane address consumers dial (default: --data-listen)")
	flag.StringVar(&kvPath, "kv-file", "", "KV-cache file shared with the engine")
	flag.IntVar(&blocks, "kv-blocks", 0, "KV blocks in the file")
	flag.IntVar(&blockBytes, "block-bytes", 4096, "bytes per KV block")
	flag.StringVar(&cfg.EngineID, "engine-id", "", "producer engine id (default: a fresh id per start)")
	flag.StringVar(&cfg.Bootstrap, "bootstrap", "", "bootstrap registry to register with (http://host:port); empty: serve it here")
	flag.IntVar(&cfg.DPRank, "dp-rank", 0, "producer data-parallel rank")
	flag.IntVar(&cfg.TPRank, "tp-rank", 0, "producer tensor-parallel rank")
	flag.IntVar(&cfg.PPRank, "pp-rank", 0, "producer pipeline-parallel rank")
	flag.IntVar(&consumerRank, "consumer-rank", 0, "consumer tensor-parallel rank")
	flag.IntVar(&cfg.Consumers, "consumers", 1, "consumer ranks that pull each transfer from each producer worker")
	flag.DurationVar(&cfg.HoldTimeout, "hold-timeout", 480*time.Second, "free held blocks no consumer came for after this long")
	flag.DurationVar(&cfg.ReadyTimeout, "ready-timeout", 480*time.Second, "how long a pull may wait for prefill to finish")
	flag.DurationVar(&cfg.PullTimeout, "pull-timeout", 540*time.Second, "fail a pull after this long (longer than the producer's ready timeout)")
	flag.DurationVar(&cfg.TombstoneTTL, "tombstone-ttl", 600*time.Second, "remember released transfers this long, to answer late pulls")
	flag.DurationVar(&cfg.UnknownTransferGrace, "unknown-transfer-grace", 10*time.Second, "how long a consumer retries a pull the producer has not heard of yet")
	flag.DurationVar(&cfg.SendDelay, "send-delay", 0, "delay before each block sent (simulates a slow link)")
	flag.BoolVar(&cfg.UngatedCompletions, "unsafe-ungated-completions", false, "reproduce the seed bug: report notify-only pulls as finished receiving (kills vLLM)")
	zo := zap.Options{}
	zo.BindFlags(flag.CommandLine)
	flag.Parse()
	log := zap.New(zap.UseFlagOptions(&zo)).WithValues("role", role)
	if err := run(cfg, role, listen, dataListen, kvPath, blocks, blockBytes, consumerRank, log); err != nil {
		log.Error(err, "connector agent failed")
		os.Exit(1)
	}
}

func run(cfg agent.Config, role, listen, dataListen, kvPath string, blocks, blockBytes, consumerRank int, log interface {
	Info(string, ...any)
}) error {
	if kvPath == "" || blocks <= 0 {
		return errors.New("--kv-file and --kv-blocks are required")
	}
	kv, err := kvfile.Open(kvPath, blocks, blockBytes)
	if err != nil {
		return err
	}
	defer kv.Close()
	cfg.Role, cfg.KV, cfg.ConsumerRank = agent.Role(role), kv, connector.ConsumerRank(consumerRank)
	var data net.Listener
	if cfg.Role == agent.RoleProducer {
		if data, err = net.Listen("tcp", dataListen); err != nil {
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
	hl, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("http: %w", err)
	}
	srv := &http.Server{Handler: a.Handler(reg), ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() { _ = srv.Serve(hl) }()
	log.Info("connector agent serving", "http", hl.Addr().String(), "data", cfg.DataAddr, "engineID", a.EngineID(), "epoch", a.Epoch())
	err = a.Serve(ctx, data)
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdown)
	return err
}
