package controllers

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	crevent "sigs.k8s.io/controller-runtime/pkg/event"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

func holding(n int64) vllm.State {
	st := loaded(0, 0, 0)
	st.Report.HeldSends = &n
	return st
}

// Each prefill pod's deletion cost is the KV sends its engine holds, so a ReplicaSet scaling
// prefill down deletes an idle pod first; decode pods, pods whose count is unknown and pods
// already annotated with their count are not written.
func TestDeletionCostFollowsHeldSends(t *testing.T) {
	mk := func(name string, role v1alpha1.Role) *corev1.Pod {
		return wrappers.MakeEnginePod("ns", name, "c", role, start.Add(-time.Hour)).Obj()
	}
	annotated := mk("p-annotated", v1alpha1.RolePrefill)
	annotated.Annotations = map[string]string{podDeletionCost: "2", "keep": "me"}
	pods := []*corev1.Pod{mk("p-busy", v1alpha1.RolePrefill), mk("p-idle", v1alpha1.RolePrefill), annotated,
		mk("p-unknown", v1alpha1.RolePrefill), mk("p-silent", v1alpha1.RolePrefill), mk("d-0", v1alpha1.RoleDecode)}
	silent := holding(7)
	silent.Loaded = false
	gates := fakeGates{"p-busy": holding(5), "p-idle": holding(0), "p-annotated": holding(2), "p-unknown": loaded(1, 1, 0),
		"p-silent": silent, "d-0": holding(9)}
	var patched []string
	objs := []client.Object{pdc()}
	for _, p := range pods {
		objs = append(objs, p)
	}
	c := newFakeClient(t).WithObjects(objs...).WithInterceptorFuncs(interceptor.Funcs{
		Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
			patched = append(patched, obj.GetName())
			return c.Patch(ctx, obj, patch, opts...)
		},
	}).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), GateReader: gates}
	ctx := context.Background()
	p := pdc()
	if err := r.setDeletionCosts(ctx, r.observe(ctx, p, nil, r.now())); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, p := range pods {
		var live corev1.Pod
		if err := c.Get(ctx, client.ObjectKeyFromObject(p), &live); err != nil {
			t.Fatal(err)
		}
		if v, ok := live.Annotations[podDeletionCost]; ok {
			got[live.Name] = v
		}
		if live.Name == "p-annotated" && live.Annotations["keep"] != "me" {
			t.Errorf("the patch dropped another annotation: %v", live.Annotations)
		}
	}
	want := map[string]string{"p-busy": "5", "p-idle": "0", "p-annotated": "2"}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("deletion costs (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]string{"p-busy", "p-idle"}, slices.Sorted(slices.Values(patched))); d != "" {
		t.Errorf("pods patched (-want +got):\n%s", d)
	}
	// Nothing changed: no write.
	patched = nil
	if err := r.setDeletionCosts(ctx, r.observe(ctx, p, nil, r.now())); err != nil || len(patched) != 0 {
		t.Errorf("second pass: err %v, patched %v; want no write", err, patched)
	}
	// The busy pod's pulls were made: its cost falls to 0.
	gates["p-busy"] = holding(0)
	if err := r.setDeletionCosts(ctx, r.observe(ctx, p, nil, r.now())); err != nil {
		t.Fatal(err)
	}
	var busy corev1.Pod
	_ = c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: "p-busy"}, &busy)
	if v := busy.Annotations[podDeletionCost]; v != "0" {
		t.Errorf("p-busy cost after its pulls = %q, want 0", v)
	}
}

// A failed write is returned with the pod and annotation named (the reconcile retries it).
func TestDeletionCostWriteErrorNamesThePod(t *testing.T) {
	c := newFakeClient(t).WithObjects(pdc(), wrappers.MakeEnginePod("ns", "p-0", "c", v1alpha1.RolePrefill, start).Obj()).
		WithInterceptorFuncs(interceptor.Funcs{Patch: func(context.Context, client.WithWatch, client.Object, client.Patch, ...client.PatchOption) error {
			return errors.New("forbidden")
		}}).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), GateReader: fakeGates{"p-0": holding(1)}}
	err := r.setDeletionCosts(context.Background(), r.observe(context.Background(), pdc(), nil, r.now()))
	if err == nil || !cmp.Equal(err.Error(), "set controller.kubernetes.io/pod-deletion-cost of pod p-0: forbidden") {
		t.Errorf("err = %v", err)
	}
}

// The operator's own deletion-cost write does not reconcile the PDCluster again; any other
// change of the pod, with or without a new cost, does.
func TestOwnDeletionCostWriteIsNotAnEvent(t *testing.T) {
	pod := wrappers.MakeEnginePod("ns", "p-0", "c", v1alpha1.RolePrefill, start).Obj()
	pod.ResourceVersion = "1"
	costed := pod.DeepCopy()
	costed.ResourceVersion = "2"
	costed.Annotations = map[string]string{podDeletionCost: "3"}
	statusToo := costed.DeepCopy()
	statusToo.Status.Phase = corev1.PodFailed
	recosted := costed.DeepCopy()
	recosted.Annotations[podDeletionCost] = "0"
	for _, tc := range []struct {
		name     string
		old, cur *corev1.Pod
		want     bool
	}{
		{"the cost alone", pod, costed, false},
		{"the cost changed again", costed, recosted, false},
		{"the cost and the status", pod, statusToo, true},
		{"the status alone", costed, statusToo, true},
	} {
		if got := ignoreOwnDeletionCost.Update(crevent.UpdateEvent{ObjectOld: tc.old, ObjectNew: tc.cur}); got != tc.want {
			t.Errorf("%s: reconcile %v, want %v", tc.name, got, tc.want)
		}
	}
}
