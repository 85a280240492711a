package router

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

func TestBalancerPicks(t *testing.T) {
	urls := []string{"a", "b", "c"}
	cases := []struct {
		name    string
		balance routerconfig.Balance
		// busy engines keep a request in flight from before; then six requests each end
		// before the next is picked, except those of the engines in hold.
		busy, hold []string
		want       []string
	}{
		{"round robin takes turns whatever the load", routerconfig.BalanceRoundRobin, []string{"a", "a"}, nil,
			[]string{"a", "b", "c", "a", "b", "c"}},
		{"least in flight takes turns among idle engines", routerconfig.BalanceLeastInFlight, nil, nil,
			[]string{"a", "b", "c", "a", "b", "c"}},
		{"least in flight avoids a busy engine", "", []string{"b"}, nil,
			[]string{"a", "c", "c", "a", "c", "c"}},
		{"requests that stay count until done", routerconfig.BalanceLeastInFlight, nil, []string{"a", "b", "c"},
			[]string{"a", "b", "c", "a", "b", "c"}},
		{"a slow engine holding its requests gets fewer", routerconfig.BalanceLeastInFlight, nil, []string{"a"},
			[]string{"a", "b", "c", "b", "b", "c"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := newBalancer(tc.balance)
			for _, u := range tc.busy {
				b.inFlight[u]++
			}
			var got []string
			for range tc.want {
				p, _ := b.pick(len(urls), func(i int) string { return urls[i] }, nil, nil)
				got = append(got, urls[p.index])
				if !contains(tc.hold, urls[p.index]) {
					b.done(p)
				}
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("picks (-want +got):\n%s", diff)
			}
		})
	}
}

func TestBalancerForgetsIdleEngines(t *testing.T) {
	b := newBalancer(routerconfig.BalanceLeastInFlight)
	p, _ := b.pick(1, func(int) string { return "gone" }, nil, nil)
	b.done(p)
	if s := b.snapshot(); len(s) != 0 {
		t.Errorf("in flight after every request ended: %v, want nothing", s)
	}
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

// With a preference (PrefixAware routing) the engine holding most of the prompt is picked,
// the less loaded of equals, unless it has more than slack requests in flight above the least
// loaded engine: then least-in-flight picks, and the pick says an engine holding more was
// passed over. Holding nothing, the preference changes nothing.
func TestBalancerPrefersWhatEnginesHold(t *testing.T) {
	urls := []string{"a", "b", "c"}
	for _, tc := range []struct {
		name       string
		matched    []int
		slack      int
		busy       []string
		want       string
		passedOver bool
	}{
		{"the engine holding most", []int{0, 3, 1}, 2, nil, "b", false},
		{"equals: the less loaded", []int{2, 2, 0}, 2, []string{"a"}, "b", false},
		{"within the slack", []int{0, 5, 0}, 2, []string{"b", "b"}, "b", false},
		{"past the slack: the least loaded", []int{0, 5, 0}, 2, []string{"b", "b", "b"}, "a", true},
		{"past the slack: the most held among the rest", []int{0, 5, 1}, 0, []string{"b"}, "c", true},
		{"nothing held: least in flight's turn", []int{0, 0, 0}, 2, []string{"a"}, "b", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBalancer(routerconfig.BalanceLeastInFlight)
			for _, u := range tc.busy {
				b.inFlight[u]++
			}
			p, ok := b.pick(len(urls), func(i int) string { return urls[i] }, nil, &preference{matched: tc.matched, slack: tc.slack})
			if !ok || urls[p.index] != tc.want || p.url != tc.want || p.matched != tc.matched[p.index] || p.passedOver != tc.passedOver {
				t.Errorf("picked %+v (%s), want %s, passed over %v", p, urls[p.index], tc.want, tc.passedOver)
			}
			if b.inFlight[tc.want] != count(tc.busy, tc.want)+1 {
				t.Errorf("in flight %v: the pick is not counted on %s", b.inFlight, tc.want)
			}
		})
	}
}

func count(l []string, s string) (n int) {
	for _, x := range l {
		if x == s {
			n++
		}
	}
	return n
}
