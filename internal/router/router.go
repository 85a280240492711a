// Package router is the P/D proxy in front of the engines: the Mooncake concurrent flow (both
// legs at once, sharing a transfer_id, mooncake.go) and the NIXL sequential flow (prefill
// first, its kv_transfer_params passed to decode, nixl.go). This file is the proxy core: the
// request checked once, engines picked, the flow run. Decode output is streamed back as it comes.
package router

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/utils/clock"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Prefill is one prefill engine and its bootstrap registry.
type Prefill struct {
	URL       string `json:"url"`
	Bootstrap string `json:"bootstrap"`
	// DataParallel is how many data-parallel ranks the engine runs (0: 1): the router pins
	// prefill legs only to those of its registry's ranks (registry.go).
	DataParallel int `json:"dataParallel,omitempty"`
}

// Config is the router's configuration: its flow, balance and limits. The engines come through
// SetPools alone (ResolvePools as pods come and go, or a fixed list), so a router starts with
// none and is not ready until it has both pools.
type Config struct {
	Flow routerconfig.Flow
	// KVEventsPorts are engines' KV events ports by engine URL where they are not Routing's
	// (engines sharing one host); the rest use Routing.KVEvents' ports.
	KVEventsPorts map[string]KVEventsPorts
	// Balance picks an engine in each pool; empty: least-in-flight.
	Balance routerconfig.Balance
	// PrefillTimeout bounds the prefill leg.
	PrefillTimeout time.Duration
	// MaxBodyBytes bounds a client's request body (413 past it); 0: DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// MaxBodyBytesInFlight bounds the bytes of request bodies held at once over all requests,
	// each counted bodyCopies times (503 past it); 0: DefaultMaxBodyBytesInFlight. At least
	// bodyCopies x MaxBodyBytes, so that one body of the largest size passes.
	MaxBodyBytesInFlight int64
	// MaxInFlight bounds the requests proxied at once (503 past it); 0: DefaultMaxInFlight.
	MaxInFlight int64
	// UpstreamHeaderTimeout bounds the wait for an engine's response headers; 0: the default
	// of 10 minutes. A non-streaming completion's headers come only when it has finished.
	UpstreamHeaderTimeout time.Duration
	// Failure is the failure policy; nil: router.json's default (DefaultFailurePolicy).
	Failure *FailurePolicy
	// Pairing keeps a request's prefill and decode in one domain of Pools.Domains; empty: any
	// pair.
	Pairing routerconfig.PairingMode
	// Routing weighs what the engines hold of a request's prompt; nil: Balance alone picks.
	Routing *routerconfig.Routing
	// KVIndexBlocks bounds each pool's KVEvents index over all its engines
	// (routerconfig.KVIndexBlocks of the memory limit); 0: blocksPerEngine per engine alone.
	KVIndexBlocks int64
}

// DefaultFailurePolicy is the policy of a router.json without one.
func DefaultFailurePolicy() FailurePolicy {
	return PolicyFromFile(routerconfig.DefaultFailurePolicy())
}

// Defaults of Config's limits.
const (
	// DefaultMaxBodyBytes holds an OpenAI request with a prompt of a million tokens sent as
	// token ids (at most 7 bytes each: six digits and a comma) or of several million as text
	// (about 4 bytes a token); images inline as base64 need more (spec.router.maxRequestBody).
	DefaultMaxBodyBytes int64 = 8 << 20
	// DefaultMaxBodyBytesInFlight is the body budget of a router told no memory limit: 8
	// bodies of the largest default size.
	DefaultMaxBodyBytesInFlight int64 = 8 * bodyCopies * DefaultMaxBodyBytes
	DefaultMaxInFlight          int64 = 4096
)

// Validate reports a configuration the router cannot serve with.
func (c Config) Validate() error {
	if err := c.Flow.Validate(); err != nil {
		return err
	}
	if err := c.Balance.Validate(); err != nil {
		return err
	}
	if r := c.Routing; r != nil {
		if err := r.Validate(c.Balance); err != nil {
			return err
		}
	}
	if p := c.Failure; p != nil {
		switch {
		case p.Retries < 0 || p.RetryBudgetPercent < 0 || p.RetryBudgetPercent > 100:
			return fmt.Errorf("failure policy: retries must not be negative and the budget must be 0 to 100%%, got %d and %d", p.Retries, p.RetryBudgetPercent)
		case p.Eject <= 0:
			return fmt.Errorf("failure policy: the ejection time must be positive, got %s", p.Eject)
		}
		if err := (routerconfig.FailurePolicy{EjectSeconds: 1, OnPrefillFailure: p.OnPrefillFailure}).Validate(); err != nil {
			return err
		}
	}
	return nil
}

func validatePrefill(flow routerconfig.Flow, prefill []Prefill) error {
	for i, p := range prefill {
		if p.URL == "" || (flow == routerconfig.FlowMooncake && p.Bootstrap == "") {
			return fmt.Errorf("prefill[%d]: url and (for mooncake) bootstrap are required", i)
		}
	}
	return nil
}

// flowFunc runs one attempt of a request (mooncake.go, nixl.go): nil when it answered the
// client, else the failure, of which nothing reached the client.
type flowFunc func(a *attempt) *legError

// Router proxies requests to prefill and decode engines.
type Router struct {
	cfg   Config
	pools atomic.Pointer[Pools]
	hc    *http.Client
	boot  *bootstrap.Client
	// prefill and decode pick each pool's engines on their own: one shared turn counter,
	// advanced twice per request, would pin every request to the same pair when both pools
	// have an even size.
	prefill, decode *balancer
	// strategy ranks each pool's engines for a request (strategy.go), chosen once by
	// Config.Routing.
	strategy strategy
	// flow runs one request's legs: mooncake or nixl, chosen once by Config.Flow.
	flow     flowFunc
	inFlight atomic.Int64
	// prefillLegs counts prefill legs sent and not yet answered in full; decodeLegs, decode
	// legs sent whose attempt has not ended (the answer is relayed until then).
	prefillLegs, decodeLegs atomic.Int64
	log                     logr.Logger
	policy                  FailurePolicy
	budget                  *retryBudget
	eject                   *ejector
	// probeEvery is how often an ejected endpoint is asked whether it is back (tests shorten it).
	probeEvery time.Duration
	// closed ends the probes (Close).
	closed    chan struct{}
	closeOnce sync.Once
	metrics   metrics
	canary    *canaryState
	bodies    bodyBudget
	// refusalLogged is when refused registry entries were last logged (UnixNano; registry.go).
	refusalLogged atomic.Int64
}

// withDefaults is c with each zero limit at its default, or why c cannot serve.
func (c Config) withDefaults() (Config, error) {
	if err := c.Validate(); err != nil {
		return c, err
	}
	if c.PrefillTimeout <= 0 {
		c.PrefillTimeout = 10 * time.Minute
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxBodyBytesInFlight <= 0 {
		c.MaxBodyBytesInFlight = DefaultMaxBodyBytesInFlight
	}
	if c.MaxBodyBytesInFlight < MinBodyBytesInFlight(c.MaxBodyBytes) {
		return c, fmt.Errorf("%d bytes of bodies in flight cannot hold one body of the largest size (%d bytes, counted %d times)", c.MaxBodyBytesInFlight, c.MaxBodyBytes, bodyCopies)
	}
	if c.UpstreamHeaderTimeout <= 0 {
		c.UpstreamHeaderTimeout = 10 * time.Minute
	}
	if c.Failure == nil {
		p := DefaultFailurePolicy()
		c.Failure = &p
	}
	return c, nil
}

// New validates cfg and returns a Router; metrics register on reg.
func New(cfg Config, log logr.Logger, reg prometheus.Registerer) (*Router, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	policy := *cfg.Failure
	boot := bootstrap.NewClient()
	boot.MaxAge, boot.RefreshAfter = bootstrapMaxAge, bootstrapRefresh
	clk := clock.RealClock{}
	r := &Router{
		cfg: cfg, hc: upstreamClient(cfg.UpstreamHeaderTimeout), boot: boot, log: log,
		prefill: newBalancer(cfg.Balance), decode: newBalancer(cfg.Balance),
		policy: policy, budget: &retryBudget{percent: int64(policy.RetryBudgetPercent), clock: clk}, eject: newEjector(clk),
		probeEvery: probeEvery,
		closed:     make(chan struct{}),
		canary:     newCanaryState(),
		strategy:   newStrategy(cfg.Routing, cfg.KVEventsPorts, cfg.KVIndexBlocks),
	}
	r.metrics.init(r)
	if reg != nil {
		for _, c := range slices.Concat(r.metrics.collectors, r.canary.collectors(), r.strategy.collectors()) {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	r.flow = map[routerconfig.Flow]flowFunc{routerconfig.FlowMooncake: r.mooncake, routerconfig.FlowNIXL: r.nixl}[cfg.Flow]
	r.pools.Store(&Pools{})
	r.bodies.limit = cfg.MaxBodyBytesInFlight
	boot.Admit = r.admitRegistry
	return r, nil
}

// SetPools replaces the engines requests go to; requests in flight keep theirs.
func (r *Router) SetPools(p Pools) error {
	if len(p.Revisions) > 0 {
		p.Prefill, p.Decode = nil, nil
		p.Revisions = slices.Clone(p.Revisions)
		for i := range p.Revisions {
			rev := &p.Revisions[i]
			p.Prefill = append(p.Prefill, rev.Prefill...)
			p.Decode = append(p.Decode, rev.Decode...)
			rev.pools = &Pools{Prefill: rev.Prefill, Decode: rev.Decode}
			rev.requests = r.metrics.byRevision.WithLabelValues(rev.Name)
		}
	}
	if err := validatePrefill(r.cfg.Flow, p.Prefill); err != nil {
		return fmt.Errorf("router: %w", err)
	}
	p.dataParallel = map[string]int{}
	for _, pf := range p.Prefill {
		if pf.Bootstrap != "" {
			p.dataParallel[pf.Bootstrap] = pf.DataParallel
		}
	}
	if r.cfg.Pairing != "" {
		p.pairable = domainsOf(&p)
		for i := range p.Revisions {
			rev := p.Revisions[i].pools
			rev.Domains = p.Domains
			rev.pairable = domainsOf(rev)
		}
	}
	for i := range p.Revisions {
		rev := &p.Revisions[i]
		rev.takes = rev.serves() && (r.cfg.Pairing != routerconfig.PairingRequired || len(rev.pools.pairable) > 0)
	}
	r.strategy.retain(&p)
	r.pools.Store(&p)
	return nil
}

// servable decides whether the router can serve a request now, for /ready and the proxy
// alike: the pools a request goes to (all, or with KV revisions one that takes requests,
// picked and counted when pick is set, else the first), or nil with why not.
func (r *Router) servable(all *Pools, pick bool) (*Pools, string) {
	switch {
	case len(all.Prefill) == 0 || len(all.Decode) == 0:
		return nil, fmt.Sprintf("no ready engines: %d prefill, %d decode", len(all.Prefill), len(all.Decode))
	case len(all.Revisions) > 0:
		// A prefill of one revision and a decode of another serve nothing together.
		return r.pickRevision(all, pick)
	case r.cfg.Pairing == routerconfig.PairingRequired && len(all.pairable) == 0:
		return nil, noPairableDomain
	}
	return all, ""
}

// Handler serves ClientHandler's routes and ObserverHandler's on one port: a router run on its
// own, or in tests. A rendered router serves them on two (--metrics-listen).
func (r *Router) Handler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	r.clientRoutes(mux)
	r.observerRoutes(mux, gatherer)
	return mux
}

// ClientHandler serves the OpenAI routes, /health and /ready: what the router's clients reach.
func (r *Router) ClientHandler() http.Handler {
	mux := http.NewServeMux()
	r.clientRoutes(mux)
	return mux
}

// ObserverHandler serves what the router tells of its traffic: /metrics (from gatherer, if not
// nil) and the counts the operator reads (/canary, /pairs, /routing). They name engines and
// count what they hold of the prompts sent, which is not a client's to read: a rendered router
// serves them on a port of their own that its NetworkPolicy opens to the operator and
// monitoring alone.
func (r *Router) ObserverHandler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	r.observerRoutes(mux, gatherer)
	return mux
}

func (r *Router) clientRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/completions", r.proxy)
	mux.HandleFunc("POST /v1/chat/completions", r.proxy)
	// /health is liveness: the process serves. /ready is readiness: it could serve a request
	// now (servable), so a Ready PDCluster answers completions instead of 503.
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /ready", func(w http.ResponseWriter, _ *http.Request) {
		if _, why := r.servable(r.pools.Load(), false); why != "" {
			writeError(w, http.StatusServiceUnavailable, why)
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, req *http.Request) {
		pools := r.pools.Load()
		if len(pools.Decode) == 0 {
			writeError(w, http.StatusServiceUnavailable, "no ready decode engine")
			return
		}
		resp, err := r.hc.Get(pools.Decode[0] + "/v1/models")
		if err != nil {
			writeError(w, http.StatusBadGateway, "decode engine unreachable: "+err.Error())
			return
		}
		defer resp.Body.Close()
		copyResponse(w, resp)
	})
}

func (r *Router) observerRoutes(mux *http.ServeMux, gatherer prometheus.Gatherer) {
	mux.HandleFunc("GET "+routerconfig.CanaryPath, r.serveCanary)
	mux.HandleFunc("GET "+routerconfig.PairsPath, r.servePairs)
	if _, ok := r.strategy.routingCounts(); ok {
		mux.HandleFunc("GET "+routerconfig.RoutingPath, r.serveRouting)
	}
	if gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
}

// Run does the router's work in the background until ctx ends: its routing strategy's reads
// of the engines themselves (KVEvents' publishers).
func (r *Router) Run(ctx context.Context) {
	r.strategy.run(ctx, r.pools.Load, r.log)
}

// serveRouting answers GET /routing: what the picked engines held of the prompts routed since
// the router started, by pool.
func (r *Router) serveRouting(w http.ResponseWriter, _ *http.Request) {
	out, _ := r.strategy.routingCounts()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// newID is 128 random bits (base32): a transfer id names the KV a pull takes, so one client's
// ids must tell it nothing of another's. crypto/rand reads through the vDSO on Linux 6.11+,
// without a system call.
func newID() string { return rand.Text() }

func (r *Router) proxy(w http.ResponseWriter, req *http.Request) {
	start := time.Now()
	sw := &statusWriter{ResponseWriter: w}
	defer func() {
		r.metrics.requests.WithLabelValues(string(r.cfg.Flow), strconv.Itoa(sw.code())).Inc()
		r.metrics.request.Observe(time.Since(start).Seconds())
	}()
	if n := r.inFlight.Add(1); n > r.cfg.MaxInFlight {
		r.inFlight.Add(-1)
		sw.Header().Set("Retry-After", "1")
		writeError(sw, http.StatusServiceUnavailable, fmt.Sprintf("%d requests in flight, the router's limit", r.cfg.MaxInFlight))
		return
	}
	defer r.inFlight.Add(-1)
	// The body's bytes count against the router's budget until its answer has been written.
	in := &chargedReader{r: http.MaxBytesReader(sw, req.Body, r.cfg.MaxBodyBytes), b: &r.bodies}
	defer func() { r.bodies.give(in.taken) }()
	var raw []byte
	err := errBodyBudget
	if req.ContentLength > r.cfg.MaxBodyBytes || in.prepay(req.ContentLength) {
		raw, err = io.ReadAll(in)
	}
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeError(sw, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body larger than %d bytes", r.cfg.MaxBodyBytes))
			return
		}
		if errors.Is(err, errBodyBudget) {
			r.metrics.bodyBudgetRefused.Inc()
			sw.Header().Set("Retry-After", "1")
			writeError(sw, http.StatusServiceUnavailable, fmt.Sprintf("the router holds %d bytes of request bodies, its limit: retry", r.cfg.MaxBodyBytesInFlight))
			return
		}
		writeError(sw, http.StatusBadRequest, "read body: "+err.Error())
		return
	}
	// Values stay raw: the router reads none of them, and re-encoding a long prompt's token list
	// was a tenth of its time.
	var body map[string]json.RawMessage
	if err := json.Unmarshal(raw, &body); err != nil || body == nil {
		writeError(sw, http.StatusBadRequest, "body must be a JSON object")
		return
	}
	if clientSetsTransferParams(body) {
		writeError(sw, http.StatusBadRequest, "kv_transfer_params is set by the router, not by clients")
		return
	}
	_, hasPrompt := body["prompt"]
	_, hasMessages := body["messages"]
	if !hasPrompt && !hasMessages {
		writeError(sw, http.StatusBadRequest, "prompt (completions) or messages (chat) is required")
		return
	}
	reqID := req.Header.Get("X-Request-Id")
	if reqID == "" {
		reqID = newID()
	} else if !validRequestID(reqID) {
		writeError(sw, http.StatusBadRequest, fmt.Sprintf("X-Request-Id must be at most %d printable ASCII characters without spaces", maxRequestIDBytes))
		return
	}
	pools, why := r.servable(r.pools.Load(), true)
	if why != "" {
		writeError(sw, http.StatusServiceUnavailable, why)
		return
	}
	x := &exchange{r: r, w: sw, req: req, body: body, reqID: reqID, pools: pools, start: start, firstToken: firstTokenBudget(r.policy, body),
		scorer: r.strategy.prepare(body, in.charge)}
	x.run()
}
