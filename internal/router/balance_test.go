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
				p, _ := b.pick(len(urls), func(i int) string { return urls[i] }, nil)
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
	p, _ := b.pick(1, func(int) string { return "gone" }, nil)
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
