package rollout

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"pdcluster.dev/pdcluster-operator/test/golden"
)

// simulate runs a rollout from an old revision at the target to the update revision, the
// update revision's pods becoming ready lag steps after they are asked for (0: by the next
// step), and
// returns one line per step. It fails the test if a step leaves no revision serving (ready in
// both pools), leaves an older revision with one pool, leaves more pods of a pool below its
// target not ready than maxUnavailable allows, or the rollout does not end.
func simulate(t *testing.T, in Input, lag int) string {
	t.Helper()
	// The bound, from the input alone: at most maxUnavailable of a pool's target not ready.
	target, maxUnavailable := in.Target, in.MaxUnavailable
	var b strings.Builder
	fmt.Fprintf(&b, "target %dP/%dD, maxSurge %d/%d, maxUnavailable %d/%d, readiness after %d step(s)\n",
		in.Target.Prefill, in.Target.Decode, in.MaxSurge.Prefill, in.MaxSurge.Decode, in.MaxUnavailable.Prefill, in.MaxUnavailable.Decode, lag)
	var asked []Counts
	for n := 1; n <= 50; n++ {
		s := Plan(in)
		fmt.Fprintf(&b, "step %2d: update %dP/%dD (ready %dP/%dD)", n, s.Update.Prefill, s.Update.Decode, in.Update.Ready.Prefill, in.Update.Ready.Decode)
		for i, o := range s.Old {
			fmt.Fprintf(&b, ", %s %dP/%dD (ready %dP/%dD)", in.Old[i].Name, o.Prefill, o.Decode, in.Old[i].Ready.Prefill, in.Old[i].Ready.Decode)
		}
		if s.Done {
			b.WriteString(": done\n")
			return b.String()
		}
		b.WriteString("\n")
		serving := in.Update.Ready.Prefill > 0 && in.Update.Ready.Decode > 0
		for i, o := range s.Old {
			if (o.Prefill == 0) != (o.Decode == 0) {
				t.Fatalf("step %d leaves %s with one pool: %+v", n, in.Old[i].Name, o)
			}
			serving = serving || (min(o.Prefill, in.Old[i].Ready.Prefill) > 0 && min(o.Decode, in.Old[i].Ready.Decode) > 0)
		}
		if !serving {
			t.Fatalf("step %d leaves no revision ready in both pools:\n%s", n, b.String())
		}
		// Right after the step the older revisions have shrunk and the update revision's new
		// pods are not ready yet: what is ready then is the least the pools have.
		for _, pool := range []struct {
			name    string
			prefill bool
		}{{"prefill", true}, {"decode", false}} {
			ready := min(s.Update.get(pool.prefill), in.Update.Ready.get(pool.prefill))
			for i, o := range s.Old {
				ready += min(o.get(pool.prefill), in.Old[i].Ready.get(pool.prefill))
			}
			if unavailable := target.get(pool.prefill) - ready; unavailable > maxUnavailable.get(pool.prefill) {
				t.Fatalf("step %d leaves %d %s pods of %d ready, %d unavailable, want at most maxUnavailable %d:\n%s",
					n, ready, pool.name, target.get(pool.prefill), unavailable, maxUnavailable.get(pool.prefill), b.String())
			}
		}
		// Apply: the Deployments ask what the step says. The update revision's pods asked
		// at step n are ready at step n+lag (while still asked); the older revisions only
		// shrink, at once.
		asked = append(asked, s.Update)
		next := in
		next.Update.Replicas = s.Update
		if k := len(asked) - 1 - lag; k >= 0 {
			next.Update.Ready = Counts{Prefill: min(s.Update.Prefill, asked[k].Prefill), Decode: min(s.Update.Decode, asked[k].Decode)}
		}
		next.Old = append([]Revision(nil), in.Old...)
		for i := range next.Old {
			next.Old[i].Replicas = s.Old[i]
			next.Old[i].Ready = Counts{Prefill: min(s.Old[i].Prefill, in.Old[i].Ready.Prefill), Decode: min(s.Old[i].Decode, in.Old[i].Ready.Decode)}
		}
		in = next
	}
	t.Fatalf("no end after 50 steps:\n%s", b.String())
	return ""
}

func start(target, surge, unavailable Counts) Input {
	return Input{Target: target, MaxSurge: surge, MaxUnavailable: unavailable,
		Update: Revision{Name: "new"}, Old: []Revision{{Name: "old", Replicas: target, Ready: target}}}
}

// The rollouts of the tables, step by step, against golden files.
func TestPlanGolden(t *testing.T) {
	cases := []struct {
		name string
		in   Input
		lag  int
	}{
		{"5p2d-surge2", start(Counts{5, 2}, Counts{2, 2}, Counts{0, 0}), 0},
		{"5p2d-surge2-slow-readiness", start(Counts{5, 2}, Counts{2, 2}, Counts{0, 0}), 2},
		{"2p10d-unavailable2", start(Counts{2, 10}, Counts{0, 0}, Counts{2, 2}), 0},
		{"1p1d-defaults", start(Counts{1, 1}, Counts{1, 1}, Counts{0, 0}), 1},
		{"3p3d-surge1-unavailable1", start(Counts{3, 3}, Counts{1, 1}, Counts{1, 1}), 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := simulate(t, tc.in, tc.lag)
			golden.Equal(t, filepath.Join("testdata", tc.name+".golden.txt"), []byte(got), "go test ./internal/rollout -update")
		})
	}
}

// An older revision that has lost one pool serves nothing: it goes whole at once. Two older
// revisions shrink oldest first. Both budgets 0 mean a surge of 1.
func TestPlanRules(t *testing.T) {
	half := Input{Target: Counts{2, 2}, Update: Revision{Name: "new", Replicas: Counts{1, 1}, Ready: Counts{1, 1}},
		Old: []Revision{{Name: "old", Replicas: Counts{0, 2}, Ready: Counts{0, 2}}}, MaxSurge: Counts{1, 1}}
	if s := Plan(half); s.Old[0] != (Counts{}) {
		t.Errorf("an older revision without prefill kept %+v, want none", s.Old[0])
	}
	two := Input{Target: Counts{4, 4}, MaxSurge: Counts{0, 0}, MaxUnavailable: Counts{2, 2},
		Update: Revision{Name: "c"},
		Old:    []Revision{{Name: "a", Replicas: Counts{2, 2}, Ready: Counts{2, 2}}, {Name: "b", Replicas: Counts{2, 2}, Ready: Counts{2, 2}}}}
	if s := Plan(two); s.Old[0] != (Counts{}) || s.Old[1] != (Counts{2, 2}) {
		t.Errorf("two older revisions: %+v, want the oldest down first", s.Old)
	}
	zero := start(Counts{1, 1}, Counts{}, Counts{})
	if s := Plan(zero); s.Update != (Counts{1, 1}) {
		t.Errorf("both budgets 0: update %+v, want a surge of 1", s.Update)
	}
}

// Rollouts beyond the golden ones, each pool with its own budgets and readiness slow or quick:
// simulate holds every step to maxUnavailable, a serving revision and whole older revisions.
func TestPlanStaysWithinMaxUnavailable(t *testing.T) {
	cases := []struct {
		name                string
		target, surge, unav Counts
	}{
		{"unavailable only", Counts{4, 4}, Counts{0, 0}, Counts{1, 3}},
		{"surge only", Counts{3, 6}, Counts{1, 2}, Counts{0, 0}},
		{"both", Counts{6, 2}, Counts{2, 1}, Counts{3, 1}},
		{"one pool's budget spent first", Counts{2, 8}, Counts{0, 1}, Counts{1, 0}},
	}
	for _, tc := range cases {
		for lag := range 3 {
			t.Run(fmt.Sprintf("%s/readiness after %d", tc.name, lag), func(t *testing.T) {
				simulate(t, start(tc.target, tc.surge, tc.unav), lag)
			})
		}
	}
}
