package enginesim

import (
	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// promptTokensDesc is vLLM's vllm:prompt_tokens_by_source_total, with its labels (model_name,
// engine: the DP rank, source). client_golang takes the family name with _total, as vLLM's
// prometheus_client writes it.
var promptTokensDesc = prometheus.NewDesc(vllm.MetricPromptTokensBySource, "Number of prompt tokens by source.",
	[]string{"model_name", "engine", vllm.MetricSourceLabel}, nil)

// Collector exports what the engine's scheduler counted under vLLM's metric names: the prompt
// tokens by source as the scheduler model counted them when each prefill ran.
func (e *Engine) Collector() prometheus.Collector { return engineCollector{e} }

type engineCollector struct{ e *Engine }

func (c engineCollector) Describe(ch chan<- *prometheus.Desc) { ch <- promptTokensDesc }

func (c engineCollector) Collect(ch chan<- prometheus.Metric) {
	t := c.e.sched.Stats().Tokens
	for source, n := range map[string]uint64{vllm.SourceLocalCompute: t.LocalCompute, vllm.SourceLocalCacheHit: t.LocalCacheHit, vllm.SourceExternalKV: t.ExternalKV} {
		ch <- prometheus.MustNewConstMetric(promptTokensDesc, prometheus.CounterValue, float64(n), c.e.cfg.Model, "0", source)
	}
}
