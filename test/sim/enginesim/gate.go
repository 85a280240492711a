package enginesim

import (
	"time"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// Defaults of pdgate's gate (connector/vllm/pdgate/gate.py: DEFAULT_TTL_SECONDS,
// DEFAULT_GRACE_STEPS), and the environment variable both read the TTL from.
const (
	DefaultGateTTL   = 660 * time.Second
	DefaultGateGrace = 64
	GateTTLEnv       = "PDGATE_TTL_SECONDS"
)

// gate is pdgate's completion gate, run by the stand-in where vLLM would run the plugin: the
// same rule, so the stand-in fails where vLLM with pdgate would. Pulls with no local block are
// recorded when the scheduler builds them; their reports are stripped before the scheduler
// sees them; a record goes when its report passes, or past its deadline and then grace
// scheduler steps (time alone never drops one: an idle engine does not step).
type gate struct {
	ttl   time.Duration
	grace int
	now   func() time.Time

	step    int
	records map[kvtransfer.RequestID]*gateRecord
	counts  vllm.Counts
}

type gateRecord struct {
	deadline time.Time
	overdue  int // the step at which the deadline was seen passed; 0 before
}

func newGate(ttl time.Duration, grace int, now func() time.Time) *gate {
	if ttl <= 0 {
		ttl = DefaultGateTTL
	}
	if grace <= 0 {
		grace = DefaultGateGrace
	}
	if now == nil {
		now = time.Now
	}
	return &gate{ttl: ttl, grace: grace, now: now, records: map[kvtransfer.RequestID]*gateRecord{}}
}

// observe is build_connector_meta's half: a pull the scheduler built.
func (g *gate) observe(p kvtransfer.PullMeta) {
	delete(g.records, p.Request) // the newest pull of a request decides
	if !p.LocalBlock.HasLocal() {
		g.records[p.Request] = &gateRecord{deadline: g.now().Add(g.ttl)}
	}
}

// tick is one scheduler step: records past their deadline start their grace steps, and those
// past both go.
func (g *gate) tick() {
	g.step++
	now := g.now()
	for id, r := range g.records {
		switch {
		case r.overdue == 0 && !now.Before(r.deadline):
			r.overdue = g.step
		case r.overdue > 0 && g.step-r.overdue >= g.grace:
			delete(g.records, id)
			g.counts.Expired++
		}
	}
}

// pass is update_connector_output's half: whether the scheduler may hear of c.
func (g *gate) pass(c kvtransfer.Completion) bool {
	if _, empty := g.records[c.Request]; empty {
		delete(g.records, c.Request)
		g.counts.Gated++
		return false
	}
	g.counts.Passed++
	if c.Err != nil {
		g.counts.Failed++
	}
	return true
}
