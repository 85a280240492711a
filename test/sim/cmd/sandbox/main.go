// Command sandbox runs a complete P/D deployment on this machine, as processes on loopback: for
// each prefill and decode engine an engine simulator (its KV transfer engine in-process) with
// the connector sidecar beside it, and a router on --listen. It serves until interrupted.
// Processes that exit are restarted with backoff; logs, sidecar sockets and sandbox.json (the addresses and PIDs) are in --work-dir. It never ships: the
// engines it runs are simulators.
//
//	sandbox --listen 127.0.0.1:8080 --block-size 64 --prefill 2 --decode 1
//	curl -s 127.0.0.1:8080/v1/completions -d '{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13],"max_tokens":32,"ignore_eos":true}'
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	cfg := sandbox.Config{}
	fs := flag.NewFlagSet("sandbox", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:8080", "router address")
	fs.IntVar(&cfg.BlockSize, "block-size", 16, "tokens per KV block")
	fs.IntVar(&cfg.Prefill, "prefill", 1, "prefill engines")
	fs.IntVar(&cfg.Decode, "decode", 1, "decode engines")
	fs.IntVar(&cfg.KVBlocks, "kv-blocks", 2048, "KV blocks per engine")
	fs.IntVar(&cfg.BlockBytes, "block-bytes", 1024, "bytes of simulated KV per block")
	fs.StringVar((*string)(&cfg.Flow), "flow", "mooncake", "transfer flow: mooncake (both legs at once) or nixl (prefill first)")
	fs.StringVar(&cfg.Policy, "kv-load-failure-policy", "fail", "decode engines' policy on a failed KV load: fail or recompute")
	fs.DurationVar(&cfg.StepTime, "step-time", time.Millisecond, "simulated time of one decode step")
	fs.DurationVar(&cfg.SlowStepTime, "slow-step-time", 0, "step time of the first engine of each pool (a slow engine; 0: as the others)")
	fs.StringVar(&cfg.Balance, "balance", "", "the router's balance (default: the router's default)")
	fs.StringVar((*string)(&cfg.Routing), "routing", "", "the router's routing strategy: LeastInFlight, PrefixAware or KVEvents (default: the router's default)")
	cfg.RouterFailure = routerconfig.DefaultFailurePolicy()
	fp := &cfg.RouterFailure
	fs.Var(int32Flag{&fp.Retries}, "router-retries", "the router's failurePolicy.retries")
	fs.Var(int32Flag{&fp.RetryBudgetPercent}, "router-retry-budget-percent", "the router's failurePolicy.retryBudgetPercent")
	fs.Var(int32Flag{&fp.EjectSeconds}, "router-eject-seconds", "the router's failurePolicy.ejectSeconds")
	fs.Var(int32Flag{&fp.FirstTokenTimeoutSeconds}, "router-first-token-timeout-seconds", "the router's failurePolicy.firstTokenTimeoutSeconds (0: no limit)")
	fs.StringVar((*string)(&fp.OnPrefillFailure), "on-prefill-failure", string(fp.OnPrefillFailure), "the router's failurePolicy.onPrefillFailure: Retry, Fail or DecodeOnly")
	fs.DurationVar(&cfg.SendDelay, "send-delay", 0, "delay per KV block sent (a slow link)")
	fs.DurationVar(&cfg.HoldTimeout, "hold-timeout", 30*time.Second, "producer hold and ready timeout")
	fs.DurationVar(&cfg.PullTimeout, "pull-timeout", 40*time.Second, "consumer pull timeout")
	fs.BoolVar(&cfg.UngatedCompletions, "unsafe-ungated-completions", false, "run the decode engines' transfer engines with the seed bug (to watch the engine die)")
	fs.StringVar(&cfg.BinDir, "bin-dir", "", "directory of the connector, enginesim and router binaries (default: beside this one)")
	fs.StringVar(&cfg.WorkDir, "work-dir", "", "directory for logs, KV files and sandbox.json (default: a new temporary directory)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if cfg.BinDir == "" {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		cfg.BinDir = filepath.Dir(exe)
	}
	if cfg.WorkDir == "" {
		dir, err := os.MkdirTemp("", "pdcluster-sandbox-")
		if err != nil {
			return err
		}
		cfg.WorkDir = dir
	}
	zo := zap.Options{Development: true}
	cfg.Log = zap.New(zap.UseFlagOptions(&zo), zap.WriteTo(stderr)).WithName("sandbox")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return sandbox.Run(ctx, cfg, func(st sandbox.State) {
		fmt.Fprintf(stdout, "sandbox ready: router %s (%d prefill, %d decode, block size %d, %s flow)\nstate and logs: %s\n",
			st.Router, cfg.Prefill, cfg.Decode, cfg.BlockSize, cfg.Flow, cfg.WorkDir)
	})
}

// int32Flag is a flag of one of router.json's int32 fields.
type int32Flag struct{ p *int32 }

func (f int32Flag) String() string {
	if f.p == nil {
		return "0"
	}
	return strconv.Itoa(int(*f.p))
}

func (f int32Flag) Set(s string) error {
	v, err := strconv.ParseInt(s, 10, 32)
	if err != nil {
		return err
	}
	*f.p = int32(v)
	return nil
}
