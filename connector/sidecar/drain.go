package sidecar

import (
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// engineGone is how long the gate may be silent before a drain stops waiting for it: two of
// its 5 s heartbeats and a margin. An engine that finished its drain (or died) reports no more,
// and its last count of held sends is then no reason to wait.
const engineGone = 11 * time.Second

// DrainResult is the answer to POST /v1/drain.
type DrainResult struct {
	// HeldSends is what the engine held when the drain ended (-1: it never said).
	HeldSends int64 `json:"heldSends"`
	// WaitedSeconds is how long the drain took.
	WaitedSeconds float64 `json:"waitedSeconds"`
	// Reason is why it ended: "drained", "engine silent", "timeout" or "cancelled".
	Reason string `json:"reason"`
}

// heldSends is what the engine's gates last said they hold, summed over its data-parallel
// ranks, and whether that is current: every rank heard within engineGone.
func (g *gateWatch) heldSends() (n int64, known, current bool) {
	got, missing := g.snapshot()
	current = len(got) > 0 && len(missing) == 0
	for _, h := range got {
		if h.rep.HeldSends != nil {
			n += *h.rep.HeldSends
			known = true
		}
		current = current && g.cfg.Clock.Since(h.at) <= engineGone
	}
	return n, known, current
}

// drainOver is how long after its drain ended a pod that is still running becomes ready
// again: the kubelet sends SIGTERM as soon as the preStop hook returns, so a sidecar still
// running this much later belongs to a pod that is not being deleted (a drain asked outside
// the preStop hook), and unready for good it would be replaced by the operator.
const drainOver = 60 * time.Second

// handleDrain is POST /v1/drain: unready from now on, and an answer once the engine holds no
// KV for a pull not made yet and min has passed, or at timeout. Only the sidecar's container
// reaches it (ControlHandler). Readiness returns drainOver after the drain ended.
func (s *Sidecar) handleDrain(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	minWait, err1 := time.ParseDuration(q.Get("min"))
	timeout, err2 := time.ParseDuration(q.Get("timeout"))
	if err1 != nil || err2 != nil || minWait < 0 || timeout < minWait {
		s.refuse(w, r, http.StatusBadRequest, fmt.Sprintf("bad drain: want min and timeout durations with 0 <= min <= timeout, got min=%q timeout=%q", q.Get("min"), q.Get("timeout")))
		return
	}
	// The server's write timeout is for heartbeats and probes, not for a drain.
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(timeout + 10*time.Second))
	clk := s.gate.cfg.Clock
	start := clk.Now()
	s.drains.Add(1)
	if s.draining.CompareAndSwap(false, true) {
		s.log.Info("draining: the pod is being deleted", "min", minWait, "timeout", timeout)
	}
	res := DrainResult{HeldSends: -1}
	for res.Reason == "" {
		held, known, current := s.gate.heldSends()
		if known {
			res.HeldSends = held
		}
		waited := clk.Since(start)
		switch {
		case waited >= timeout:
			res.Reason = "timeout"
		case waited < minWait:
		case !current:
			res.Reason = "engine silent"
		case held == 0:
			res.Reason = "drained"
		}
		if res.Reason != "" {
			break
		}
		select {
		case <-r.Context().Done():
			res.Reason = "cancelled"
		case <-time.After(s.drainPoll):
		}
	}
	res.WaitedSeconds = clk.Since(start).Seconds()
	s.log.Info("drain ended", "reason", res.Reason, "heldSends", res.HeldSends, "waited", clk.Since(start).Round(time.Millisecond))
	go s.endDrain()
	writeJSON(w, res)
}

// endDrain makes the pod ready again drainOver after a drain ended, unless another drain
// runs then: a sidecar that lives that long is not being deleted.
func (s *Sidecar) endDrain() {
	time.Sleep(s.drainOver)
	if s.drains.Add(-1) == 0 && s.draining.CompareAndSwap(true, false) {
		s.log.Info("drain over and the pod still runs (it is not being deleted): ready again", "after", s.drainOver)
	}
}

var (
	heldSendsDesc = prometheus.NewDesc("pdcluster_connector_held_kv_sends",
		"Requests whose KV blocks the engine holds for a pull not made yet, as its completion gate last reported (a prefill pod deleted now would fail those pulls; absent until reported).", nil, nil)
	drainingDesc = prometheus.NewDesc("pdcluster_connector_draining",
		"1 once the pod is being deleted and the sidecar drains, else 0.", nil, nil)
)

// drainCollector exports the drain's state.
type drainCollector struct{ s *Sidecar }

func (d drainCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- heldSendsDesc
	ch <- drainingDesc
}

func (d drainCollector) Collect(ch chan<- prometheus.Metric) {
	if held, known, _ := d.s.gate.heldSends(); known {
		ch <- prometheus.MustNewConstMetric(heldSendsDesc, prometheus.GaugeValue, float64(held))
	}
	draining := 0.0
	if d.s.draining.Load() {
		draining = 1
	}
	ch <- prometheus.MustNewConstMetric(drainingDesc, prometheus.GaugeValue, draining)
}
