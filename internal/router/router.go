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

	"pdcluster.dev/pdcluster-operator/connector/bootstrap"
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

type metrics struct {
	requests    *prometheus.CounterVec
	legFailures *prometheus.CounterVec
	retries     *prometheus.CounterVec
	ejections   *prometheus.CounterVec
	// ejectionsWithheld: ejections due but not made, the endpoint being its pool's last.
	ejectionsWithheld *prometheus.CounterVec
	budgetDenied      prometheus.Counter
	decodeOnly        prometheus.Counter
	byRevision        *prometheus.CounterVec
	// registryRefused counts entries of prefills' bootstrap registries not used, by reason.
	registryRefused *prometheus.CounterVec
	// bodyBudgetRefused counts requests refused because the body budget was spent.
	bodyBudgetRefused prometheus.Counter
	// pairs by locality, with pairing: same-domain, cross-domain (GET /pairs and the
	// pdcluster_router_pairs_total counter read them).
	samePairs, crossPairs atomic.Int64
	// Latencies as the router sees them, for its flow: the prefill leg (successful ones),
	// the first byte of the answer to the client (a stream's first token), the whole request.
	prefillLeg, firstToken, request prometheus.Observer
}

// latencyBuckets span 5 ms to 40 s.
var latencyBuckets = prometheus.ExponentialBuckets(0.005, 2, 14)

// New validates cfg and returns a Router; metrics register on reg.
func New(cfg Config, log logr.Logger, reg prometheus.Registerer) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	if cfg.PrefillTimeout <= 0 {
		cfg.PrefillTimeout = 10 * time.Minute
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = DefaultMaxInFlight
	}
	if cfg.MaxBodyBytesInFlight <= 0 {
		cfg.MaxBodyBytesInFlight = DefaultMaxBodyBytesInFlight
	}
	if cfg.MaxBodyBytesInFlight < MinBodyBytesInFlight(cfg.MaxBodyBytes) {
		return nil, fmt.Errorf("router: %d bytes of bodies in flight cannot hold one body of the largest size (%d bytes, counted %d times)", cfg.MaxBodyBytesInFlight, cfg.MaxBodyBytes, bodyCopies)
	}
	if cfg.UpstreamHeaderTimeout <= 0 {
		cfg.UpstreamHeaderTimeout = 10 * time.Minute
	}
	policy := DefaultFailurePolicy()
	if cfg.Failure != nil {
		policy = *cfg.Failure
	}
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
		metrics: metrics{
			requests: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "pdcluster_router_requests_total", Help: "Requests proxied, by flow and HTTP status code.",
			}, []string{"flow", "code"}),
			legFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "pdcluster_router_leg_failures_total", Help: "Failed legs, retried or not, by leg (prefill, decode) and cause.",
			}, []string{"leg", "cause"}),
			retries: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "pdcluster_router_retries_total", Help: "Attempts retried on another endpoint, by the leg that failed and its cause.",
			}, []string{"leg", "cause"}),
			ejections: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "pdcluster_router_ejections_total", Help: "Endpoints ejected after failing, by pool.",
			}, []string{"pool"}),
			ejectionsWithheld: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "pdcluster_router_ejections_withheld_total", Help: "Ejections due but not made because the endpoint was the last of its pool not ejected, by pool: it serves on.",
			}, []string{"pool"}),
			budgetDenied: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "pdcluster_router_retries_denied_total", Help: "Retries not made because the router's retry budget (failurePolicy.retryBudgetPercent) was spent.",
			}),
			byRevision: prometheus.NewCounterVec(byRevisionOpts, []string{"revision"}),
			bodyBudgetRefused: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "pdcluster_router_body_budget_refused_total", Help: "Requests refused with 503 because the router held its limit of request body bytes (--max-body-bytes-in-flight) already.",
			}),
			registryRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "pdcluster_router_bootstrap_entries_refused_total",
				Help: "Entries of a prefill's bootstrap registry the router did not use, counted each time the registry is read, by reason: rank (a data-parallel rank the pod does not run) or address (a worker not on the prefill pod). Above 0, something registered itself in a prefill's registry.",
			}, []string{"reason"}),
			decodeOnly: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "pdcluster_router_decode_only_total", Help: "Requests sent to decode alone, which computes the prompt itself, after prefill could not serve them (onPrefillFailure: DecodeOnly).",
			}),
		},
	}
	flow := prometheus.Labels{"flow": string(cfg.Flow)}
	histograms := []*prometheus.HistogramVec{
		prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "pdcluster_router_prefill_leg_seconds", Help: "Prefill legs that succeeded, from the request's arrival to prefill's answer, by flow.", Buckets: latencyBuckets,
		}, []string{"flow"}),
		prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "pdcluster_router_first_token_seconds", Help: "From the request's arrival to the first byte of its answer to the client (a stream's first token; a whole answer otherwise), by flow.", Buckets: latencyBuckets,
		}, []string{"flow"}),
		prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "pdcluster_router_request_duration_seconds", Help: "From the request's arrival to the end of its answer, by flow.", Buckets: latencyBuckets,
		}, []string{"flow"}),
	}
	r.metrics.prefillLeg, r.metrics.firstToken, r.metrics.request = histograms[0].With(flow), histograms[1].With(flow), histograms[2].With(flow)
	pairs := pairCounters(&r.metrics.samePairs, &r.metrics.crossPairs)
	if reg != nil {
		m := &r.metrics
		bodyBytes := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "pdcluster_router_body_bytes_in_flight", Help: "Bytes of request bodies the router holds now, each counted as often as the router copies it (4): what --max-body-bytes-in-flight bounds.",
		}, func() float64 { return float64(r.bodies.used.Load()) })
		ejected := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "pdcluster_router_ejected_endpoints", Help: "Endpoints ejected now.",
		}, func() float64 { return float64(r.eject.count()) })
		endpoints := prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "pdcluster_router_endpoints", Help: "Engines the router knows now, by pool (ejected ones included).",
		}, []string{"pool"})
		inFlight := prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "pdcluster_router_in_flight_requests",
			Help: "Requests on each pool's engines now: prefill legs sent and not yet answered; requests on a decode engine until their answer ends. A scaling signal per pool.",
		}, []string{"pool"})
		for _, c := range append([]prometheus.Collector{m.requests, m.legFailures, m.retries, m.ejections, m.ejectionsWithheld, m.budgetDenied, m.decodeOnly, m.byRevision, m.registryRefused, m.bodyBudgetRefused, bodyBytes, ejected, poolGauges{r, endpoints, inFlight},
			histograms[0], histograms[1], histograms[2]}, slices.Concat(pairs, r.canary.collectors(), r.strategy.collectors())...) {
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

// poolGauges collects pdcluster_router_endpoints and pdcluster_router_in_flight_requests at
// each scrape, from what the request path counts anyway.
type poolGauges struct {
	r                   *Router
	endpoints, inFlight *prometheus.GaugeVec
}

func (p poolGauges) Describe(ch chan<- *prometheus.Desc) {
	p.endpoints.Describe(ch)
	p.inFlight.Describe(ch)
}

func (p poolGauges) Collect(ch chan<- prometheus.Metric) {
	pools := p.r.pools.Load()
	p.endpoints.WithLabelValues(string(legPrefill)).Set(float64(len(pools.Prefill)))
	p.endpoints.WithLabelValues(string(legDecode)).Set(float64(len(pools.Decode)))
	p.inFlight.WithLabelValues(string(legPrefill)).Set(float64(p.r.prefillLegs.Load()))
	p.inFlight.WithLabelValues(string(legDecode)).Set(float64(p.r.decodeLegs.Load()))
	p.endpoints.Collect(ch)
	p.inFlight.Collect(ch)
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
	// /health is liveness: the process serves. /ready is readiness: it also knows an engine of
	// each pool, so a Ready PDCluster answers completions instead of 503.
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /ready", func(w http.ResponseWriter, _ *http.Request) {
		pools := r.pools.Load()
		if len(pools.Prefill) == 0 || len(pools.Decode) == 0 {
			writeError(w, http.StatusServiceUnavailable, fmt.Sprintf("pools not resolved yet: %d prefill and %d decode engines", len(pools.Prefill), len(pools.Decode)))
			return
		}
		// By KV revision, one with both pools: a prefill of one and a decode of another serve
		// nothing together.
		if len(pools.Revisions) > 0 && !slices.ContainsFunc(pools.Revisions, func(rev Revision) bool { return rev.serves() }) {
			writeError(w, http.StatusServiceUnavailable, "no KV revision has an engine in both pools yet")
			return
		}
		// Under Required pairing, a domain with both pools: within one revision when there are
		// revisions (engines of two revisions in one rack pair nothing).
		if r.cfg.Pairing == routerconfig.PairingRequired && (len(pools.Revisions) == 0 && len(pools.pairable) == 0 ||
			len(pools.Revisions) > 0 && !slices.ContainsFunc(pools.Revisions, func(rev Revision) bool { return rev.takes })) {
			writeError(w, http.StatusServiceUnavailable, noPairableDomain)
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
	pools := r.pools.Load()
	if len(pools.Revisions) > 0 {
		var why string
		if pools, why = r.pickRevision(pools); pools == nil {
			writeError(sw, http.StatusServiceUnavailable, why)
			return
		}
	} else if len(pools.Prefill) == 0 || len(pools.Decode) == 0 {
		writeError(sw, http.StatusServiceUnavailable, fmt.Sprintf("no ready engines: %d prefill, %d decode", len(pools.Prefill), len(pools.Decode)))
		return
	}
	if r.cfg.Pairing == routerconfig.PairingRequired && len(pools.pairable) == 0 {
		writeError(sw, http.StatusServiceUnavailable, noPairableDomain)
		return
	}
	x := &exchange{r: r, w: sw, req: req, body: body, reqID: reqID, pools: pools, start: start, firstToken: firstTokenBudget(r.policy, body),
		scorer: r.strategy.prepare(body, in.charge)}
	x.run()
}
