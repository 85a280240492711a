package controllers

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// wantsGangs reports whether pdc has a pool whose replicas span pods and asks for gangs.
func wantsGangs(pdc *v1alpha1.PDCluster) bool {
	return render.Gangs(pdc, v1alpha1.RolePrefill, true) || render.Gangs(pdc, v1alpha1.RoleDecode, true)
}

// gangStatus writes GangScheduling for a PDCluster with a pool whose replicas span pods, and
// removes it from any other: from the PodGroups observed (the scheduler's own words for a gang
// it cannot place), or why there are none.
func gangStatus(status *v1alpha1.PDClusterStatus, pdc *v1alpha1.PDCluster, o observed) {
	pools := render.MultiNodePools(pdc)
	if len(pools) == 0 {
		meta.RemoveStatusCondition(&status.Conditions, v1alpha1.ConditionGangScheduling)
		return
	}
	set := func(s metav1.ConditionStatus, reason, msg string) {
		setCondition(status, pdc, v1alpha1.ConditionGangScheduling, s, reason, msg)
	}
	switch {
	case pdc.Spec.Scheduling.Gang == v1alpha1.GangNone:
		set(metav1.ConditionFalse, v1alpha1.ReasonGangDisabled, "spec.scheduling.gang is None: a replica's pods are scheduled one by one")
		return
	case o.servesPodGroups.err != nil:
		set(metav1.ConditionUnknown, v1alpha1.ReasonPodGroupsUnavailable, fmt.Sprintf("%v: a replica's pods are scheduled one by one", o.servesPodGroups.err))
		return
	case !o.servesPodGroups.served:
		set(metav1.ConditionFalse, v1alpha1.ReasonPodGroupsUnavailable, "the cluster serves no PodGroups (scheduling.k8s.io/v1beta1: the GenericWorkload feature of the API server and the scheduler): a replica's pods are scheduled one by one, and one that cannot all be placed holds the GPUs of those that were")
		return
	}
	var stuck []string
	for _, pg := range o.podGroups {
		if c := meta.FindStatusCondition(pg.Status.Conditions, schedulingv1beta1.PodGroupInitiallyScheduled); c != nil && c.Status == metav1.ConditionFalse {
			stuck = append(stuck, fmt.Sprintf("%s: %s", pg.Name, c.Message))
		}
	}
	if len(stuck) > 0 {
		slices.Sort(stuck)
		set(metav1.ConditionFalse, v1alpha1.ReasonGangUnschedulable, "the scheduler cannot place all the pods of "+strings.Join(stuck, "; "))
		return
	}
	set(metav1.ConditionTrue, v1alpha1.ReasonGangsApplied, fmt.Sprintf("each replica across pods is one gang (%s): its pods are bound all at once or not at all", strings.Join(pools, ", ")))
}

// gangEvent is the Warning of a gang that became unschedulable.
func gangEvents(before []metav1.Condition, after *v1alpha1.PDClusterStatus) []event {
	old := meta.FindStatusCondition(before, v1alpha1.ConditionGangScheduling)
	cur := meta.FindStatusCondition(after.Conditions, v1alpha1.ConditionGangScheduling)
	if cur == nil || cur.Reason != v1alpha1.ReasonGangUnschedulable || (old != nil && old.Reason == cur.Reason && old.Message == cur.Message) {
		return nil
	}
	return []event{{corev1.EventTypeWarning, v1alpha1.ReasonGangUnschedulable, "Schedule", cur.Message}}
}
