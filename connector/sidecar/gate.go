package sidecar

import (
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/utils/clock"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// GateConfig is how the sidecar watches the completion gate in its engine (the pdgate plugin).
type GateConfig struct {
	// Required makes the sidecar unready when a gate has not reported within StartupGrace of
	// the sidecar's start, or its last heartbeat is older than HeartbeatTimeout: an engine that
	// runs ungated is restarted by the operator's connector-health loop.
	Required bool
	// StartupGrace covers model loading, before vLLM builds its connector.
	StartupGrace time.Duration
	// HeartbeatTimeout is how stale the last heartbeat may be.
	HeartbeatTimeout time.Duration
	// Ranks is how many data-parallel ranks the engine runs on this pod (0 is 1). vLLM runs one
	// EngineCore, with its own scheduler and so its own gate, per rank: each reports on its
	// own, every one must, and a rank outside 0..Ranks-1 is refused.
	Ranks int
	// Clock times heartbeats; nil is the wall clock.
	Clock clock.PassiveClock
}

// heard is one rank's last heartbeat and when it came.
type heard struct {
	rep vllm.Report
	at  time.Time
}

// gateWatch keeps the last heartbeat of each data-parallel rank's gate.
type gateWatch struct {
	cfg     GateConfig
	started time.Time
	log     logr.Logger
	mu      sync.Mutex
	ranks   map[int]heard
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
	cfg.Ranks = max(cfg.Ranks, 1)
	return &gateWatch{cfg: cfg, started: cfg.Clock.Now(), ranks: map[int]heard{}}
}

// maxHeldSends bounds a report's held_sends: more requests than any engine holds, and what the
// operator's pod-deletion cost (an int32) can carry, so that sums over ranks cannot overflow.
const maxHeldSends = math.MaxInt32

// admit says why a report cannot be kept, or "". The socket is pod-local, but anything in the
// engine container can write to it: counts are validated, not trusted.
func (g *gateWatch) admit(r vllm.Report) string {
	if r.DPRank < 0 || r.DPRank >= g.cfg.Ranks {
		return fmt.Sprintf("bad gate report: data-parallel rank %d, but this pod runs ranks 0..%d (the sidecar's --gate-ranks=%d): the engine's parallelism and the sidecar's disagree", r.DPRank, g.cfg.Ranks-1, g.cfg.Ranks)
	}
	c := r.Counts
	counts := []struct {
		name string
		now  int64
		was  func(vllm.Counts) int64
	}{
		{"gated", c.Gated, func(p vllm.Counts) int64 { return p.Gated }},
		{"passed", c.Passed, func(p vllm.Counts) int64 { return p.Passed }},
		{"failed", c.Failed, func(p vllm.Counts) int64 { return p.Failed }},
		{"expired", c.Expired, func(p vllm.Counts) int64 { return p.Expired }},
		{"send_failures", c.SendFailures, func(p vllm.Counts) int64 { return p.SendFailures }},
	}
	for _, n := range counts {
		if n.now < 0 {
			return fmt.Sprintf("bad gate report: counts.%s is %d; counts are never negative", n.name, n.now)
		}
	}
	if r.HeldSends != nil && (*r.HeldSends < 0 || *r.HeldSends > maxHeldSends) {
		return fmt.Sprintf("bad gate report: held_sends is %d, want 0 to %d", *r.HeldSends, maxHeldSends)
	}
	g.mu.Lock()
	prev, seen := g.ranks[r.DPRank]
	g.mu.Unlock()
	if seen && prev.rep.PID == r.PID {
		for _, n := range counts {
			if was := n.was(prev.rep.Counts); n.now < was {
				return fmt.Sprintf("bad gate report: counts.%s went from %d to %d in process %d; a process's counts only rise", n.name, was, n.now, r.PID)
			}
		}
	}
	return ""
}

// record keeps an admitted report as its rank's last.
func (g *gateWatch) record(r vllm.Report) {
	g.mu.Lock()
	now := g.cfg.Clock.Now()
	prev, seen := g.ranks[r.DPRank]
	// Logged when a rank's gate starts reporting, and again when it comes back after going
	// stale (or reports from a new process): each is a change of what readiness says.
	back := seen && now.Sub(prev.at) > g.cfg.HeartbeatTimeout
	restarted := seen && prev.rep.PID != r.PID
	g.ranks[r.DPRank] = heard{rep: r, at: now}
	g.mu.Unlock()
	if !seen || back || restarted {
		g.log.Info("completion gate reporting", "connector", r.Connector, "vllmVersion", r.VLLMVersion, "role", r.Role, "pid", r.PID, "dpRank", r.DPRank, "afterSilence", back, "newProcess", restarted)
	}
}

// snapshot is each rank's last heartbeat, by rank, and the ranks not heard from yet.
func (g *gateWatch) snapshot() (got []heard, missing []int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for rank := range g.cfg.Ranks {
		if h, ok := g.ranks[rank]; ok {
			got = append(got, h)
		} else {
			missing = append(missing, rank)
		}
	}
	return got, missing
}

// unready says why the sidecar must not be ready for the gate's sake, or "".
func (g *gateWatch) unready() string {
	if !g.cfg.Required {
		return ""
	}
	got, missing := g.snapshot()
	if len(missing) > 0 && g.cfg.Clock.Since(g.started) > g.cfg.StartupGrace {
		if len(got) == 0 {
			return fmt.Sprintf("the engine's completion gate has not reported in %s: is vLLM running the pdgate plugin (kv_connector_module_path, PYTHONPATH)?", g.cfg.StartupGrace)
		}
		return fmt.Sprintf("the completion gate of data-parallel rank(s) %v has not reported in %s (%d of %d ranks report): is every EngineCore running?", missing, g.cfg.StartupGrace, len(got), g.cfg.Ranks)
	}
	for _, h := range got {
		if age := g.cfg.Clock.Since(h.at); age > g.cfg.HeartbeatTimeout {
			return fmt.Sprintf("the engine's completion gate (%s%s) last reported %s ago", h.rep.Connector, g.rankWords(h.rep.DPRank), age.Round(time.Second))
		}
	}
	return ""
}

// rankWords names a rank where the pod runs more than one.
func (g *gateWatch) rankWords(rank int) string {
	if g.cfg.Ranks == 1 {
		return ""
	}
	return fmt.Sprintf(", data-parallel rank %d", rank)
}

// state is GET /gate: the ranks' reports summed, with the lowest rank's connector and versions.
// Loaded only while every rank reports: one ungated or dead EngineCore is the pod's problem.
func (g *gateWatch) state() vllm.State {
	got, missing := g.snapshot()
	if len(got) == 0 {
		return vllm.State{}
	}
	sum := got[0].rep
	sum.HeldSends = nil
	var oldest time.Duration
	for i, h := range got {
		if i > 0 {
			sum.Counts.Gated += h.rep.Counts.Gated
			sum.Counts.Passed += h.rep.Counts.Passed
			sum.Counts.Failed += h.rep.Counts.Failed
			sum.Counts.Expired += h.rep.Counts.Expired
			sum.Counts.SendFailures += h.rep.Counts.SendFailures
		}
		if h.rep.HeldSends != nil {
			n := *h.rep.HeldSends
			if sum.HeldSends != nil {
				n += *sum.HeldSends
			}
			sum.HeldSends = &n
		}
		oldest = max(oldest, g.cfg.Clock.Since(h.at))
	}
	return vllm.State{Loaded: len(missing) == 0 && oldest <= g.cfg.HeartbeatTimeout, Report: &sum, AgeSeconds: oldest.Seconds(), Ranks: len(got)}
}

var (
	gateCompletionsDesc = prometheus.NewDesc("pdcluster_connector_gate_completions_total",
		"finished_recving reports the engine's completion gate saw, by result: gated (a pull with no local block, kept from the scheduler) or passed; engine is the data-parallel rank, as in vLLM's metrics.",
		[]string{"engine", "result"}, nil)
	gateFailuresDesc = prometheus.NewDesc("pdcluster_connector_gate_failed_pulls_total",
		"failed_recving reports of pulls with local blocks the engine's completion gate saw (vLLM's scheduler handles them), by data-parallel rank.",
		[]string{"engine"}, nil)
	gateExpiredDesc = prometheus.NewDesc("pdcluster_connector_gate_expired_records_total",
		"Empty-pull records the gate dropped without a report: past vLLM's abort timeout and then its grace steps; by data-parallel rank.", []string{"engine"}, nil)
	gateDroppedDesc = prometheus.NewDesc("pdcluster_connector_gate_heartbeats_dropped_total",
		"Heartbeats the engine's gate could not deliver to this sidecar, by data-parallel rank.", []string{"engine"}, nil)
	gateLoadedDesc = prometheus.NewDesc("pdcluster_connector_gate_loaded",
		"1 while the completion gate of every data-parallel rank on the pod heartbeats (labels: connector class, vLLM version), else 0.",
		[]string{"connector", "vllm_version"}, nil)
	gateRequiredDesc = prometheus.NewDesc("pdcluster_connector_gate_required",
		"1 when the sidecar is unready without the engine's completion gate (--require-gate), else 0: alert on gate_loaded 0 only where it is 1.", nil, nil)
	gateAgeDesc = prometheus.NewDesc("pdcluster_connector_gate_heartbeat_age_seconds",
		"Seconds since the completion gate of a data-parallel rank last reported (absent before its first report).", []string{"engine"}, nil)
)

// Describe implements prometheus.Collector: the gates' counts as each rank last reported them.
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
	got, _ := g.snapshot()
	for _, h := range got {
		engine, c := strconv.Itoa(h.rep.DPRank), h.rep.Counts
		ch <- prometheus.MustNewConstMetric(gateCompletionsDesc, prometheus.CounterValue, float64(c.Gated), engine, "gated")
		ch <- prometheus.MustNewConstMetric(gateCompletionsDesc, prometheus.CounterValue, float64(c.Passed), engine, "passed")
		ch <- prometheus.MustNewConstMetric(gateFailuresDesc, prometheus.CounterValue, float64(c.Failed), engine)
		ch <- prometheus.MustNewConstMetric(gateExpiredDesc, prometheus.CounterValue, float64(c.Expired), engine)
		ch <- prometheus.MustNewConstMetric(gateDroppedDesc, prometheus.CounterValue, float64(c.SendFailures), engine)
		ch <- prometheus.MustNewConstMetric(gateAgeDesc, prometheus.GaugeValue, g.cfg.Clock.Since(h.at).Seconds(), engine)
	}
	loaded := 0.0
	if st.Loaded {
		loaded = 1
	}
	ch <- prometheus.MustNewConstMetric(gateLoadedDesc, prometheus.GaugeValue, loaded, st.Report.Connector, st.Report.VLLMVersion)
}
