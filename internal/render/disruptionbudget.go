// The pools' PodDisruptionBudgets.

package render

import (
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// DisruptionBudget is role's PodDisruptionBudget, or nil when the pool asks for none.
func DisruptionBudget(pdc *v1alpha1.PDCluster, role v1alpha1.Role) *policyv1.PodDisruptionBudget {
	return disruptionBudget(defaulted(pdc), role)
}

// disruptionBudget is DisruptionBudget of a defaulted PDCluster.
func disruptionBudget(pdc *v1alpha1.PDCluster, role v1alpha1.Role) *policyv1.PodDisruptionBudget {
	b := pool(pdc, role).DisruptionBudget
	if b == nil {
		return nil
	}
	return &policyv1.PodDisruptionBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
		ObjectMeta: objectMeta(pdc, role),
		Spec: policyv1.PodDisruptionBudgetSpec{
			Selector:       &metav1.LabelSelector{MatchLabels: Labels(pdc.Name, role)},
			MaxUnavailable: copyIntOrString(b.MaxUnavailable),
			MinAvailable:   copyIntOrString(b.MinAvailable),
			// A pod that is not running (crash-looping, never scheduled) may always be evicted:
			// holding it would only block the drain that could fix it.
			UnhealthyPodEvictionPolicy: ptr.To(policyv1.AlwaysAllow),
		},
	}
}

func copyIntOrString(v *intstr.IntOrString) *intstr.IntOrString {
	if v == nil {
		return nil
	}
	c := *v
	return &c
}
