// Command connector is the connector sidecar run beside each vLLM engine (see connector/sidecar):
// it hears the completion gate's heartbeat on the pod-local socket, answers the kubelet's probes
// and the operator's GET /gate, and exports the gate's counts. It moves no KV: vLLM does.
// `connector drain` is its preStop hook: it asks the running sidecar to drain and waits.
// `connector launch` starts one pod of an engine replica that spans pods, and `connector
// install` copies the binary into such a pod's engine container (its init container).
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

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/memlimit"
	"pdcluster.dev/pdcluster-operator/connector/sidecar"
)

// options are the command-line settings besides the sidecar's own Config.
type options struct {
	role, listen, publicListen string
	controlListen              string
	bindAddress                string
	memoryLimit                int64
	zap                        zap.Options
}

// parseFlags is separate from main so a test can check that the arguments the operator renders
// for the sidecar are ones this command accepts.
func parseFlags(args []string) (sidecar.Config, options, error) {
	var cfg sidecar.Config
	var o options
	fs := flag.NewFlagSet("connector", flag.ContinueOnError)
	fs.StringVar(&o.role, "role", "", "kv_producer (prefill) or kv_consumer (decode): labels the logs")
	fs.StringVar(&o.listen, "listen", "unix:///var/run/pdcluster/agent.sock", "pod-local API the engine's completion gate heartbeats to (and /healthz, /readyz, /metrics, /gate): unix:///path/to/socket or host:port")
	fs.StringVar(&o.controlListen, "control-listen", "", "the control socket, where connector drain (the preStop hook) asks for a drain: on a volume only the sidecar's container mounts, since a drain makes the pod unready (unix:///path/to/socket); empty: no drain")
	fs.StringVar(&o.publicListen, "public-listen", "", "HTTP address the kubelet, the operator and monitoring reach: /healthz, /readyz, /metrics, /gate (no input is taken there); empty: none")
	fs.StringVar(&o.bindAddress, "bind-address", "", "IP the public port binds (the operator renders the pod's IP, so no other interface of the pod, such as an RDMA network no NetworkPolicy covers, reaches it); empty: the host of --public-listen")
	fs.BoolVar(&cfg.Gate.Required, "require-gate", false, "be unready unless the engine's completion gate (the pdgate vLLM plugin) heartbeats on the local API")
	fs.DurationVar(&cfg.Gate.StartupGrace, "gate-startup-grace", 15*time.Minute, "with --require-gate: how long after start the gate may stay silent (model loading)")
	fs.DurationVar(&cfg.Gate.HeartbeatTimeout, "gate-heartbeat-timeout", 30*time.Second, "with --require-gate: how stale the gate's last heartbeat may be")
	fs.IntVar(&cfg.Gate.Ranks, "gate-ranks", 1, "data-parallel ranks the engine runs on this pod: vLLM runs one EngineCore, so one completion gate, per rank, and each must report (a report from a rank outside 0..N-1 is refused)")
	fs.StringVar(&cfg.Engine.MetricsURL, "engine-metrics-url", "", "the engine's /metrics on loopback (http://127.0.0.1:8000/metrics): its prompt tokens by source and transfer counters, served to the operator in GET /gate; empty: not read")
	fs.DurationVar(&cfg.Engine.Every, "engine-metrics-interval", 15*time.Second, "how often --engine-metrics-url is read")
	fs.Int64Var(&o.memoryLimit, "memory-limit", 0, "the container's memory limit in bytes (the operator passes limits.memory): the Go runtime keeps under 90% of it, unless GOMEMLIMIT is set; 0: none")
	o.zap.BindFlags(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, o, err
	}
	if fs.NArg() > 0 {
		return cfg, o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if cfg.Gate.Ranks < 1 {
		return cfg, o, fmt.Errorf("--gate-ranks=%d: an engine runs at least one data-parallel rank", cfg.Gate.Ranks)
	}
	if o.bindAddress != "" && o.publicListen != "" {
		ip := net.ParseIP(o.bindAddress)
		_, port, err := net.SplitHostPort(o.publicListen)
		if ip == nil || err != nil {
			return cfg, o, fmt.Errorf("--bind-address %q with --public-listen %q: want an IP and host:port", o.bindAddress, o.publicListen)
		}
		o.publicListen = net.JoinHostPort(ip.String(), port)
	}
	return cfg, o, nil
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "drain" {
		os.Exit(drainMain(os.Args[2:], os.Stdout, os.Stderr))
	}
	if len(os.Args) > 1 && os.Args[1] == "launch" {
		os.Exit(launchMain(os.Args[2:], os.Stderr))
	}
	if len(os.Args) > 1 && os.Args[1] == "install" {
		os.Exit(installMain(os.Args[2:], os.Stderr))
	}
	cfg, o, err := parseFlags(os.Args[1:])
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, err)
		}
		os.Exit(2)
	}
	log := zap.New(zap.UseFlagOptions(&o.zap)).WithValues("role", o.role)
	if soft := memlimit.Apply(o.memoryLimit, os.Getenv); soft > 0 {
		log.Info("memory limit", "container", o.memoryLimit, "runtime", soft)
	}
	if err := run(cfg, o, log); err != nil {
		log.Error(err, "connector sidecar failed")
		os.Exit(1)
	}
}

func run(cfg sidecar.Config, o options, log logr.Logger) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg.Metrics, cfg.Log = reg, log
	s, err := sidecar.New(cfg)
	if err != nil {
		return err
	}
	servers := []struct {
		addr    string
		handler http.Handler
	}{{o.listen, s.LocalHandler(reg)}, {o.publicListen, s.PublicHandler(reg)}, {o.controlListen, s.ControlHandler()}}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	failed := make(chan error, len(servers))
	var running []*http.Server
	for _, sv := range servers {
		if sv.addr == "" {
			continue
		}
		l, err := localapi.Listen(sv.addr)
		if err != nil {
			return fmt.Errorf("listen %s: %w", sv.addr, err)
		}
		srv := &http.Server{Handler: sv.handler, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second,
			WriteTimeout: 30 * time.Second, IdleTimeout: 90 * time.Second, MaxHeaderBytes: 64 << 10}
		running = append(running, srv)
		go func() {
			if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
				failed <- fmt.Errorf("serve %s: %w", sv.addr, err)
			}
		}()
	}
	go s.Run(ctx)
	log.Info("connector sidecar serving", "local", o.listen, "public", o.publicListen, "control", o.controlListen, "requireGate", cfg.Gate.Required, "engineMetrics", cfg.Engine.MetricsURL)
	select {
	case <-ctx.Done():
	case err = <-failed:
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, srv := range running {
		_ = srv.Shutdown(shutdown)
	}
	return err
}
