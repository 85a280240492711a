package controllers

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
	"unsafe"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// A restart round that deleted pods is saved in status even when another part of the
// reconcile fails (here the prefill pod's deletion cost cannot be written): backoff and budget
// count on that record, so losing it would restart again at once.
func TestRestartRoundIsRecordedWhenPoolStatusFails(t *testing.T) {
	p := pdc()
	p.Status.Connector.UnhealthyPods = []v1alpha1.UnhealthyPod{{Name: "d-0", Since: metav1.NewTime(start.Add(-time.Minute))}}
	deleted := false
	funcs := interceptor.Funcs{
		Delete: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.DeleteOption) error {
			deleted = true
			return c.Delete(ctx, obj, opts...)
		},
		Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
			if _, ok := obj.(*corev1.Pod); ok {
				return errors.New("apiserver unavailable")
			}
			return c.Patch(ctx, obj, patch, opts...)
		},
	}
	c := newFakeClient(t).
		WithObjects(p, pod("d-0", v1alpha1.RoleDecode, time.Minute), pod("d-1", v1alpha1.RoleDecode, 0), pod("p-0", v1alpha1.RolePrefill, 0)).
		WithStatusSubresource(&v1alpha1.PDCluster{}).WithInterceptorFuncs(funcs).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Recorder: events.NewFakeRecorder(100),
		Options: render.DefaultOptions(), Clock: clocktesting.NewFakePassiveClock(start), GateReader: fakeGates{"p-0": holding(3)}}

	_, err := r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(p)})
	if err == nil || !strings.Contains(err.Error(), "apiserver unavailable") {
		t.Fatalf("err = %v, want the failed deletion cost", err)
	}
	if !deleted {
		t.Fatal("no pod was restarted; the test needs a round")
	}
	var got v1alpha1.PDCluster
	if err := c.Get(context.Background(), client.ObjectKeyFromObject(p), &got); err != nil {
		t.Fatal(err)
	}
	st := got.Status.Connector
	if st.Restarts != 1 || len(st.RecentRounds) != 1 || st.ConsecutiveRounds != 1 || got.Status.Decode.ConnectorRestarts != 1 {
		t.Errorf("saved connector status %+v (decode restarts %d); want the round of one restart recorded", st, got.Status.Decode.ConnectorRestarts)
	}
	var pods corev1.PodList
	if err := c.List(context.Background(), &pods); err != nil {
		t.Fatal(err)
	}
	if len(pods.Items) != 2 {
		t.Errorf("%d pods left, want d-0 deleted", len(pods.Items))
	}
}

// Turning the gate off removes its ConfigMap, but only one this PDCluster controls.
// Children the spec no longer asks for (the gate's ConfigMap when the gate is off, a pool's
// PodDisruptionBudget when its disruptionBudget is unset, the NetworkPolicies when
// spec.networkPolicy.enabled is false) are deleted, but only ones this
// PDCluster controls; the ones it still asks for stay.
func TestUnusedChildrenAreDeletedOnlyWhenOwned(t *testing.T) {
	owner := []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "PDCluster", Name: "c", UID: "uid-c", Controller: ptr.To(true)}}
	gateCM := func() client.Object {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: render.GateObjectName("c"), Labels: map[string]string{v1alpha1.LabelCluster: "c"}}}
	}
	pdb := func(role v1alpha1.Role) func() client.Object {
		return func() client.Object {
			return &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: render.ObjectName("c", role), Labels: render.Labels("c", role)}}
		}
	}
	netpol := func(role v1alpha1.Role) func() client.Object {
		return func() client.Object {
			return &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: render.ObjectName("c", role), Labels: render.Labels("c", role)}}
		}
	}
	noPolicies := func(p *v1alpha1.PDCluster) { p.Spec.NetworkPolicy.Enabled = ptr.To(false) }
	for _, tc := range []struct {
		name  string
		spec  func(*v1alpha1.PDCluster)
		child func() client.Object
		owned bool
		gone  bool
	}{
		{"policies off, own router policy", noPolicies, netpol(v1alpha1.RoleRouter), true, true},
		{"policies off, own prefill policy", noPolicies, netpol(v1alpha1.RolePrefill), true, true},
		{"policies off, someone else's decode policy", noPolicies, netpol(v1alpha1.RoleDecode), false, false},
		{"policies on keep theirs", func(*v1alpha1.PDCluster) {}, netpol(v1alpha1.RoleDecode), true, false},
		{"gate off, own ConfigMap", func(p *v1alpha1.PDCluster) { p.Spec.KVTransfer.CompletionGate = v1alpha1.CompletionGateDisabled }, gateCM, true, true},
		{"gate off, someone else's ConfigMap", func(p *v1alpha1.PDCluster) { p.Spec.KVTransfer.CompletionGate = v1alpha1.CompletionGateDisabled }, gateCM, false, false},
		{"gate on keeps its ConfigMap", func(*v1alpha1.PDCluster) {}, gateCM, true, false},
		{"no decode budget, own PDB", func(*v1alpha1.PDCluster) {}, pdb(v1alpha1.RoleDecode), true, true},
		{"no prefill budget, someone else's PDB", func(*v1alpha1.PDCluster) {}, pdb(v1alpha1.RolePrefill), false, false},
		{"decode budget set keeps its PDB", func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.DisruptionBudget = &v1alpha1.DisruptionBudget{MaxUnavailable: ptr.To(intstr.FromInt32(1))}
		}, pdb(v1alpha1.RoleDecode), true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc()
			p.UID = "uid-c"
			tc.spec(p)
			child := tc.child()
			if tc.owned {
				child.SetOwnerReferences(owner)
			}
			c := newFakeClient(t).WithObjects(p, child).Build()
			r := &PDClusterReconciler{Client: c, Scheme: c.Scheme()}
			pending, err := pruneAsReconciled(t, r, p)
			if err != nil {
				t.Fatal(err)
			}
			err = c.Get(context.Background(), client.ObjectKeyFromObject(child), tc.child())
			if gone := apierrors.IsNotFound(err); gone != tc.gone {
				t.Errorf("deleted = %v (err %v), want %v", gone, err, tc.gone)
			}
			if want := map[bool]int{true: 1, false: 0}[tc.gone]; len(pending) != want {
				t.Errorf("events %v, want %d", pending, want)
			}
		})
	}
}

// pruneAsReconciled prunes what a reconcile of p with nothing running would: every child of p
// in the cluster that render does not give.
func pruneAsReconciled(t *testing.T, r *PDClusterReconciler, p *v1alpha1.PDCluster) ([]event, error) {
	t.Helper()
	ctx := context.Background()
	snap, err := r.observeSnapshot(ctx, p, start)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := render.RenderServing(p, render.DefaultOptions(), render.Serving{})
	if err != nil {
		t.Fatal(err)
	}
	revs := revisionsOf(p, snap.deployments, snap.groupSets, "")
	return r.prune(ctx, snap, unused(p, snap, keepSet(objs, revs, scaleDecision{}), revs))
}

// The cache keeps no managedFields, and one copy of a large ConfigMap value shared by every
// PDCluster's ConfigMap (the gate plugin's files).
func TestCacheTransformsStripManagedFieldsAndShareLargeValues(t *testing.T) {
	var cmTransform func(any) (any, error)
	for obj, o := range CacheOptions().ByObject {
		if _, ok := obj.(*corev1.ConfigMap); ok {
			cmTransform = o.Transform
		}
	}
	if cmTransform == nil {
		t.Fatal("no ConfigMap transform")
	}
	big := strings.Repeat("x", internMinBytes)
	mk := func() *corev1.ConfigMap {
		return &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "someone"}}},
			Data:       map[string]string{"plugin.py": strings.Clone(big), "small": strings.Clone("tiny")},
		}
	}
	a, err := cmTransform(mk())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := cmTransform(mk())
	ca, cb := a.(*corev1.ConfigMap), b.(*corev1.ConfigMap)
	if len(ca.ManagedFields) != 0 {
		t.Errorf("managedFields kept: %v", ca.ManagedFields)
	}
	if ca.Data["plugin.py"] != big || unsafe.StringData(ca.Data["plugin.py"]) != unsafe.StringData(cb.Data["plugin.py"]) {
		t.Error("two ConfigMaps with the same large value hold two copies")
	}
	if ca.Data["small"] != "tiny" {
		t.Errorf("small value changed: %q", ca.Data["small"])
	}
}
