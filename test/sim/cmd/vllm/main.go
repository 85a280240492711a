// Command vllm stands in for vLLM in the engine image of the local cluster's real node: it
// answers `vllm serve MODEL <flags>` with the engine simulator (test/sim/enginesim) and behaves
// like vLLM where a pod can tell:
//   - flags: the ones vLLM defines, an unknown one is a usage error (exit 2);
//   - --kv-transfer-config: the connector class is imported from kv_connector_module_path on
//     PYTHONPATH (missing: ModuleNotFoundError, exit 1) or is one of vLLM's own;
//   - ports: the OpenAI API on --host:--port; a Mooncake kv_producer's bootstrap server on
//     0.0.0.0:$VLLM_MOONCAKE_BOOTSTRAP_PORT (8998); NIXL's side channel on
//     $VLLM_NIXL_SIDE_CHANNEL_HOST (localhost):$VLLM_NIXL_SIDE_CHANNEL_PORT (5600) + dp rank, and
//     that host is what prefill hands decode. A port already bound fails the start, as it
//     fails vLLM's;
//   - reports: the worker's finished-receiving reports reach the scheduler at its next step,
//     and an engine with no request does not step (EngineCore blocks on its input queue); the
//     worker reports pulls with no local block too, as vLLM's stock Mooncake worker did before
//     0.32, so the stock class dies of them as vLLM did;
//   - a replica across pods (the flags `connector launch` adds): a pod of a data-parallel
//     replica (hybrid load balancing) runs its --data-parallel-size-local ranks, counted from 0
//     in its own bootstrap registry, gates and X-data-parallel-rank; a model sharded over
//     --nnodes serves from node 0, the --headless others run no API server. No pod serves
//     before every pod of its group joined at the leader's --data-parallel-address or
//     --master-addr (which the leader binds), and a pod lost ends the others' engines;
//   - the gate: with pdgate's class loaded the scheduler side runs pdgate's rule (TTL from
//     PDGATE_TTL_SECONDS) and heartbeats its counts to the sidecar as the plugin does;
//     VLLM_SIM_SILENT_GATE=1 keeps the heartbeat from ever reaching the sidecar (a test knob:
//     an engine whose gate never reports, for the sidecar's readiness and the operator's
//     report of it).
//
// The KV moves through the stand-in's own transfer engine, in this process as vLLM's worker runs
// Mooncake's (test/sim/kvtransfer): its data plane binds a port the kernel picks on the
// address vLLM's get_ip() finds (VLLM_HOST_IP, else the one that routes out), a prefill engine
// registers it in its bootstrap server as vLLM's workers register theirs, and its KV memory and
// transfer state die with the process. Its metrics are on the API port's /metrics, as vLLM's
// are. The connector sidecar beside the engine (PDCLUSTER_CONNECTOR_URL) hears only the gate.
package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/enginesim"
	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agent"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmcli"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmsched"
)

func main() {
	log := zap.New(zap.UseDevMode(false))
	s, err := vllmcli.Parse(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		if _, usage := errors.AsType[*vllmcli.UsageError](err); usage {
			os.Exit(2)
		}
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, s, os.Getenv, log); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// silentGateEnv is the stand-in's knob for a gate that never reports.
const silentGateEnv = "VLLM_SIM_SILENT_GATE"

// dropKVParamsEnv is the stand-in's knob for a decode engine that never sees its requests'
// kv_transfer_params (as behind a router that drops them): it computes every prompt itself,
// answers 200, and counts the tokens as local_compute.
const dropKVParamsEnv = "VLLM_SIM_DROP_KV_TRANSFER_PARAMS"

func envOr(getenv func(string) string, key, def string) string {
	if v := getenv(key); v != "" {
		return v
	}
	return def
}

// run starts the engine of s and serves until shutdown ends (SIGTERM). Then, as vLLM does,
// the API server stops taking requests and, with --shutdown-timeout above 0, the engine drains
// for up to that long: running requests end, and a producer keeps its KV blocks (its transfer
// engine, bootstrap and side channels serving) until decode pulled them. With 0 it stops at
// once, and whatever it held is lost to its consumers.
func run(shutdown context.Context, s *vllmcli.Serve, getenv func(string) string, log logr.Logger) error {
	ctx, stopEngine := context.WithCancel(context.WithoutCancel(shutdown))
	defer stopEngine()
	cfg := enginesim.Config{Model: s.ServedModelName, BlockSize: s.BlockSize, MaxModelLen: s.MaxModelLen,
		MaxNumSeqs: s.MaxNumSeqs, PrefixCaching: s.PrefixCaching, Policy: vllmsched.PolicyFail, StepTime: 2 * time.Millisecond, Log: log}
	// One engine per data-parallel rank of this pod, as vLLM runs one EngineCore (with its own
	// KV cache, scheduler and connector worker) per rank behind one API server. A pod of a
	// replica across pods runs its --data-parallel-size-local, counted from 0 as vLLM's hybrid
	// load balancing counts them (its registry, gates and X-data-parallel-rank).
	ranks := s.LocalRanks()
	var conn vllmcli.Connector
	var format string // the KV format, with a connector
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			_ = l.Close()
		}
	}()
	listen := func(addr, what string) (net.Listener, error) {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("OSError: %s on %s: %w", what, addr, err)
		}
		listeners = append(listeners, l)
		return l, nil
	}
	// A pod of a replica across pods serves once its group formed, and dies with it.
	lost := make(chan error, 1)
	if plan, ok := planGroup(s); ok {
		if err := joinGroup(shutdown, plan, listen, lost, log.WithName("group")); err != nil {
			return err
		}
		if s.Group.Headless {
			log.Info("vllm (simulated) headless: this pod runs its group's workers, no API server", "group", plan.addr, "node", s.Group.NodeRank)
			select {
			case <-shutdown.Done():
				return nil
			case err := <-lost:
				return err
			}
		}
	}
	metrics := prometheus.NewRegistry()
	// rankMetrics is where a rank's transfer engine registers: with several ranks, each under
	// its engine label, as vLLM labels its metrics.
	rankMetrics := func(rank int) prometheus.Registerer {
		if ranks == 1 {
			return metrics
		}
		return prometheus.WrapRegistererWith(prometheus.Labels{"engine": strconv.Itoa(rank)}, metrics)
	}
	sidecarURL := envOr(getenv, "PDCLUSTER_CONNECTOR_URL", "unix:///var/run/pdcluster/agent.sock")
	cfgs := make([]enginesim.Config, ranks)
	for rank := range cfgs {
		cfgs[rank] = cfg
		cfgs[rank].DPRank = rank
	}
	if kv := s.KVTransfer; kv != nil {
		var err error
		if conn, err = vllmcli.LoadConnector(kv, getenv("PYTHONPATH")); err != nil {
			return err
		}
		cfg.Role = vllm.KVRole(kv.Role)
		cfg.WorkerReportsEmptyPulls = true
		cfg.Gate = conn.File != "" // a class imported from pdgate's mounted files
		if v := getenv(enginesim.GateTTLEnv); v != "" {
			secs, err := strconv.ParseFloat(v, 64)
			if err != nil || secs <= 0 {
				return fmt.Errorf("%s=%q: want a positive number of seconds", enginesim.GateTTLEnv, v)
			}
			cfg.GateTTL = time.Duration(secs * float64(time.Second))
		}
		if kv.LoadFailurePolicy != "" {
			cfg.Policy = vllmsched.Policy(kv.LoadFailurePolicy)
		}
		blocks := s.NumGPUBlocksOverride
		if blocks == 0 {
			blocks = defaultKVBlocks
		}
		host := hostIP(getenv)
		format = kvFormat(s, getenv)
		onTransfer, err := transferHistograms(metrics, conn.Flow, s.ServedModelName)
		if err != nil {
			return err
		}
		producer := cfg.Role == vllm.KVProducer
		// registry is the pod's Mooncake bootstrap registry, where every rank's worker
		// registers; NIXL's side channel of each rank answers with that rank's alone.
		registry := bootstrap.NewRegistry()
		registry.Limits = bootstrap.RegistryLimits{DP: ranks, TP: max(s.TensorParallel, 1), PP: max(s.PipelineParallel, 1), SameHost: true}
		sides := make([]*bootstrap.Registry, ranks)
		for rank := range ranks {
			transfer, err := agent.StartInProcess(ctx, agent.InProcessConfig{
				Role: cfg.Role, Log: log.WithName("transfer").WithValues("dpRank", rank), KVFormat: format,
				Blocks: blocks, BlockBytes: blockBytes, DataListen: net.JoinHostPort(host, "0"),
				Producer: agent.ProducerConfig{DPRank: rank},
				Consumer: agent.ConsumerConfig{OnTransfer: onTransfer(rank)},
			}, rankMetrics(rank))
			if err != nil {
				return err
			}
			defer transfer.Close()
			sides[rank] = bootstrap.NewRegistry() // a consumer answers handshakes with its own (empty) metadata
			if producer {
				sides[rank].Limits = registry.Limits
				for _, r := range []*bootstrap.Registry{registry, sides[rank]} {
					if err := r.Register(transfer.Producer.Registration()); err != nil {
						return fmt.Errorf("register the transfer engine of dp rank %d: %w", rank, err)
					}
				}
			}
			c := cfg
			c.DPRank, c.Agent, c.KV, c.Capacity = rank, transfer.URL, transfer.KV, blocks
			cfgs[rank] = c
		}
		switch conn.Flow {
		case vllmcli.FlowMooncake:
			if producer {
				port := envOr(getenv, vllm.EnvMooncakeBootstrapPort, strconv.Itoa(int(vllm.MooncakeBootstrapPort)))
				l, err := listen(net.JoinHostPort("0.0.0.0", port), "Mooncake bootstrap server")
				if err != nil {
					return err
				}
				go serveHTTP(ctx, l, registry.Handler())
				for rank := range cfgs {
					cfgs[rank].BootstrapAddr = "http://" + net.JoinHostPort("127.0.0.1", port)
				}
			}
		case vllmcli.FlowNixl:
			host := envOr(getenv, vllm.EnvNixlSideChannelHost, "localhost")
			base, err := strconv.Atoi(envOr(getenv, vllm.EnvNixlSideChannelPort, strconv.Itoa(int(vllm.NixlSideChannelPort))))
			if err != nil {
				return fmt.Errorf("VLLM_NIXL_SIDE_CHANNEL_PORT: %w", err)
			}
			for rank := range ranks {
				port := strconv.Itoa(base + rank)
				l, err := listen(net.JoinHostPort(host, port), fmt.Sprintf("NIXL side channel of dp rank %d", rank))
				if err != nil {
					return err
				}
				go serveHTTP(ctx, l, sides[rank].Handler())
				// What prefill hands decode in kv_transfer_params (remote_host, remote_port).
				cfgs[rank].BootstrapAddr = "http://" + net.JoinHostPort(host, port)
			}
		}
	}
	engines := make([]*enginesim.Engine, ranks)
	for rank, c := range cfgs {
		if c.Capacity == 0 {
			c.Capacity = 4096
		}
		c.DropKVTransferParams = getenv(dropKVParamsEnv) == "1"
		c.Connector = map[vllmcli.Flow]string{vllmcli.FlowMooncake: "mooncake", vllmcli.FlowNixl: "nixl"}[conn.Flow]
		if s.KVEvents != nil {
			// One publisher per rank, on the endpoints' ports plus the rank, as vLLM's.
			p, err := kvpublish.ForRank(*s.KVEvents, rank)
			if err != nil {
				return fmt.Errorf("OSError: KV cache events of dp rank %d: %w", rank, err)
			}
			if p != nil {
				defer p.Close()
				c.Events = p
			}
		}
		e, err := enginesim.New(c)
		if err != nil {
			return err
		}
		engines[rank] = e
	}
	if err := metrics.Register(enginesim.Collector(engines...)); err != nil {
		return err
	}
	api, err := listen(net.JoinHostPort(s.Host, strconv.Itoa(s.Port)), "OpenAI API server")
	if err != nil {
		return err
	}
	if conn.File != "" && conn.Class != "" && getenv(silentGateEnv) != "1" {
		go heartbeat(ctx, sidecarURL, conn, string(cfg.Role), engines)
	}
	for _, e := range engines {
		go e.Run(ctx)
	}
	mux := http.NewServeMux()
	mux.Handle("/", enginesim.DataParallel(engines))
	mux.Handle("GET /metrics", promhttp.HandlerFor(metrics, promhttp.HandlerOpts{}))
	log.Info("vllm (simulated) serving", "model", s.Model, "api", api.Addr().String(), "connector", conn.Class, "flow", conn.Flow, "kvRole", cfg.Role, "kvFormat", format, "dataParallelRanks", ranks)
	drain := time.Duration(s.ShutdownTimeout) * time.Second
	serving, groupLost := context.WithCancelCause(shutdown)
	go func() {
		select {
		case err := <-lost:
			groupLost(err)
		case <-serving.Done():
		}
	}()
	serveHTTPFor(serving, api, mux, drain)
	if err := context.Cause(serving); errors.Is(err, errGroupLost) {
		return err
	}
	held := func() (n int) {
		for _, e := range engines {
			n += e.HeldSends()
		}
		return n
	}
	if drain > 0 {
		log.Info("[shutdown] EngineCore: start mode=drain", "timeout", drain, "heldSends", held())
		deadline := time.Now().Add(drain)
		for slices.ContainsFunc(engines, (*enginesim.Engine).HasWork) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		log.Info("[shutdown] EngineCore: drain ended", "heldSends", held(), "work left", slices.ContainsFunc(engines, (*enginesim.Engine).HasWork))
	} else {
		log.Info("[shutdown] EngineCore: start mode=abort", "heldSends", held())
	}
	return nil
}

// kvLayoutEnv stands for what an engine image's vLLM release decides of the KV layout (the
// stand-in's one image cannot change it otherwise): engines with different values cannot read
// each other's KV.
const kvLayoutEnv = "VLLM_SIM_KV_LAYOUT"

// kvFormat is the engine's KV format: a hash of what decides whether another engine can read
// its blocks (the model and its revision, dtypes, quantization, block size, tensor and
// pipeline sharding, and the release's layout). A pull across formats fails loudly.
func kvFormat(s *vllmcli.Serve, getenv func(string) string) string {
	h := sha256.Sum256([]byte(strings.Join([]string{s.Model, s.Revision, s.Dtype, s.KVCacheDtype, s.Quantization,
		strconv.Itoa(s.BlockSize), strconv.Itoa(s.TensorParallel), strconv.Itoa(s.PipelineParallel), envOr(getenv, kvLayoutEnv, "sim-1")}, "\x00")))
	return hex.EncodeToString(h[:6])
}

// transferHistograms registers vLLM's per-transfer histograms of the connector (duration and
// bytes, by model_name and engine: the dp rank) and returns what records a transfer of a rank
// in them. The stand-in records on decode, which pulls; vLLM's Mooncake records on the prefill
// that writes, NIXL on the decode that reads: the operator sums both pools, so only the names
// and units matter.
func transferHistograms(reg prometheus.Registerer, flow vllmcli.Flow, model string) (func(rank int) func(time.Duration, int), error) {
	names := map[vllmcli.Flow][2]string{
		vllmcli.FlowMooncake: {vllm.MetricMooncakeXferSeconds, vllm.MetricMooncakeBytes},
		vllmcli.FlowNixl:     {vllm.MetricNixlXferSeconds, vllm.MetricNixlBytes},
	}[flow]
	if names[0] == "" {
		return func(int) func(time.Duration, int) { return nil }, nil
	}
	secs := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: names[0], Help: "Histogram of transfer duration for KV Cache transfers.",
		Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10)}, []string{"model_name", "engine"})
	bytes := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: names[1], Help: "Histogram of bytes transferred per KV Cache transfer.",
		Buckets: prometheus.ExponentialBuckets(4096, 4, 10)}, []string{"model_name", "engine"})
	for _, c := range []prometheus.Collector{secs, bytes} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return func(rank int) func(time.Duration, int) {
		s, b := secs.WithLabelValues(model, strconv.Itoa(rank)), bytes.WithLabelValues(model, strconv.Itoa(rank))
		return func(d time.Duration, n int) {
			s.Observe(d.Seconds())
			b.Observe(float64(n))
		}
	}, nil
}

func serveHTTP(ctx context.Context, l net.Listener, h http.Handler) {
	serveHTTPFor(ctx, l, h, 5*time.Second)
}

// serveHTTPFor serves until ctx ends, then closes l and gives the requests in progress up to
// grace to end.
func serveHTTPFor(ctx context.Context, l net.Listener, h http.Handler, grace time.Duration) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		c, cancel := context.WithTimeout(context.Background(), max(grace, time.Second))
		defer cancel()
		_ = srv.Shutdown(c)
	}()
	_ = srv.Serve(l)
	<-done
}

// defaultKVBlocks is the stand-in's KV capacity without --num-gpu-blocks-override, and
// blockBytes the bytes it moves per block.
const (
	defaultKVBlocks = 1024
	blockBytes      = 4096
)

// hostIP is the address vLLM's get_ip() finds for this host, which its transfer engine
// advertises: VLLM_HOST_IP, else the local address of a UDP socket "connected" toward a public
// address (no packet is sent), else loopback.
func hostIP(getenv func(string) string) string {
	if ip := getenv(vllm.EnvHostIP); ip != "" {
		return ip
	}
	for _, target := range []string{"8.8.8.8:80", "[2001:4860:4860::8888]:80"} {
		c, err := net.Dial("udp", target)
		if err != nil {
			continue
		}
		addr := c.LocalAddr().(*net.UDPAddr).IP.String()
		c.Close()
		return addr
	}
	return "127.0.0.1"
}

// heartbeat reports each rank's gate to the sidecar every 5 s, as pdgate's Reporter does in
// each EngineCore (one per data-parallel rank, each with its own scheduler): the counts of what
// that engine's gate kept from its scheduler and passed. A heartbeat the sidecar does not take
// (unreachable, or refused with a non-2xx) is counted in send_failures, as the plugin counts it.
func heartbeat(ctx context.Context, agent string, conn vllmcli.Connector, role string, engines []*enginesim.Engine) {
	c := newSidecar(agent)
	dropped := make([]int64, len(engines))
	for ctx.Err() == nil {
		for rank, e := range engines {
			held := int64(e.HeldSends())
			counts := e.GateCounts()
			counts.SendFailures += dropped[rank]
			if err := c.gate(ctx, vllm.Report{Connector: conn.Class, VLLMVersion: "sim", PluginVersion: vllm.Hash(), Role: role, PID: os.Getpid(),
				DPRank: rank, Counts: counts, HeldSends: &held}); err != nil {
				dropped[rank]++
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
		}
	}
}

// sidecar is the connector sidecar's pod-local API: the gate's heartbeat.
type sidecar struct {
	base string
	hc   *http.Client
}

func newSidecar(endpoint string) sidecar {
	base, hc := localapi.Client(endpoint, 2*time.Second)
	return sidecar{base, hc}
}

func (s sidecar) gate(ctx context.Context, rep vllm.Report) error {
	b, err := json.Marshal(rep)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.base+localapi.PathGate, bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.hc.Do(req)
	if err != nil {
		return err
	}
	_ = resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("sidecar answered %s", resp.Status)
	}
	return nil
}
