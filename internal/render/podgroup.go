// The gangs of the pools whose replicas span pods: one PodGroup per replica.

package render

import (
	"strconv"

	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// Gangs reports whether role's replicas are gangs: they span pods, spec.scheduling.gang is
// Auto, and the cluster serves PodGroups (servesPodGroups).
func Gangs(pdc *v1alpha1.PDCluster, role v1alpha1.Role, servesPodGroups bool) bool {
	return servesPodGroups && multiNode(pdc, role) && pdc.Spec.Scheduling.Gang != v1alpha1.GangNone
}

// GroupName names the objects of group index group of the LeaderWorkerSet groupSet: its
// PodGroup (the name config/admission/gang-podgroups.yaml gives the group's pods) and its
// NetworkPolicy.
func GroupName(groupSet string, group int32) string {
	return groupSet + "-" + strconv.Itoa(int(group))
}

// groups is how many groups lws may run: 0..replicas-1, and the ones a rolling update adds
// past them (maxSurge, rounded up as LeaderWorkerSet does).
func groups(lws *lwsv1.LeaderWorkerSet) int32 {
	replicas := *lws.Spec.Replicas
	surge, _ := intstr.GetScaledValueFromIntOrPercent(&lws.Spec.RolloutStrategy.RollingUpdateConfiguration.MaxSurge, int(replicas), true)
	return replicas + int32(surge)
}

// gangs are the PodGroups of lws's groups, each of minCount its size: the scheduler binds a
// group's pods all at once or none. A group whose PodGroup is missing is never scheduled.
func gangs(pdc *v1alpha1.PDCluster, lws *lwsv1.LeaderWorkerSet) []Object {
	var out []Object
	for g := range groups(lws) {
		pg := &schedulingv1beta1.PodGroup{
			TypeMeta: metav1.TypeMeta{APIVersion: schedulingv1beta1.SchemeGroupVersion.String(), Kind: "PodGroup"},
			ObjectMeta: metav1.ObjectMeta{
				Name: GroupName(lws.Name, g), Namespace: pdc.Namespace, Labels: mergeMaps(nil, lws.Labels),
			},
			Spec: schedulingv1beta1.PodGroupSpec{SchedulingPolicy: schedulingv1beta1.PodGroupSchedulingPolicy{
				Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: *lws.Spec.LeaderWorkerTemplate.Size},
			}},
		}
		out = append(out, pg)
	}
	return out
}

// joinGang labels the pod templates of lws for the admission policy that puts each pod in its
// group's PodGroup.
func joinGang(lws *lwsv1.LeaderWorkerSet) {
	t := &lws.Spec.LeaderWorkerTemplate
	t.WorkerTemplate.Labels[v1alpha1.LabelGang] = "true"
	if t.LeaderTemplate != nil {
		t.LeaderTemplate.Labels[v1alpha1.LabelGang] = "true"
	}
}
