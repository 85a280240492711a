package vllm

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// MaxEngineMetrics bounds an engine's /metrics answer: vLLM's is a few hundred KiB with
// its histograms.
const MaxEngineMetrics = 16 << 20

// ParseEngineMetrics takes vLLM's prompt token sources and connector counters from a /metrics
// answer in the text format, summed over the engine's series (data-parallel ranks).
func ParseEngineMetrics(r io.Reader) (EngineStats, error) {
	lr := &io.LimitedReader{R: r, N: MaxEngineMetrics + 1}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(lr)
	if lr.N <= 0 {
		return EngineStats{}, fmt.Errorf("engine metrics larger than %d bytes", MaxEngineMetrics)
	}
	if err != nil {
		return EngineStats{}, fmt.Errorf("parse engine metrics: %w", err)
	}
	var st EngineStats
	// The parser names a counter family without its _total (as OpenMetrics does); older
	// parsers keep it. Both are looked up.
	family := func(name string) *dto.MetricFamily {
		if f, ok := families[name]; ok {
			return f
		}
		if base, ok := strings.CutSuffix(name, "_total"); ok {
			return families[base]
		}
		return nil
	}
	if f := family(MetricPromptTokensBySource); f != nil {
		st.HasPromptSources = true
		for _, m := range f.GetMetric() {
			v := value(m)
			switch label(m, MetricSourceLabel) {
			case SourceExternalKV:
				st.ExternalKVTokens += v
			case SourceLocalCompute:
				st.LocalComputeTokens += v
			case SourceLocalCacheHit:
				st.LocalCacheHitTokens += v
			}
		}
	}
	// sum adds get over every series of the families named.
	sum := func(get func(*dto.Metric) float64, names ...string) float64 {
		var total float64
		for _, n := range names {
			if f := family(n); f != nil {
				for _, m := range f.GetMetric() {
					total += get(m)
				}
			}
		}
		return total
	}
	st.FailedTransfers, st.FailedReceives = sum(value, MetricFailedTransfers...), sum(value, MetricFailedReceives...)
	st.ExpiredRequests = sum(value, MetricExpiredRequests...)
	histogramSum := func(m *dto.Metric) float64 { return m.GetHistogram().GetSampleSum() }
	st.TransferBytes = sum(histogramSum, MetricMooncakeBytes, MetricNixlBytes)
	st.TransferSeconds = sum(histogramSum, MetricMooncakeXferSeconds, MetricNixlXferSeconds)
	// The text format allows NaN and infinities; no count is either, and JSON has neither.
	for name, v := range map[string]float64{
		"external KV tokens": st.ExternalKVTokens, "local compute tokens": st.LocalComputeTokens,
		"local cache hit tokens": st.LocalCacheHitTokens, "failed transfers": st.FailedTransfers,
		"failed receives": st.FailedReceives, "expired requests": st.ExpiredRequests,
		"transfer bytes": st.TransferBytes, "transfer seconds": st.TransferSeconds,
	} {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return EngineStats{}, fmt.Errorf("engine metrics: %s is not a number (%v)", name, v)
		}
	}
	return st, nil
}

func value(m *dto.Metric) float64 {
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	}
	return 0
}

func label(m *dto.Metric, name string) string {
	i := slices.IndexFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == name })
	if i < 0 {
		return ""
	}
	return m.GetLabel()[i].GetValue()
}
