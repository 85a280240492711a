package controllers

import (
	"cmp"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
)

// podSet is what runs one pool's replicas of one KV revision, as the snapshot holds it: a
// Deployment (a pod per replica) or a LeaderWorkerSet (a group of pods per replica, for a
// pool whose replicas span pods). Its counts are replicas: a LeaderWorkerSet's are groups, a
// group ready when all its pods are. The methods read the object each time: what act writes
// to it, they see.
type podSet struct{ client.Object }

// podCounts are a podSet's replicas: asked (spec), created, ready, available (ready long
// enough for the routers to have found them) and of the current template; current says the
// status describes the current spec.
type podCounts struct {
	wants, replicas, ready, available, updated int32
	current                                    bool
}

// role is the pool the set runs.
func (s *podSet) role() v1alpha1.Role { return v1alpha1.Role(s.GetLabels()[v1alpha1.LabelRole]) }

// template is the pod template of the set's serving pods (a LeaderWorkerSet's leaders').
func (s *podSet) template() *corev1.PodTemplateSpec {
	switch x := s.Object.(type) {
	case *appsv1.Deployment:
		return &x.Spec.Template
	case *lwsv1.LeaderWorkerSet:
		if l := x.Spec.LeaderWorkerTemplate.LeaderTemplate; l != nil {
			return l
		}
		return &x.Spec.LeaderWorkerTemplate.WorkerTemplate
	}
	return &corev1.PodTemplateSpec{}
}

// revision is the KV revision the set's pods carry.
func (s *podSet) revision() string { return s.template().Labels[v1alpha1.LabelKVRevision] }

// pinned: the set runs one KV revision's pods only. A Deployment's selector names it; one made
// before revisions had Deployments of their own selects every revision's pods, so it can only
// be rolled away from. LeaderWorkerSets came after: each has its revision.
func (s *podSet) pinned() bool {
	rev := s.revision()
	switch x := s.Object.(type) {
	case *appsv1.Deployment:
		return rev != "" && x.Spec.Selector != nil && x.Spec.Selector.MatchLabels[v1alpha1.LabelKVRevision] == rev
	case *lwsv1.LeaderWorkerSet:
		return rev != ""
	}
	return false
}

// service is the name of the headless Service of the set's serving pods: a Deployment's own
// name, a LeaderWorkerSet's annotation (it cannot share its name: render.GroupSetName).
func (s *podSet) service() string {
	if _, ok := s.Object.(*lwsv1.LeaderWorkerSet); ok {
		return cmp.Or(s.GetAnnotations()[v1alpha1.AnnotationService], s.GetName())
	}
	return s.GetName()
}

// wants is the replicas the set asks for (unset: the server's default, 1).
func (s *podSet) wants() int32 {
	switch x := s.Object.(type) {
	case *appsv1.Deployment:
		return ptr.Deref(x.Spec.Replicas, 1)
	case *lwsv1.LeaderWorkerSet:
		return ptr.Deref(x.Spec.Replicas, 1)
	}
	return 0
}

// setWants sets the replicas the set asks for (for a patch).
func (s *podSet) setWants(n int32) {
	switch x := s.Object.(type) {
	case *appsv1.Deployment:
		x.Spec.Replicas = ptr.To(n)
	case *lwsv1.LeaderWorkerSet:
		x.Spec.Replicas = ptr.To(n)
	}
}

// counts are the set's replicas as its controller last reported them. A LeaderWorkerSet has
// no minReadySeconds: its ready groups count as available.
func (s *podSet) counts() podCounts {
	switch x := s.Object.(type) {
	case *appsv1.Deployment:
		st := x.Status
		return podCounts{s.wants(), st.Replicas, st.ReadyReplicas, st.AvailableReplicas, st.UpdatedReplicas, st.ObservedGeneration >= x.Generation}
	case *lwsv1.LeaderWorkerSet:
		st := x.Status
		return podCounts{s.wants(), st.Replicas, st.ReadyReplicas, st.ReadyReplicas, st.UpdatedReplicas, st.ObservedGeneration >= x.Generation}
	}
	return podCounts{}
}

// dataParallel is the data-parallel size the set's engines run (0: one rank).
func (s *podSet) dataParallel() int32 {
	return render.DataParallelOf(&s.template().Spec)
}

// podsPerReplica is how many pods one replica of the set runs.
func (s *podSet) podsPerReplica() int32 {
	if x, ok := s.Object.(*lwsv1.LeaderWorkerSet); ok {
		return ptr.Deref(x.Spec.LeaderWorkerTemplate.Size, 1)
	}
	return 1
}

// asPodSet is obj as a podSet when it is a Deployment or a LeaderWorkerSet.
func asPodSet(obj client.Object) (*podSet, bool) {
	switch obj.(type) {
	case *appsv1.Deployment, *lwsv1.LeaderWorkerSet:
		return &podSet{obj}, true
	}
	return nil, false
}

// enginePodSets are the engine pools' sets among deps and groups (the snapshot's), oldest
// first, then by name.
func enginePodSets(deps []*appsv1.Deployment, groups []*lwsv1.LeaderWorkerSet) []*podSet {
	var out []*podSet
	for _, d := range deps {
		out = append(out, &podSet{d})
	}
	for _, g := range groups {
		out = append(out, &podSet{g})
	}
	out = slices.DeleteFunc(out, func(s *podSet) bool { return s.role() != v1alpha1.RolePrefill && s.role() != v1alpha1.RoleDecode })
	slices.SortStableFunc(out, func(a, b *podSet) int {
		if c := a.GetCreationTimestamp().Compare(b.GetCreationTimestamp().Time); c != 0 {
			return c
		}
		return strings.Compare(a.GetName(), b.GetName())
	})
	return out
}

// enginePods is how many engine pods the pools run at e replicas: a replica across pods is
// spec.<pool>.parallelism.nodes of them.
func enginePods(pdc *v1alpha1.PDCluster, e scaling.Effective) int {
	nodes := func(p v1alpha1.PoolSpec) int { return int(ptr.Deref(p.Parallelism.Nodes, 1)) }
	return int(e.Prefill)*nodes(pdc.Spec.Prefill) + int(e.Decode)*nodes(pdc.Spec.Decode)
}
