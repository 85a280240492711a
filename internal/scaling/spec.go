package scaling

import (
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// PoolSpec is spec.scaling of role's pool.
func PoolSpec(pdc *v1alpha1.PDCluster, role v1alpha1.Role) v1alpha1.PoolScalingSpec {
	if role == v1alpha1.RoleDecode {
		return pdc.Spec.Scaling.Decode
	}
	return pdc.Spec.Scaling.Prefill
}

// External reports whether role's pool is scaled through its PoolScale.
func External(pdc *v1alpha1.PDCluster, role v1alpha1.Role) bool {
	return PoolSpec(pdc, role).Mode == v1alpha1.ScalingExternal
}

// Bounded reports whether spec.scaling can change a count: a pool in External mode (its
// minReplicas and maxReplicas) or a ratio.
func Bounded(pdc *v1alpha1.PDCluster) bool {
	r := pdc.Spec.Scaling.Ratio
	return External(pdc, v1alpha1.RolePrefill) || External(pdc, v1alpha1.RoleDecode) || (r != nil && (r.Min != "" || r.Max != ""))
}

// SpecReplicas is spec.<pool>.replicas (1 when unset, as the CRD defaults it).
func SpecReplicas(pdc *v1alpha1.PDCluster, role v1alpha1.Role) int32 {
	p := pdc.Spec.Prefill
	if role == v1alpha1.RoleDecode {
		p = pdc.Spec.Decode
	}
	return ptr.Deref(p.Replicas, 1)
}

// Seed is the spec.replicas a new PoolScale of role's pool starts with: the count the pool runs
// (a Static pool switched to External keeps running what it ran), else spec.<pool>.replicas;
// within minReplicas and maxReplicas, so a scaler never finds a request it did not make.
func Seed(pdc *v1alpha1.PDCluster, role v1alpha1.Role, running *int32) int32 {
	n := SpecReplicas(pdc, role)
	if running != nil {
		n = *running
	}
	return pool(pdc, role, n).clamp()
}

// pool is role's request n with its bounds: an External pool's minReplicas and maxReplicas; a
// Static pool runs what its spec says.
func pool(pdc *v1alpha1.PDCluster, role v1alpha1.Role, n int32) Pool {
	if !External(pdc, role) {
		return Pool{Requested: n}
	}
	s := PoolSpec(pdc, role)
	return Pool{Requested: n, Min: ptr.Deref(s.MinReplicas, v1alpha1.DefaultMinReplicas), Max: s.MaxReplicas}
}

// ForSpec decides what the pools run when their scalers ask prefill and decode.
func ForSpec(pdc *v1alpha1.PDCluster, prefill, decode int32) (Effective, error) {
	var ratio Ratio
	if r := pdc.Spec.Scaling.Ratio; r != nil {
		var err error
		if ratio, err = ParseRatio(r.Min, r.Max); err != nil {
			return Effective{}, err
		}
	}
	return Decide(pool(pdc, v1alpha1.RolePrefill, prefill), pool(pdc, v1alpha1.RoleDecode, decode), ratio), nil
}

// Scaled is pdc with each pool's replicas set to what it runs, for render.
func Scaled(pdc *v1alpha1.PDCluster, e Effective) *v1alpha1.PDCluster {
	out := pdc.DeepCopy()
	out.Spec.Prefill.Replicas, out.Spec.Decode.Replicas = ptr.To(e.Prefill), ptr.To(e.Decode)
	return out
}

// Initial is what the pools run before any PoolScale exists: each pool's seed (what pdctl
// render shows, and what a new PDCluster starts with).
func Initial(pdc *v1alpha1.PDCluster) (Effective, error) {
	return ForSpec(pdc, Seed(pdc, v1alpha1.RolePrefill, nil), Seed(pdc, v1alpha1.RoleDecode, nil))
}
