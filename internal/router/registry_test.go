package router

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
)

func TestAdmitTopology(t *testing.T) {
	at := func(id string, addrs ...string) bootstrap.Engine {
		e := bootstrap.Engine{EngineID: id, WorkerAddr: map[string]map[string]string{}}
		for i, a := range addrs {
			e.WorkerAddr[string(rune('0'+i))] = map[string]string{"0": a}
		}
		return e
	}
	cases := []struct {
		name        string
		topo        bootstrap.Topology
		host        string
		ranks       int
		wantKept    []string
		wantRefused []refusal
	}{
		{"the pod's own rank", bootstrap.Topology{"0": at("e0", "tcp://10.0.0.5:1")}, "10.0.0.5", 1, []string{"0"}, nil},
		{"ranks unset mean one", bootstrap.Topology{"0": at("e0", "tcp://10.0.0.5:1"), "1": at("e1", "tcp://10.0.0.5:2")}, "10.0.0.5", 0,
			[]string{"0"}, []refusal{{"1", refusedRank, "the pod runs data-parallel ranks 0..0"}}},
		{"every rank the pod runs", bootstrap.Topology{"0": at("e0", "tcp://10.0.0.5:1"), "1": at("e1", "tcp://10.0.0.5:2")}, "10.0.0.5", 2, []string{"0", "1"}, nil},
		{"a rank that is not a number", bootstrap.Topology{"01": at("e", "tcp://10.0.0.5:1"), "-1": at("f", "tcp://10.0.0.5:1")}, "10.0.0.5", 4, nil,
			[]refusal{{"-1", refusedRank, "the pod runs data-parallel ranks 0..3"}, {"01", refusedRank, "the pod runs data-parallel ranks 0..3"}}},
		{"one tp worker elsewhere", bootstrap.Topology{"0": at("e0", "tcp://10.0.0.5:1", "tcp://10.0.0.6:1")}, "10.0.0.5", 1, nil,
			[]refusal{{"0", refusedAddress, `worker at "tcp://10.0.0.6:1" is not on the prefill pod 10.0.0.5`}}},
		{"a name, not the pod's address", bootstrap.Topology{"0": at("e0", "tcp://prefill-0:1")}, "10.0.0.5", 1, nil,
			[]refusal{{"0", refusedAddress, `worker at "tcp://prefill-0:1" is not on the prefill pod 10.0.0.5`}}},
		{"no workers", bootstrap.Topology{"0": at("e0")}, "10.0.0.5", 1, nil,
			[]refusal{{"0", refusedAddress, `worker at "(no worker)" is not on the prefill pod 10.0.0.5`}}},
		{"IPv6", bootstrap.Topology{"0": at("e0", "tcp://[fd00::5]:1")}, "fd00::5", 1, []string{"0"}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			kept, refused := admitTopology(tc.topo, tc.host, tc.ranks)
			var keys []string
			for dp := range kept {
				keys = append(keys, dp)
			}
			if d := cmp.Diff(tc.wantKept, keys, cmpopts.SortSlices(func(a, b string) bool { return a < b }), cmpopts.EquateEmpty()); d != "" {
				t.Errorf("kept ranks (-want +got):\n%s", d)
			}
			if d := cmp.Diff(tc.wantRefused, refused, cmp.AllowUnexported(refusal{})); d != "" {
				t.Errorf("refused (-want +got):\n%s", d)
			}
		})
	}
}
