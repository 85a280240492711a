package enginesim

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// promptTokensDesc is vLLM's vllm:prompt_tokens_by_source_total, with its labels (model_name,
// engine: the DP rank, source). client_golang takes the family name with _total, as vLLM's
// prometheus_client writes it.
var promptTokensDesc = prometheus.NewDesc(vllm.MetricPromptTokensBySource, "Number of prompt tokens by source.",
	[]string{"model_name", "engine", vllm.MetricSourceLabel}, nil)

// connectorCounters are the connector's vLLM counters the stand-in keeps: failed receives
// (decode) and expired held requests (prefill), by connector.
var connectorCounters = map[string][2]*prometheus.Desc{
	"mooncake": {prometheus.NewDesc(vllm.MetricMooncakeFailedRecvs, "Number of failed Mooncake KV Cache receives.", []string{"model_name", "engine"}, nil),
		prometheus.NewDesc(vllm.MetricMooncakeExpired, "Number of requests that had their KV expire.", []string{"model_name", "engine"}, nil)},
	"nixl": {prometheus.NewDesc(vllm.MetricNixlFailedTransfers, "Number of failed NIXL KV Cache transfers.", []string{"model_name", "engine"}, nil),
		prometheus.NewDesc(vllm.MetricNixlExpired, "Number of requests that had their KV expire.", []string{"model_name", "engine"}, nil)},
}

// Collector exports what the engines counted (one per data-parallel rank of a `vllm serve`,
// each under its rank's engine label) under vLLM's metric names: the prompt tokens by source
// as the scheduler model counted them when each prefill ran, and the connector's failed
// receives and expired requests as its transfer engine reported them.
func Collector(engines ...*Engine) prometheus.Collector { return engineCollector(engines) }

type engineCollector []*Engine

func (c engineCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- promptTokensDesc
	if ds, ok := connectorCounters[c[0].cfg.Connector]; ok {
		for _, d := range ds {
			ch <- d
		}
	}
}

func (c engineCollector) Collect(ch chan<- prometheus.Metric) {
	for _, e := range c {
		t, rank := e.sched.Stats().Tokens, strconv.Itoa(e.cfg.DPRank)
		for source, n := range map[string]uint64{vllm.SourceLocalCompute: t.LocalCompute, vllm.SourceLocalCacheHit: t.LocalCacheHit, vllm.SourceExternalKV: t.ExternalKV} {
			ch <- prometheus.MustNewConstMetric(promptTokensDesc, prometheus.CounterValue, float64(n), e.cfg.Model, rank, source)
		}
		if d, ok := connectorCounters[e.cfg.Connector]; ok {
			ch <- prometheus.MustNewConstMetric(d[0], prometheus.CounterValue, float64(e.failedRecvs.Load()), e.cfg.Model, rank)
			ch <- prometheus.MustNewConstMetric(d[1], prometheus.CounterValue, float64(e.expired.Load()), e.cfg.Model, rank)
		}
	}
}
