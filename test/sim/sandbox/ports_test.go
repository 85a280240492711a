package sandbox

import (
	"slices"
	"testing"
)

// Every node gets ports no other node has, even from a picker whose ports are free only while
// one call holds them (the kernel hands a closed port out again): picking node by node gave a
// decode sidecar a prefill's bootstrap port, and the prefill engine could not start.
func TestNodePortsAreDistinct(t *testing.T) {
	lowest := func(n int) ([]int, error) { // each call: the lowest n ports, as after a close
		out := make([]int, n)
		for i := range out {
			out[i] = 20000 + i
		}
		return out, nil
	}
	ports, err := nodePorts(4, lowest)
	if err != nil {
		t.Fatal(err)
	}
	var all []int
	for _, p := range ports {
		if len(p) != portsPerNode {
			t.Fatalf("node ports %v, want %d", p, portsPerNode)
		}
		all = append(all, p...)
	}
	slices.Sort(all)
	if len(slices.Compact(slices.Clone(all))) != len(all) {
		t.Errorf("ports %v repeat across nodes", ports)
	}
}
