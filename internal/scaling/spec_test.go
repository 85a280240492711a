package scaling

import (
	"testing"

	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// A new PoolScale starts at what the pool runs (a Static pool switched to External keeps
// running what it ran), else at spec.<pool>.replicas, within the pool's minReplicas and
// maxReplicas.
func TestSeed(t *testing.T) {
	external := func(lo, hi *int32) *v1alpha1.PDCluster {
		p := &v1alpha1.PDCluster{}
		p.Spec.Decode.Replicas = ptr.To[int32](2)
		p.Spec.Scaling.Decode = v1alpha1.PoolScalingSpec{Mode: v1alpha1.ScalingExternal, MinReplicas: lo, MaxReplicas: hi}
		return p
	}
	for _, tc := range []struct {
		name    string
		pdc     *v1alpha1.PDCluster
		running *int32
		want    int32
	}{
		{"nothing runs yet: spec.decode.replicas", external(nil, nil), nil, 2},
		{"the running count, not spec's", external(nil, nil), ptr.To[int32](4), 4},
		{"the running count, raised to minReplicas", external(ptr.To[int32](5), nil), ptr.To[int32](4), 5},
		{"the running count, lowered to maxReplicas", external(nil, ptr.To[int32](3)), ptr.To[int32](4), 3},
		{"running 0 is a count", external(ptr.To[int32](0), nil), ptr.To[int32](0), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Seed(tc.pdc, v1alpha1.RoleDecode, tc.running); got != tc.want {
				t.Errorf("Seed = %d, want %d", got, tc.want)
			}
		})
	}
}
