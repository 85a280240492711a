package controllers

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/rollout"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
)

// groupSet is a pool's LeaderWorkerSet of revision rev as the API server and the
// LeaderWorkerSet controller leave it: replicas groups of size pods, ready of them ready.
func groupSet(role v1alpha1.Role, name, service, rev string, replicas, size, ready int32, created time.Time) *lwsv1.LeaderWorkerSet {
	l := &lwsv1.LeaderWorkerSet{ObjectMeta: metav1.ObjectMeta{
		Namespace: "ns", Name: name, Generation: 2, CreationTimestamp: metav1.NewTime(created),
		Labels:      render.RevisionLabels("c", role, rev),
		Annotations: map[string]string{v1alpha1.AnnotationService: service},
	}}
	l.Spec.Replicas, l.Spec.LeaderWorkerTemplate.Size = ptr.To(replicas), ptr.To(size)
	l.Spec.LeaderWorkerTemplate.WorkerTemplate.Labels = render.RevisionLabels("c", role, rev)
	l.Status = lwsv1.LeaderWorkerSetStatus{ObservedGeneration: 2, Replicas: replicas, ReadyReplicas: ready, UpdatedReplicas: replicas}
	return l
}

func TestPodSetReadsEitherKind(t *testing.T) {
	dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "c-decode", Generation: 3, Labels: render.Labels("c", v1alpha1.RoleDecode)}}
	dep.Spec.Replicas = ptr.To[int32](3)
	dep.Spec.Selector = &metav1.LabelSelector{MatchLabels: render.RevisionLabels("c", v1alpha1.RoleDecode, "r1")}
	dep.Spec.Template.Labels = render.RevisionLabels("c", v1alpha1.RoleDecode, "r1")
	dep.Status = appsv1.DeploymentStatus{ObservedGeneration: 2, Replicas: 3, ReadyReplicas: 3, AvailableReplicas: 2, UpdatedReplicas: 1}
	lws := groupSet(v1alpha1.RolePrefill, "c-prefill-lws", "c-prefill", "r1", 2, 4, 1, start)
	type view struct {
		Role                       v1alpha1.Role
		Revision, Service          string
		Pinned                     bool
		Wants, PodsPerReplica      int32
		Replicas, Ready, Available int32
		Updated                    int32
		Current                    bool
	}
	read := func(s *podSet) view {
		c := s.counts()
		return view{s.role(), s.revision(), s.service(), s.pinned(), s.wants(), s.podsPerReplica(), c.replicas, c.ready, c.available, c.updated, c.current}
	}
	for _, tc := range []struct {
		name string
		obj  client.Object
		want view
	}{
		{"Deployment: its own Service, available from its status, not current", dep,
			view{v1alpha1.RoleDecode, "r1", "c-decode", true, 3, 1, 3, 3, 2, 1, false}},
		// A group is ready when all its pods are (the LeaderWorkerSet controller's count); no
		// minReadySeconds: ready is available.
		{"LeaderWorkerSet: the annotated Service, groups", lws,
			view{v1alpha1.RolePrefill, "r1", "c-prefill", true, 2, 4, 2, 1, 1, 2, true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if d := cmp.Diff(tc.want, read(&podSet{tc.obj})); d != "" {
				t.Errorf("(-want +got):\n%s", d)
			}
		})
	}
	s := &podSet{lws}
	s.setWants(5)
	if *lws.Spec.Replicas != 5 || s.wants() != 5 {
		t.Errorf("setWants wrote %d", *lws.Spec.Replicas)
	}
	if got := enginePods(pdcWithNodes(2, 1), scaling.Effective{Prefill: 3, Decode: 2}); got != 3*2+2 {
		t.Errorf("enginePods = %d, want 3 groups of 2 and 2 pods", got)
	}
}

// A KV revision rollout steps an older revision's LeaderWorkerSet down as it does a
// Deployment: the patch goes to the LeaderWorkerSet, and the snapshot sees it.
func TestOlderGroupSetIsSteppedDown(t *testing.T) {
	p := pdcWithNodes(2, 1)
	old := groupSet(v1alpha1.RolePrefill, "c-prefill-lws", "c-prefill", "old", 2, 2, 2, start)
	newer := groupSet(v1alpha1.RolePrefill, "c-prefill-new-lws", "c-prefill-new", "new", 1, 2, 1, start.Add(time.Minute))
	c := newFakeClient(t).WithObjects(old, newer).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme()}
	snap := &snapshot{pdc: p, groupSets: []*lwsv1.LeaderWorkerSet{old, newer}}
	revs := revisionsOf(p, nil, snap.groupSets, "new")
	if revs.update == nil || revs.update.prefill.GetName() != "c-prefill-new-lws" || len(revs.old) != 1 || revs.old[0].prefill.GetName() != "c-prefill-lws" {
		t.Fatalf("revisions %+v: want the new LeaderWorkerSet's as the update revision, the old one's older", revs)
	}
	if got := revs.serving(p).Old; len(got) != 1 || got[0].PrefillHost != "c-prefill.ns.svc" {
		t.Errorf("router.json's older revision %+v: want the old LeaderWorkerSet's Service", got)
	}
	events, err := r.stepOldRevisions(context.Background(), snap, revs, rolloutStep{old: []rollout.Counts{{Prefill: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	var stored lwsv1.LeaderWorkerSet
	if err := c.Get(context.Background(), client.ObjectKeyFromObject(old), &stored); err != nil || *stored.Spec.Replicas != 1 || *old.Spec.Replicas != 1 {
		t.Errorf("older LeaderWorkerSet asks %d (snapshot %d), %v: want stepped to 1", ptr.Deref(stored.Spec.Replicas, -1), *old.Spec.Replicas, err)
	}
	if len(events) != 1 {
		t.Errorf("events %v: want the step", events)
	}
}

func pdcWithNodes(prefill, decode int32) *v1alpha1.PDCluster {
	p := pdc()
	p.Spec.Prefill.Parallelism.Nodes, p.Spec.Decode.Parallelism.Nodes = ptr.To(prefill), ptr.To(decode)
	return p
}
