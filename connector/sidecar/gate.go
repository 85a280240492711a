package sidecar

import (
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/utils/clock"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// GateConfig is how the sidecar watches the completion gate in its engine (the pdgate plugin).
type GateConfig struct {
	// Required makes the sidecar unready when the gate has not reported within StartupGrace of
	// the sidecar's start, or its last heartbeat is older than HeartbeatTimeout: an engine that
	// runs ungated is restarted by the operator's connector-health loop.
	Required bool
	// StartupGrace covers model loading, before vLLM builds its connector.
	StartupGrace time.Duration
	// HeartbeatTimeout is how stale the last heartbeat may be.
	HeartbeatTimeout time.Duration
	// Clock times heartbeats; nil is the wall clock.
	Clock clock.PassiveClock
}

// gateWatch keeps the last heartbeat of the engine's gate.
type gateWatch struct {
	cfg     GateConfig
	started time.Time
	log     logr.Logger
	mu      sync.Mutex
	last    *vllm.Report
	lastAt  time.Time
}

func newGateWatch(cfg GateConfig) *gateWatch {
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.StartupGrace <= 0 {
		cfg.StartupGrace = 15 * time.Minute
	}
	if cfg.HeartbeatTimeout <= 0 {
		cfg.HeartbeatTimeout = 30 * time.Second
	}
	return &gateWatch{cfg: cfg, started: cfg.Clock.Now()}
}

func (g *gateWatch) record(r vllm.Report) {
	g.mu.Lock()
	now := g.cfg.Clock.Now()
	// Logged when the gate starts reporting, and again when it comes back after going stale
	// (or reports from a new process): each is a change of what readiness says.
	first := g.last == nil
	back := !first && now.Sub(g.lastAt) > g.cfg.HeartbeatTimeout
	restarted := !first && g.last.PID != r.PID
	g.last, g.lastAt = &r, now
	g.mu.Unlock()
	if first || back || restarted {
		g.log.Info("completion gate reporting", "connector", r.Connector, "vllmVersion", r.VLLMVersion, "role", r.Role, "pid", r.PID, "afterSilence", back, "newProcess", restarted)
	}
}

func (g *gateWatch) snapshot() (*vllm.Report, time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.last == nil {
		return nil, 0
	}
	cp := *g.last
	return &cp, g.cfg.Clock.Since(g.lastAt)
}

// unready says why the sidecar must not be ready for the gate's sake, or "".
func (g *gateWatch) unready() string {
	if !g.cfg.Required {
		return ""
	}
	last, age := g.snapshot()
	switch {
	case last == nil && g.cfg.Clock.Since(g.started) > g.cfg.StartupGrace:
		return fmt.Sprintf("the engine's completion gate has not reported in %s: is vLLM running the pdgate plugin (kv_connector_module_path, PYTHONPATH)?", g.cfg.StartupGrace)
	case last != nil && age > g.cfg.HeartbeatTimeout:
		return fmt.Sprintf("the engine's completion gate (%s) last reported %s ago", last.Connector, age.Round(time.Second))
	}
	return ""
}

// state is GET /gate.
func (g *gateWatch) state() vllm.State {
	last, age := g.snapshot()
	if last == nil {
		return vllm.State{}
	}
	return vllm.State{Loaded: age <= g.cfg.HeartbeatTimeout, Report: last, AgeSeconds: age.Seconds()}
}

var (
	gateCompletionsDesc = prometheus.NewDesc("pdcluster_connector_gate_completions_total",
		"finished_recving reports the engine's completion gate saw, by result: gated (a pull with no local block, kept from the scheduler) or passed.",
		[]string{"result"}, nil)
	gateFailuresDesc = prometheus.NewDesc("pdcluster_connector_gate_failed_pulls_total",
		"failed_recving reports of pulls with local blocks the engine's completion gate saw (vLLM's scheduler handles them).",
		nil, nil)
	gateExpiredDesc = prometheus.NewDesc("pdcluster_connector_gate_expired_records_total",
		"Empty-pull records the gate dropped without a report: past vLLM's abort timeout and then its grace steps.", nil, nil)
	gateDroppedDesc = prometheus.NewDesc("pdcluster_connector_gate_heartbeats_dropped_total",
		"Heartbeats the engine's gate could not deliver to this sidecar.", nil, nil)
	gateLoadedDesc = prometheus.NewDesc("pdcluster_connector_gate_loaded",
		"1 while the engine's completion gate heartbeats (labels: connector class, vLLM version), else 0.",
		[]string{"connector", "vllm_version"}, nil)
	gateRequiredDesc = prometheus.NewDesc("pdcluster_connector_gate_required",
		"1 when the sidecar is unready without the engine's completion gate (--require-gate), else 0: alert on gate_loaded 0 only where it is 1.", nil, nil)
	gateAgeDesc = prometheus.NewDesc("pdcluster_connector_gate_heartbeat_age_seconds",
		"Seconds since the engine's completion gate last reported (absent before the first report).", nil, nil)
)

// Describe implements prometheus.Collector: the gate's counts as the engine last reported them.
func (g *gateWatch) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{gateCompletionsDesc, gateFailuresDesc, gateExpiredDesc, gateDroppedDesc, gateLoadedDesc, gateRequiredDesc, gateAgeDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (g *gateWatch) Collect(ch chan<- prometheus.Metric) {
	required := 0.0
	if g.cfg.Required {
		required = 1
	}
	ch <- prometheus.MustNewConstMetric(gateRequiredDesc, prometheus.GaugeValue, required)
	st := g.state()
	if st.Report == nil {
		ch <- prometheus.MustNewConstMetric(gateLoadedDesc, prometheus.GaugeValue, 0, "", "")
		return
	}
	c := st.Report.Counts
	ch <- prometheus.MustNewConstMetric(gateCompletionsDesc, prometheus.CounterValue, float64(c.Gated), "gated")
	ch <- prometheus.MustNewConstMetric(gateCompletionsDesc, prometheus.CounterValue, float64(c.Passed), "passed")
	ch <- prometheus.MustNewConstMetric(gateFailuresDesc, prometheus.CounterValue, float64(c.Failed))
	ch <- prometheus.MustNewConstMetric(gateExpiredDesc, prometheus.CounterValue, float64(c.Expired))
	ch <- prometheus.MustNewConstMetric(gateDroppedDesc, prometheus.CounterValue, float64(c.SendFailures))
	loaded := 0.0
	if st.Loaded {
		loaded = 1
	}
	ch <- prometheus.MustNewConstMetric(gateLoadedDesc, prometheus.GaugeValue, loaded, st.Report.Connector, st.Report.VLLMVersion)
	ch <- prometheus.MustNewConstMetric(gateAgeDesc, prometheus.GaugeValue, st.AgeSeconds)
}
