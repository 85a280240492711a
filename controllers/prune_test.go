package controllers

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// controlledPDC is the PDCluster "c" with a UID, the owner reference of a child it controls,
// and a prefill child's labels.
func controlledPDC() (*v1alpha1.PDCluster, []metav1.OwnerReference, map[string]string) {
	p := pdc()
	p.UID = "uid-c"
	owner := []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "PDCluster", Name: "c", UID: "uid-c", Controller: ptr.To(true)}}
	return p, owner, render.Labels("c", v1alpha1.RolePrefill)
}

// controlledConfigMap is a ConfigMap of that name that controlledPDC controls.
func controlledConfigMap(name string) *corev1.ConfigMap {
	_, owner, labels := controlledPDC()
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: labels, OwnerReferences: owner}}
}

// Prune works from the inventory, not from a list of names: every child of a managed kind the
// PDCluster controls and no longer keeps goes (one an older operator made, a Static pool's
// PoolScale), each with an event saying why; children it does not control, and the ones it
// renders, stay.
func TestPruneDeletesEveryControlledChildNotKept(t *testing.T) {
	p, owner, labels := controlledPDC()
	legacy := controlledConfigMap("c-legacy")
	theirs := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c-theirs", Labels: labels}}
	scale := render.PoolScale(p, v1alpha1.RolePrefill, 1)
	scale.OwnerReferences = owner
	rendered := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: render.ObjectName("c", v1alpha1.RoleRouter), Labels: labels, OwnerReferences: owner}}
	c := newFakeClient(t).WithObjects(p, legacy, theirs, scale, rendered).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme()}
	events, err := pruneAsReconciled(t, r, p)
	if err != nil {
		t.Fatal(err)
	}
	var notes []string
	for _, e := range events {
		notes = append(notes, e.note)
	}
	want := []string{
		"deleted ConfigMap c-legacy: the PDCluster no longer renders it",
		"deleted PoolScale c-prefill: spec.scaling.prefill.mode is Static",
	}
	if d := cmp.Diff(want, notes); d != "" {
		t.Errorf("events (-want +got):\n%s", d)
	}
	for obj, gone := range map[client.Object]bool{legacy: true, scale: true, theirs: false, rendered: false} {
		err := c.Get(context.Background(), client.ObjectKeyFromObject(obj), obj.DeepCopyObject().(client.Object))
		if apierrors.IsNotFound(err) != gone {
			t.Errorf("%s: deleted %v (err %v), want %v", obj.GetName(), apierrors.IsNotFound(err), err, gone)
		}
	}
}

// An older KV revision's LeaderWorkerSet keeps its groups' PodGroups and NetworkPolicies until
// it drains: without its group's policy a pod of a running replica could not reach the others.
func TestPruneKeepsAnOlderRevisionsGroups(t *testing.T) {
	p := pdc()
	old := groupSet(v1alpha1.RolePrefill, "c-prefill-lws", "c-prefill", "r1", 2, 2, 2, start)
	revs := revisionsOf(p, nil, []*lwsv1.LeaderWorkerSet{old}, "r2")
	keep := keepSet(nil, revs, scaleDecision{})
	for key, want := range map[childKey]bool{
		{"PodGroup", "c-prefill-lws-0"}: true, {"NetworkPolicy", "c-prefill-lws-0"}: true,
		{"PodGroup", "c-prefill-lws-1"}: true, {"NetworkPolicy", "c-prefill-lws-1"}: true,
		{"NetworkPolicy", "c-prefill-lws-2"}: false,
	} {
		if keep[key] != want {
			t.Errorf("keeps %v: %v, want %v", key, keep[key], want)
		}
	}
	old.Spec.Replicas, old.Status.Replicas, old.Status.ReadyReplicas, old.Status.UpdatedReplicas = ptr.To[int32](0), 0, 0, 0
	drained := keepSet(nil, revisionsOf(p, nil, []*lwsv1.LeaderWorkerSet{old}, "r2"), scaleDecision{})
	if drained[childKey{"NetworkPolicy", "c-prefill-lws-0"}] {
		t.Error("a drained revision's group NetworkPolicy is kept")
	}
}

// A delete that fails is reported as an error, never as the event that says it happened; the
// other removals still go, with theirs.
func TestPruneReportsOnlyTheDeletesThatHappened(t *testing.T) {
	p, _, _ := controlledPDC()
	stuck, legacy := controlledConfigMap("c-stuck"), controlledConfigMap("c-legacy")
	c := newFakeClient(t).WithObjects(p, stuck, legacy).WithInterceptorFuncs(interceptor.Funcs{
		Delete: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.DeleteOption) error {
			if obj.GetName() == "c-stuck" {
				return apierrors.NewForbidden(corev1.Resource("configmaps"), obj.GetName(), errors.New("a webhook said no"))
			}
			return c.Delete(ctx, obj, opts...)
		},
	}).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme()}
	events, err := pruneAsReconciled(t, r, p)
	if err == nil || !strings.Contains(err.Error(), "c-stuck") {
		t.Errorf("error %v, want one naming c-stuck", err)
	}
	var notes []string
	for _, e := range events {
		notes = append(notes, e.note)
	}
	if d := cmp.Diff([]string{"deleted ConfigMap c-legacy: the PDCluster no longer renders it"}, notes); d != "" {
		t.Errorf("events (-want +got):\n%s", d)
	}
}
