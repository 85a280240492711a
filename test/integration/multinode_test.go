package integration

import (
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// A replica across pods (parallelism.nodes 2, a layout the API server admits) where the
// cluster serves no LeaderWorkerSet: Ready says so naming the field, and nothing of the
// PDCluster is applied; back to one pod per replica, it is.
func TestMultiNodeWithoutLeaderWorkerSet(t *testing.T) {
	f := newFixture(t)
	p := wrappers.MakePDCluster(f.ns, "mn").Replicas(1, 1).Obj()
	p.Spec.Prefill.Parallelism = v1alpha1.Parallelism{Data: ptr.To[int32](16), Nodes: ptr.To[int32](2), Expert: true}
	if err := f.c.Create(f.ctx, p); err != nil {
		t.Fatalf("the API server refused a data-parallel layout across 2 pods: %v", err)
	}
	_, err := f.r.Reconcile(f.ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: f.ns, Name: "mn"}})
	if err == nil {
		t.Fatal("reconcile succeeded without LeaderWorkerSet")
	}
	var got v1alpha1.PDCluster
	f.get(&got, "mn")
	c := condition(&got, v1alpha1.ConditionReady)
	if c.Reason != v1alpha1.ReasonMultiNodeUnavailable || !strings.Contains(c.Message, "spec.prefill.parallelism.nodes is 2") || !strings.Contains(c.Message, "does not serve LeaderWorkerSet") {
		t.Errorf("Ready %+v: want MultiNodeUnavailable naming the field and LeaderWorkerSet", c)
	}
	var deps appsv1.DeploymentList
	if err := f.c.List(f.ctx, &deps, client.InNamespace(f.ns)); err != nil || len(deps.Items) != 0 {
		t.Errorf("%d Deployments (%v) applied half-way", len(deps.Items), err)
	}

	got.Spec.Prefill.Parallelism.Nodes = ptr.To[int32](1)
	if err := f.c.Update(f.ctx, &got); err != nil {
		t.Fatal(err)
	}
	f.reconcile("mn")
	if err := f.c.List(f.ctx, &deps, client.InNamespace(f.ns)); err != nil || len(deps.Items) != 3 {
		t.Errorf("one pod per replica: %d Deployments (%v), want prefill, decode and router", len(deps.Items), err)
	}
}
