package sidecar

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"k8s.io/utils/clock"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// EngineConfig is how the sidecar reads its engine's KV evidence from the engine's own
// /metrics: on loopback, so the operator needs no path to the engine's port.
type EngineConfig struct {
	// MetricsURL is the engine's /metrics (http://127.0.0.1:8000/metrics); empty: not read.
	MetricsURL string
	// Every is how often it is read (15 s when unset).
	Every time.Duration
	// Client reads it (a 5 s timeout when nil).
	Client *http.Client
	// Clock ages the last read; nil is the wall clock.
	Clock clock.PassiveClock
}

// maxEngineMetrics bounds an engine's /metrics answer: vLLM's is a few hundred KiB with
// its histograms.
const maxEngineMetrics = 16 << 20

// engineWatch keeps the last KV evidence read from the engine.
type engineWatch struct {
	cfg EngineConfig
	log logr.Logger

	mu     sync.Mutex
	last   *vllm.EngineStats // the last counts read
	lastAt time.Time
	err    string // why the last read failed; "" when it did not
}

func newEngineWatch(cfg EngineConfig, log logr.Logger) *engineWatch {
	if cfg.Every <= 0 {
		cfg.Every = 15 * time.Second
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: 5 * time.Second,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	return &engineWatch{cfg: cfg, log: log}
}

// run reads the engine every cfg.Every until ctx ends.
func (e *engineWatch) run(ctx context.Context) {
	if e.cfg.MetricsURL == "" {
		return
	}
	t := time.NewTicker(e.cfg.Every)
	defer t.Stop()
	for {
		e.readOnce(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (e *engineWatch) readOnce(ctx context.Context) {
	st, err := e.read(ctx)
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil {
		if e.err == "" {
			e.log.Info("engine metrics not read", "url", e.cfg.MetricsURL, "error", err.Error())
		}
		e.err = err.Error()
		return
	}
	e.last, e.lastAt, e.err = &st, e.cfg.Clock.Now(), ""
}

func (e *engineWatch) read(ctx context.Context) (vllm.EngineStats, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.cfg.MetricsURL, nil)
	if err != nil {
		return vllm.EngineStats{}, err
	}
	// The text format: the parser below reads it, and vLLM serves it by default.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := e.cfg.Client.Do(req)
	if err != nil {
		return vllm.EngineStats{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return vllm.EngineStats{}, fmt.Errorf("GET %s: %s", e.cfg.MetricsURL, resp.Status)
	}
	return ParseEngineMetrics(resp.Body)
}

// state is the evidence for GET /gate: the last counts read, their age, and why the read
// after them failed; nil when the engine is not read or never answered.
func (e *engineWatch) state() *vllm.EngineStats {
	if e == nil {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.cfg.MetricsURL == "" || (e.last == nil && e.err == "") {
		return nil
	}
	st := vllm.EngineStats{Error: e.err}
	if e.last != nil {
		st = *e.last
		st.AgeSeconds, st.Error = e.cfg.Clock.Since(e.lastAt).Seconds(), e.err
	}
	return &st
}

// ParseEngineMetrics takes vLLM's prompt token sources and connector counters from a /metrics
// answer in the text format, summed over the engine's series (data-parallel ranks).
func ParseEngineMetrics(r io.Reader) (vllm.EngineStats, error) {
	lr := &io.LimitedReader{R: r, N: maxEngineMetrics + 1}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(lr)
	if lr.N <= 0 {
		return vllm.EngineStats{}, fmt.Errorf("engine metrics larger than %d bytes", maxEngineMetrics)
	}
	if err != nil {
		return vllm.EngineStats{}, fmt.Errorf("parse engine metrics: %w", err)
	}
	var st vllm.EngineStats
	// The parser names a counter family without its _total (as OpenMetrics does); older
	// parsers keep it. Both are looked up.
	family := func(name string) *dto.MetricFamily {
		if f, ok := families[name]; ok {
			return f
		}
		if base, ok := cutSuffix(name, "_total"); ok {
			return families[base]
		}
		return nil
	}
	if f := family(vllm.MetricPromptTokensBySource); f != nil {
		st.HasPromptSources = true
		for _, m := range f.GetMetric() {
			v := value(m)
			switch label(m, vllm.MetricSourceLabel) {
			case vllm.SourceExternalKV:
				st.ExternalKVTokens += v
			case vllm.SourceLocalCompute:
				st.LocalComputeTokens += v
			case vllm.SourceLocalCacheHit:
				st.LocalCacheHitTokens += v
			}
		}
	}
	sum := func(names []string) float64 {
		var total float64
		for _, n := range names {
			if f := family(n); f != nil {
				for _, m := range f.GetMetric() {
					total += value(m)
				}
			}
		}
		return total
	}
	st.FailedTransfers, st.FailedReceives, st.ExpiredRequests = sum(vllm.MetricFailedTransfers), sum(vllm.MetricFailedReceives), sum(vllm.MetricExpiredRequests)
	histogramSum := func(names ...string) float64 {
		var total float64
		for _, n := range names {
			if f := families[n]; f != nil {
				for _, m := range f.GetMetric() {
					total += m.GetHistogram().GetSampleSum()
				}
			}
		}
		return total
	}
	st.TransferBytes = histogramSum(vllm.MetricMooncakeBytes, vllm.MetricNixlBytes)
	st.TransferSeconds = histogramSum(vllm.MetricMooncakeXferSeconds, vllm.MetricNixlXferSeconds)
	return st, nil
}

func cutSuffix(s, suffix string) (string, bool) {
	if len(s) < len(suffix) || s[len(s)-len(suffix):] != suffix {
		return s, false
	}
	return s[:len(s)-len(suffix)], true
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
