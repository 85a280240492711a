package render

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// PoolScale is the scale target of role's pool (spec.scaling.<role>.mode External) as the
// operator creates it, at replicas. The operator writes spec.replicas only then: from then on
// it is the scaler's, so it is created once, never applied.
func PoolScale(pdc *v1alpha1.PDCluster, role v1alpha1.Role, replicas int32) *v1alpha1.PoolScale {
	return &v1alpha1.PoolScale{
		TypeMeta:   metav1.TypeMeta{APIVersion: v1alpha1.GroupVersion.String(), Kind: "PoolScale"},
		ObjectMeta: metav1.ObjectMeta{Namespace: pdc.Namespace, Name: ObjectName(pdc.Name, role), Labels: Labels(pdc.Name, role)},
		Spec:       v1alpha1.PoolScaleSpec{Replicas: replicas},
	}
}
