package enginesim

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// The stand-in's gate follows pdgate's rule (connector/vllm/tests/test_gate.py has the same
// cases against the plugin itself; on vLLM's engines, test/realengine's bothSides: records go
// with their reports on 0.30.0, by deadline and steps on 0.32.0).
func TestGateRule(t *testing.T) {
	empty := kvtransfer.PullMeta{Request: "e", Transfer: "x-e"}
	full := kvtransfer.PullMeta{Request: "f", Transfer: "x-f", WaitingForRemote: true, LocalBlock: kvtransfer.BlockIDs{{3}}}
	cases := []struct {
		name     string
		run      func(g *gate, clock *time.Time) []bool // the pass verdicts of the reports
		wantPass []bool
		want     vllm.Counts
	}{
		{
			name: "an empty pull's report is gated, a full one's passed",
			run: func(g *gate, _ *time.Time) []bool {
				g.observe(empty)
				g.observe(full)
				g.tick()
				return []bool{g.pass(kvtransfer.Completion{Request: "e"}), g.pass(kvtransfer.Completion{Request: "f"})}
			},
			wantPass: []bool{false, true},
			want:     vllm.Counts{Gated: 1, Passed: 1},
		},
		{
			name: "time alone never drops a record: an idle engine's held report is gated",
			run: func(g *gate, clock *time.Time) []bool {
				g.observe(empty)
				*clock = clock.Add(time.Hour)
				g.tick() // the next request's step
				g.tick()
				return []bool{g.pass(kvtransfer.Completion{Request: "e"})}
			},
			wantPass: []bool{false},
			want:     vllm.Counts{Gated: 1},
		},
		{
			name: "past the deadline and the grace steps the record goes",
			run: func(g *gate, clock *time.Time) []bool {
				g.observe(empty)
				*clock = clock.Add(time.Hour)
				for range 1 + 3 {
					g.tick()
				}
				return []bool{g.pass(kvtransfer.Completion{Request: "e"})}
			},
			wantPass: []bool{true},
			want:     vllm.Counts{Passed: 1, Expired: 1},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			clock := time.Unix(1000, 0)
			g := newGate(time.Minute, 3, func() time.Time { return clock })
			if d := cmp.Diff(tc.wantPass, tc.run(g, &clock)); d != "" {
				t.Errorf("passed (-want +got):\n%s", d)
			}
			if d := cmp.Diff(tc.want, g.counts); d != "" {
				t.Errorf("counts (-want +got):\n%s", d)
			}
		})
	}
}
