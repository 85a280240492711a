package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// producerMetrics are the prefill engine's transfer counters.
type producerMetrics struct {
	pullsServed      prometheus.Counter
	earlyPulls       prometheus.Counter
	peerConns        prometheus.Counter
	peerConnsRefused prometheus.Counter
	releases         *prometheus.CounterVec
	bytesSent        prometheus.Counter
	formatMismatches prometheus.Counter
}

func newProducerMetrics(p *Producer, reg prometheus.Registerer) (*producerMetrics, error) {
	m := &producerMetrics{
		pullsServed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pdcluster_connector_pulls_served_total",
			Help: "Pull connections accepted by this producer agent.",
		}),
		earlyPulls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pdcluster_connector_early_pulls_total",
			Help: "Pulls that reached this producer agent before their prefill request and waited for it.",
		}),
		peerConns: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pdcluster_connector_peer_connections_total",
			Help: "Data connections accepted by this producer agent (consumers keep them for several pulls).",
		}),
		peerConnsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pdcluster_connector_peer_connections_refused_total",
			Help: "Data connections this producer agent refused: the peer held too many open.",
		}),
		releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_connector_releases_total",
			Help: "Held prefill requests released to the producer scheduler, by reason (served, expired, aborted).",
		}, []string{"reason"}),
		bytesSent: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pdcluster_connector_transfer_bytes_sent_total", Help: "KV bytes sent to consumers.",
		}),
		formatMismatches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vllm_sim_kv_format_mismatches_total", Help: "Pulls refused because the consumer reads another KV format (engines of two KV revisions paired).",
		}),
	}
	err := register(reg, m.pullsServed, m.earlyPulls, m.peerConns, m.peerConnsRefused, m.releases, m.bytesSent, m.formatMismatches,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "pdcluster_connector_producer_blocks_pinned", Help: "KV blocks the producer holds for consumers now.",
		}, func() float64 { return float64(p.core.Stats().BlocksPinned) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "pdcluster_connector_producer_transfers", Help: "Transfers the producer tracks now (admitted or held).",
		}, func() float64 { return float64(p.core.Stats().Transfers) }),
	)
	// Pre-create the labelled series so a scrape shows zeros rather than nothing.
	for _, r := range []kvtransfer.ReleaseReason{kvtransfer.ReleaseServed, kvtransfer.ReleaseExpired, kvtransfer.ReleaseAborted} {
		m.releases.WithLabelValues(string(r))
	}
	return m, err
}

func (m *producerMetrics) released(r kvtransfer.Release) {
	m.releases.WithLabelValues(string(r.Reason)).Inc()
}

// consumerMetrics are the decode engine's transfer counters.
type consumerMetrics struct {
	completions   *prometheus.CounterVec
	emptyPulls    prometheus.Counter
	pulls         prometheus.Counter
	bytesReceived prometheus.Counter
}

func newConsumerMetrics(c *Consumer, reg prometheus.Registerer) (*consumerMetrics, error) {
	m := &consumerMetrics{
		completions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdcluster_connector_completions_total",
			Help: "Pulls reported to the decode scheduler as finished receiving, by result (ok, failed).",
		}, []string{"result"}),
		emptyPulls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pdcluster_connector_empty_pulls_total",
			Help: "Pulls without a local destination block (notify-only); never reported to the scheduler.",
		}),
		pulls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pdcluster_connector_pulls_total",
			Help: "Pulls started by this consumer agent.",
		}),
		bytesReceived: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pdcluster_connector_transfer_bytes_received_total", Help: "KV bytes received from producers and written.",
		}),
	}
	err := register(reg, m.completions, m.emptyPulls, m.pulls, m.bytesReceived,
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "pdcluster_connector_failed_pulls_total",
			Help: "Pulls that failed, reported or not (a failed notify-only pull reports nothing).",
		}, func() float64 { s := c.core.Stats(); return float64(s.Failed + s.FailedSilent) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "pdcluster_connector_pulls_in_flight", Help: "Pulls not drained yet.",
		}, func() float64 { return float64(c.core.Stats().InFlight) }),
	)
	m.completions.WithLabelValues("ok")
	m.completions.WithLabelValues("failed")
	return m, err
}

func register(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func (m *consumerMetrics) completed(c kvtransfer.Completion) {
	if c.Err != nil {
		m.completions.WithLabelValues("failed").Inc()
		return
	}
	m.completions.WithLabelValues("ok").Inc()
}

func (m *consumerMetrics) pullsStarted(meta kvtransfer.PullMeta) {
	m.pulls.Inc()
	if !meta.LocalBlock.HasLocal() {
		m.emptyPulls.Inc()
	}
}
