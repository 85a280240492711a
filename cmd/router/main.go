// Command router is the P/D proxy (see internal/router).
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
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/connector/memlimit"
	"pdcluster.dev/pdcluster-operator/internal/router"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

// options are the command line; parseFlags is separate so a test can check that the arguments
// the operator renders are ones this command accepts.
type options struct {
	listen, metricsListen             string
	flow, configPath, balance         string
	prefill, decode, kvEventsPorts    list
	refresh, shutdownTimeout          time.Duration
	maxBodyBytes, maxInFlight         int64
	maxBodyBytesInFlight, memoryLimit int64
	zap                               zap.Options
}

// routerGCPercent is the router's GOGC unless the environment sets one.
const routerGCPercent = 400

func parseFlags(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8080", "HTTP address of the proxy")
	fs.StringVar(&o.metricsListen, "metrics-listen", "", "HTTP address of /metrics and the counts the operator reads (/canary, /pairs, /routing), apart from the clients' --listen; empty: served on --listen")
	fs.StringVar(&o.configPath, "config", "", "router.json as the operator renders it: the flow, balance, failure policy and the pools' headless Services, resolved every --refresh (replaces --flow; a file without pools takes them from --prefill and --decode)")
	fs.DurationVar(&o.refresh, "refresh", 5*time.Second, "how often --config's Services are resolved again")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 5*time.Second, "how long a SIGTERM waits for the requests in flight to end before closing them")
	fs.StringVar(&o.flow, "flow", string(routerconfig.FlowMooncake), "transfer flow: mooncake (both legs at once) or nixl (prefill first)")
	fs.StringVar(&o.balance, "balance", "", "how an engine of each pool is picked: least-in-flight (the default) or round-robin (default with --config: its balance)")
	fs.Var(&o.prefill, "prefill", "prefill engine as URL, URL,BOOTSTRAP_URL or URL,BOOTSTRAP_URL,DATA_PARALLEL_RANKS (repeatable; the router uses only ranks below the last, default 1, of the bootstrap registry)")
	fs.Var(&o.decode, "decode", "decode engine URL (repeatable)")
	fs.Var(&o.kvEventsPorts, "kv-events-ports", "ENGINE_URL=PORT,REPLAY_PORT (repeatable): where that engine publishes and replays its KV cache events (routing.strategy KVEvents), instead of router.json's kvEvents ports: for engines that share one host, which a pod never does")
	fs.Int64Var(&o.maxBodyBytes, "max-body-bytes", router.DefaultMaxBodyBytes, "largest request body accepted (413 past it)")
	fs.Int64Var(&o.maxInFlight, "max-in-flight", router.DefaultMaxInFlight, "most requests proxied at once (503 past it)")
	fs.Int64Var(&o.maxBodyBytesInFlight, "max-body-bytes-in-flight", 0, "bytes of request bodies held at once over all requests, each counted 4 times (the router's copies; 503 past it); 0: a quarter of --memory-limit, or 8 of the largest bodies without one")
	fs.Int64Var(&o.memoryLimit, "memory-limit", 0, "the container's memory limit in bytes (the operator passes limits.memory): the Go runtime keeps under 90% of it (unless GOMEMLIMIT is set), the body budget defaults to a quarter of it, and each pool's KV events index holds at most 3/16 of it; 0: none")
	o.zap.BindFlags(fs)
	return o, fs.Parse(args)
}

// bodyBudget is --max-body-bytes-in-flight, or a quarter of --memory-limit (the rest is the
// runtime's, the connections' and the answers'), never less than one body of the largest size.
func bodyBudget(o *options) int64 {
	if o.maxBodyBytesInFlight > 0 || o.memoryLimit <= 0 {
		return o.maxBodyBytesInFlight // 0: the router's default
	}
	return max(o.memoryLimit/4, router.MinBodyBytesInFlight(o.maxBodyBytes))
}

// configure is the router's configuration from o: router.json's when --config names one (its
// pools resolved from its Services, or, for a file without pools, the flags' fixed ones), or
// the flags' alone. Exactly one source of pools is accepted.
func configure(o *options) (router.Config, routerconfig.File, router.Pools, error) {
	cfg := router.Config{
		Flow: routerconfig.Flow(o.flow), Balance: routerconfig.Balance(o.balance),
		MaxBodyBytes: o.maxBodyBytes, MaxInFlight: o.maxInFlight,
		MaxBodyBytesInFlight: bodyBudget(o),
		KVIndexBlocks:        routerconfig.KVIndexBlocks(o.memoryLimit),
	}
	static := router.Pools{Decode: o.decode}
	for _, p := range o.prefill {
		url, rest, _ := strings.Cut(p, ",")
		boot, ranks, hasRanks := strings.Cut(rest, ",")
		pf := router.Prefill{URL: url, Bootstrap: boot}
		if hasRanks {
			n, err := strconv.Atoi(ranks)
			if err != nil || n < 1 {
				return cfg, routerconfig.File{}, static, fmt.Errorf("--prefill %s: data-parallel ranks %q: want a whole number from 1", p, ranks)
			}
			pf.DataParallel = n
		}
		static.Prefill = append(static.Prefill, pf)
	}
	for _, e := range o.kvEventsPorts {
		engine, ports, _ := strings.Cut(e, "=")
		pub, replay, _ := strings.Cut(ports, ",")
		a, errA := strconv.ParseInt(pub, 10, 32)
		b, errB := strconv.ParseInt(replay, 10, 32)
		if engine == "" || errA != nil || errB != nil || a <= 0 || b <= 0 {
			return cfg, routerconfig.File{}, static, fmt.Errorf("--kv-events-ports %s: want ENGINE_URL=PORT,REPLAY_PORT", e)
		}
		if cfg.KVEventsPorts == nil {
			cfg.KVEventsPorts = map[string]router.KVEventsPorts{}
		}
		cfg.KVEventsPorts[engine] = router.KVEventsPorts{Port: int32(a), ReplayPort: int32(b)}
	}
	flagPools := len(static.Prefill) > 0 || len(static.Decode) > 0
	var fc routerconfig.File
	if o.configPath != "" {
		var err error
		if fc, err = routerconfig.Load(o.configPath); err != nil {
			return cfg, fc, static, err
		}
		cfg.Flow = fc.Flow
		if fc.Pairing != nil {
			cfg.Pairing = fc.Pairing.Mode
		}
		if cfg.Balance == "" {
			cfg.Balance = fc.Balance
		}
		cfg.Routing = fc.Routing
		policy := router.PolicyFromFile(fc.Failure())
		cfg.Failure = &policy
		if fc.HasPools() {
			if flagPools {
				return cfg, fc, static, fmt.Errorf("%s names the pools: --prefill and --decode may not name others", o.configPath)
			}
			return cfg, fc, static, nil
		}
	}
	if len(static.Prefill) == 0 || len(static.Decode) == 0 {
		return cfg, fc, static, errors.New("need --config naming the pools, or at least one --prefill and one --decode")
	}
	return cfg, fc, static, nil
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		os.Exit(2) // the FlagSet printed why
	}
	log := zap.New(zap.UseFlagOptions(&o.zap))
	if soft := memlimit.Apply(o.memoryLimit, os.Getenv); soft > 0 {
		log.Info("memory limit", "container", o.memoryLimit, "runtime", soft)
	}
	if os.Getenv("GOGC") == "" {
		// The router's live heap is a few MB of requests in flight: collecting at 5x it instead
		// of 2x costs tens of MB and saves a sixth of its CPU per request (make bench).
		debug.SetGCPercent(routerGCPercent)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	cfg, fc, static, err := configure(o)
	if err != nil {
		log.Error(err, "configure router")
		os.Exit(1)
	}
	reg := prometheus.NewRegistry()
	r, err := router.New(cfg, log, reg)
	if err != nil {
		log.Error(err, "configure router")
		os.Exit(1)
	}
	if fc.HasPools() {
		go resolveLoop(ctx, r, fc, o.refresh, log)
	} else if err := r.SetPools(static); err != nil {
		log.Error(err, "configure router")
		os.Exit(1)
	}
	if fc.Canary != nil {
		go r.RunCanary(ctx, *fc.Canary)
	}
	// The routing strategy's reads of the engines (KVEvents' publishers); returns at once
	// for the others.
	go r.Run(ctx)
	handler := r.Handler(reg)
	if o.metricsListen != "" {
		handler = r.ClientHandler()
		if err := serveObservers(ctx, o.metricsListen, r.ObserverHandler(reg), log); err != nil {
			log.Error(err, "serve /metrics", "listen", o.metricsListen)
			os.Exit(1)
		}
	}
	srv := router.NewServer(o.listen, handler, router.ServerLimits{})
	done := shutdownOnDone(ctx, srv, o.shutdownTimeout)
	log.Info("router serving", "listen", o.listen, "metricsListen", o.metricsListen, "flow", cfg.Flow, "balance", cfg.Balance, "routing", cfg.Routing, "config", o.configPath, "prefill", o.prefill.String(), "decode", o.decode.String(), "canary", fc.Canary != nil)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Error(err, "serve")
		os.Exit(1)
	}
	<-done // ListenAndServe returns when Shutdown begins; the requests in flight end first
	r.Close()
}

// serveObservers serves h on addr until ctx is done: bound before it returns, so that a port
// already taken fails the router at start rather than its first scrape.
func serveObservers(ctx context.Context, addr string, h http.Handler, log logr.Logger) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := router.NewServer(addr, h, router.ServerLimits{})
	go func() {
		<-ctx.Done()
		_ = srv.Close() // scrapes are short: nothing to drain
	}()
	go func() {
		if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
			log.Error(err, "serve /metrics")
			os.Exit(1)
		}
	}()
	return nil
}

// shutdownOnDone shuts srv down once ctx is done (SIGTERM, after the pod's preStop has let the
// Services drop it): no new connections, and the requests in flight get up to timeout to end.
// The returned channel closes when they have.
func shutdownOnDone(ctx context.Context, srv *http.Server, timeout time.Duration) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		c, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		_ = srv.Shutdown(c)
	}()
	return done
}

// resolveLoop keeps the router's pools at the ready pods behind the config's Services. A failed
// resolution keeps the last pools: a DNS hiccup must not empty the router.
func resolveLoop(ctx context.Context, r *router.Router, fc routerconfig.File, every time.Duration, log logr.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		pools, err := router.ResolvePools(ctx, fc, net.DefaultResolver.LookupHost)
		if err == nil {
			err = r.SetPools(pools)
		}
		if err != nil {
			log.Info("pools not refreshed", "err", err.Error())
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
