package pdctl

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/internal/sandbox"
)

func newSandboxCommand() *cobra.Command {
	cfg := sandbox.Config{}
	cmd := &cobra.Command{
		Use:   "sandbox",
		Short: "Run router, engine simulators and connector agents as processes on loopback",
		Long: `sandbox starts a complete P/D deployment on this machine: for each prefill and decode
engine a connector agent and an engine simulator, and a router on --listen. It serves until
interrupted. Processes that exit are restarted with backoff; logs, KV files and sandbox.json
(the addresses and PIDs) are in --work-dir.`,
		Example: `  pdctl sandbox --listen 127.0.0.1:8080 --block-size 64 --prefill 2 --decode 1
  curl -s 127.0.0.1:8080/v1/completions -d '{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13],"max_tokens":32,"ignore_eos":true}'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.BinDir == "" {
				exe, err := os.Executable()
				if err != nil {
					return err
				}
				cfg.BinDir = filepath.Dir(exe)
			}
			if cfg.WorkDir == "" {
				dir, err := os.MkdirTemp("", "pdctl-sandbox-")
				if err != nil {
					return err
				}
				cfg.WorkDir = dir
			}
			zo := zap.Options{Development: true}
			cfg.Log = zap.New(zap.UseFlagOptions(&zo), zap.WriteTo(cmd.ErrOrStderr())).WithName("sandbox")
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return sandbox.Run(ctx, cfg, func(st sandbox.State) {
				fmt.Fprintf(cmd.OutOrStdout(), "sandbox ready: router %s (%d prefill, %d decode, block size %d, %s flow)\nstate and logs: %s\n",
					st.Router, cfg.Prefill, cfg.Decode, cfg.BlockSize, cfg.Mode, cfg.WorkDir)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Listen, "listen", "127.0.0.1:8080", "router address")
	f.IntVar(&cfg.BlockSize, "block-size", 16, "tokens per KV block")
	f.IntVar(&cfg.Prefill, "prefill", 1, "prefill engines")
	f.IntVar(&cfg.Decode, "decode", 1, "decode engines")
	f.IntVar(&cfg.KVBlocks, "kv-blocks", 2048, "KV blocks per engine")
	f.IntVar(&cfg.BlockBytes, "block-bytes", 1024, "bytes of simulated KV per block")
	f.StringVar(&cfg.Mode, "mode", "mooncake", "mooncake (concurrent legs) or nixl (sequential)")
	f.StringVar(&cfg.Policy, "kv-load-failure-policy", "fail", "decode engines' policy on a failed KV load: fail or recompute")
	f.DurationVar(&cfg.StepTime, "step-time", time.Millisecond, "simulated time of one decode step")
	f.DurationVar(&cfg.SendDelay, "send-delay", 0, "delay per KV block sent (a slow link)")
	f.DurationVar(&cfg.HoldTimeout, "hold-timeout", 30*time.Second, "producer hold and ready timeout")
	f.DurationVar(&cfg.PullTimeout, "pull-timeout", 40*time.Second, "consumer pull timeout")
	f.BoolVar(&cfg.UngatedCompletions, "unsafe-ungated-completions", false, "run decode agents with the seed bug (to watch the engine die)")
	f.StringVar(&cfg.BinDir, "bin-dir", "", "directory of the connector, enginesim and router binaries (default: beside pdctl)")
	f.StringVar(&cfg.WorkDir, "work-dir", "", "directory for logs, KV files and sandbox.json (default: a new temporary directory)")
	return cmd
}
