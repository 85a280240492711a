// Command enginesim is an OpenAI-compatible engine simulator with vLLM's P/D request states
// (see test/sim/enginesim).
package main

import (
	"context"
	"errors"
	"flag"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/kvfile"
	"pdcluster.dev/pdcluster-operator/test/sim/enginesim"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmsched"
)

func main() {
	var cfg enginesim.Config
	var listen, role, kvPath, policy string
	var blockBytes int
	flag.StringVar(&listen, "listen", "127.0.0.1:8000", "HTTP address of the OpenAI API")
	flag.StringVar(&cfg.Model, "model", "sim/model", "served model name")
	flag.StringVar(&role, "kv-role", "", "kv_producer, kv_consumer, or empty for an engine without P/D")
	flag.IntVar(&cfg.BlockSize, "block-size", 16, "tokens per KV block")
	flag.IntVar(&cfg.Capacity, "kv-blocks", 4096, "KV-cache capacity in blocks")
	flag.IntVar(&blockBytes, "block-bytes", 4096, "bytes of simulated KV per block")
	// In a PDCluster pod the operator sets both in the engine's environment.
	flag.StringVar(&kvPath, "kv-file", os.Getenv("PDCLUSTER_KV_FILE"), "KV-cache file shared with the connector agent (required with --kv-role; default $PDCLUSTER_KV_FILE)")
	flag.StringVar(&cfg.Agent, "agent", envOr("PDCLUSTER_CONNECTOR_URL", "http://127.0.0.1:7100"), "connector agent's local API (default $PDCLUSTER_CONNECTOR_URL)")
	flag.StringVar(&cfg.BootstrapAddr, "bootstrap-addr", "", "this producer's bootstrap registry as consumers reach it")
	flag.IntVar(&cfg.MaxModelLen, "max-model-len", 0, "maximum prompt plus output tokens (default: the KV capacity)")
	flag.BoolVar(&cfg.PrefixCaching, "enable-prefix-caching", true, "reuse KV of prompt prefixes seen before")
	flag.StringVar(&policy, "kv-load-failure-policy", "fail", "fail or recompute, on a failed KV load")
	flag.DurationVar(&cfg.StepTime, "step-time", 2*time.Millisecond, "simulated time of one decode step")
	zo := zap.Options{}
	zo.BindFlags(flag.CommandLine)
	flag.Parse()
	log := zap.New(zap.UseFlagOptions(&zo)).WithValues("kvRole", role)
	cfg.Log = log
	cfg.Role, cfg.Policy = v1alpha1.KVRole(role), vllmsched.Policy(policy)
	if err := run(cfg, listen, kvPath, blockBytes); err != nil {
		log.Error(err, "engine failed")
		os.Exit(1)
	}
}

func run(cfg enginesim.Config, listen, kvPath string, blockBytes int) error {
	switch cfg.Role {
	case "", v1alpha1.KVProducer, v1alpha1.KVConsumer:
	default:
		return errors.New("--kv-role must be kv_producer, kv_consumer or empty")
	}
	if cfg.Policy != vllmsched.PolicyFail && cfg.Policy != vllmsched.PolicyRecompute {
		return errors.New("--kv-load-failure-policy must be fail or recompute")
	}
	if cfg.Role != "" {
		if kvPath == "" {
			return errors.New("--kv-file is required with --kv-role")
		}
		kv, err := kvfile.Open(kvPath, cfg.Capacity, blockBytes)
		if err != nil {
			return err
		}
		defer kv.Close()
		cfg.KV = kv
	}
	e, err := enginesim.New(cfg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go e.Run(ctx)
	srv := &http.Server{Addr: listen, Handler: e.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(c)
	}()
	cfg.Log.Info("engine serving", "listen", listen, "blockSize", cfg.BlockSize, "kvBlocks", cfg.Capacity)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
