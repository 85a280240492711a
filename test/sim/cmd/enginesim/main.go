// Command enginesim is an OpenAI-compatible engine simulator with vLLM's P/D request states
// (see test/sim/enginesim), for the sandbox. Its KV transfer engine runs in this process
// (test/sim/kvtransfer), as vLLM's does: a prefill engine serves its own bootstrap registry
// (--bootstrap-listen) and registers its data plane there; the transfer engine's counters are on
// /metrics.
package main

import (
	"context"
	"encoding/json"
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
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/enginesim"
	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agent"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmsched"
)

type options struct {
	listen, role, policy, bootstrapListen, dataListen string
	kvEvents                                          string
	blockBytes                                        int
	transfer                                          agent.InProcessConfig
}

func main() {
	var cfg enginesim.Config
	var o options
	flag.StringVar(&o.listen, "listen", "127.0.0.1:8000", "HTTP address of the OpenAI API (and /metrics)")
	flag.StringVar(&cfg.Model, "model", "sim/model", "served model name")
	flag.StringVar(&o.role, "kv-role", "", "kv_producer, kv_consumer, or empty for an engine without P/D")
	flag.IntVar(&cfg.BlockSize, "block-size", 16, "tokens per KV block")
	flag.IntVar(&cfg.Capacity, "kv-blocks", 4096, "KV-cache capacity in blocks")
	flag.IntVar(&o.blockBytes, "block-bytes", 4096, "bytes of simulated KV per block")
	flag.StringVar(&o.bootstrapListen, "bootstrap-listen", "", "producer: address of its bootstrap registry (vLLM's Mooncake bootstrap server)")
	flag.StringVar(&o.dataListen, "data-listen", "127.0.0.1:0", "producer: address of its transfer engine's data plane (port 0: the kernel picks)")
	flag.DurationVar(&o.transfer.Producer.HoldTimeout, "hold-timeout", agent.DefaultHoldTimeout, "producer: free held blocks no consumer came for after this long")
	flag.DurationVar(&o.transfer.Producer.ReadyTimeout, "ready-timeout", agent.DefaultReadyTimeout, "producer: how long a pull may wait for prefill to finish")
	flag.DurationVar(&o.transfer.Producer.TombstoneTTL, "tombstone-ttl", agent.DefaultTombstoneTTL, "producer: remember released transfers this long")
	flag.DurationVar(&o.transfer.Consumer.PullTimeout, "pull-timeout", agent.DefaultPullTimeout, "consumer: fail a pull after this long")
	flag.DurationVar(&o.transfer.Producer.SendDelay, "send-delay", 0, "producer: delay before each block sent (a slow link)")
	flag.BoolVar(&o.transfer.Consumer.UngatedCompletions, "unsafe-ungated-completions", false, "consumer: reproduce the seed bug, report notify-only pulls as finished receiving (kills the engine)")
	flag.IntVar(&cfg.MaxModelLen, "max-model-len", 0, "maximum prompt plus output tokens (default: the KV capacity)")
	flag.IntVar(&cfg.MaxNumSeqs, "max-num-seqs", 0, "requests that run at once; the rest wait (0: only the KV capacity limits them)")
	flag.BoolVar(&cfg.PrefixCaching, "enable-prefix-caching", true, "reuse KV of prompt prefixes seen before")
	flag.StringVar(&o.policy, "kv-load-failure-policy", "fail", "fail or recompute, on a failed KV load")
	flag.DurationVar(&cfg.StepTime, "step-time", 2*time.Millisecond, "simulated time of one decode step")
	flag.StringVar(&o.kvEvents, "kv-events-config", "", "vLLM's KVEventsConfig as JSON: with enable_kv_cache_events, publish the prefix cache's changes as vLLM does")
	zo := zap.Options{}
	zo.BindFlags(flag.CommandLine)
	flag.Parse()
	log := zap.New(zap.UseFlagOptions(&zo)).WithValues("kvRole", o.role)
	cfg.Log = log
	cfg.Role, cfg.Policy = vllm.KVRole(o.role), vllmsched.Policy(o.policy)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, o); err != nil {
		log.Error(err, "engine failed")
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg enginesim.Config, o options) error {
	switch cfg.Role {
	case "", vllm.KVProducer, vllm.KVConsumer:
	default:
		return errors.New("--kv-role must be kv_producer, kv_consumer or empty")
	}
	if cfg.Policy != vllmsched.PolicyFail && cfg.Policy != vllmsched.PolicyRecompute {
		return errors.New("--kv-load-failure-policy must be fail or recompute")
	}
	if o.kvEvents != "" {
		var ev vllm.KVEventsConfig
		if err := json.Unmarshal([]byte(o.kvEvents), &ev); err != nil {
			return fmt.Errorf("--kv-events-config: %w", err)
		}
		p, err := kvpublish.ForRank(ev, 0)
		if err != nil {
			return err
		}
		if p != nil {
			defer p.Close()
			cfg.Events = p
		}
	}
	metrics := prometheus.NewRegistry()
	if cfg.Role != "" {
		o.transfer.Role, o.transfer.Log = cfg.Role, cfg.Log.WithName("transfer")
		o.transfer.Blocks, o.transfer.BlockBytes, o.transfer.DataListen = cfg.Capacity, o.blockBytes, o.dataListen
		transfer, err := agent.StartInProcess(ctx, o.transfer, metrics)
		if err != nil {
			return err
		}
		defer transfer.Close()
		cfg.Agent, cfg.KV = transfer.URL, transfer.KV
		if cfg.Role == vllm.KVProducer {
			if o.bootstrapListen == "" {
				return errors.New("--bootstrap-listen is required with --kv-role=kv_producer")
			}
			registry, err := transfer.Registry(1, 1, 1) // one worker, on this host
			if err != nil {
				return err
			}
			l, err := net.Listen("tcp", o.bootstrapListen)
			if err != nil {
				return fmt.Errorf("bootstrap registry: %w", err)
			}
			boot := &http.Server{Handler: registry.Handler(), ReadHeaderTimeout: 10 * time.Second}
			go func() { _ = boot.Serve(l) }()
			defer boot.Close()
			cfg.BootstrapAddr = "http://" + l.Addr().String()
		}
	}
	e, err := enginesim.New(cfg)
	if err != nil {
		return err
	}
	if err := metrics.Register(enginesim.Collector(e)); err != nil {
		return err
	}
	go e.Run(ctx)
	mux := http.NewServeMux()
	mux.Handle("/", e.Handler())
	mux.Handle("GET /metrics", promhttp.HandlerFor(metrics, promhttp.HandlerOpts{}))
	srv := &http.Server{Addr: o.listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(c)
	}()
	cfg.Log.Info("engine serving", "listen", o.listen, "blockSize", cfg.BlockSize, "kvBlocks", cfg.Capacity, "bootstrap", cfg.BootstrapAddr)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
