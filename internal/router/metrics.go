// The router's own metrics, built and listed in one place (its canary's and its routing
// strategy's are theirs: canary.go, strategy.go).

package router

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the series the request path counts, and every collector of the router's own.
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

	// collectors are all of the above and the gauges read from r's state at the scrape.
	collectors []prometheus.Collector
}

// latencyBuckets span 5 ms to 40 s.
var latencyBuckets = prometheus.ExponentialBuckets(0.005, 2, 14)

// Localities of pdcluster_router_pairs_total.
const (
	localitySame  = "same-domain"
	localityCross = "cross-domain"
)

// init builds r's metrics, m; its gauges read r's state at each scrape.
func (m *metrics) init(r *Router) {
	*m = metrics{
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
		byRevision: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_router_revision_requests_total",
			Help: "Requests sent to the engines of each KV revision (a request's prefill and decode always share one).",
		}, []string{"revision"}),
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
	}
	flow := prometheus.Labels{"flow": string(r.cfg.Flow)}
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
	m.prefillLeg, m.firstToken, m.request = histograms[0].With(flow), histograms[1].With(flow), histograms[2].With(flow)
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
	m.collectors = []prometheus.Collector{m.requests, m.legFailures, m.retries, m.ejections, m.ejectionsWithheld, m.budgetDenied, m.decodeOnly, m.byRevision, m.registryRefused, m.bodyBudgetRefused,
		histograms[0], histograms[1], histograms[2], bodyBytes, ejected, poolGauges{r, endpoints, inFlight}}
	for locality, n := range map[string]*atomic.Int64{localitySame: &m.samePairs, localityCross: &m.crossPairs} {
		m.collectors = append(m.collectors, prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "pdcluster_router_pairs_total",
			Help:        "Prefill and decode engines paired for a request attempt (spec.scheduling.pairing), by locality: same-domain or cross-domain.",
			ConstLabels: prometheus.Labels{"locality": locality},
		}, func() float64 { return float64(n.Load()) }))
	}
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
