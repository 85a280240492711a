package controllers

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// observe is the snapshot and what status reads of it when act applied applied and wrote
// nothing else: the steps' tests observe without a reconcile.
func (r *PDClusterReconciler) observe(ctx context.Context, pdc *v1alpha1.PDCluster, applied []render.Object, now time.Time) observed {
	s, err := r.observeSnapshot(ctx, pdc, now)
	o := s.observed(applied)
	if err != nil {
		o.depsErr = err
	}
	return o
}

// With the cache's index (as SetupWithManager adds it), the snapshot lists the PDCluster's own
// children and pods, the same ones the label selector finds, not its neighbours'.
func TestSnapshotListsOwnChildrenByIndex(t *testing.T) {
	mine, theirs := pdc(), pdc()
	mine.UID, theirs.Name, theirs.UID = "uid-c", "other", "uid-other"
	var objs []client.Object
	for _, p := range []*v1alpha1.PDCluster{mine, theirs} {
		rendered, err := render.Render(p, render.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range rendered {
			if err := controllerutil.SetControllerReference(p, o, testScheme(t)); err != nil {
				t.Fatal(err)
			}
			objs = append(objs, o)
		}
		objs = append(objs, wrappers.MakeEnginePod("ns", p.Name+"-d-0", p.Name, v1alpha1.RoleDecode, start).Obj())
	}
	b := newFakeClient(t).WithObjects(objs...)
	for _, kind := range indexedKinds() {
		b = b.WithIndex(kind, childIndex, func(o client.Object) []string { return []string{o.GetLabels()[v1alpha1.LabelCluster]} })
	}
	c := b.Build()
	names := func(indexed bool) []string {
		r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), childrenIndexed: indexed}
		s, err := r.observeSnapshot(context.Background(), mine, start)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, d := range s.deployments {
			out = append(out, "Deployment "+d.Name)
		}
		for _, o := range s.services {
			out = append(out, "Service "+o.Name)
		}
		for _, o := range s.configMaps {
			out = append(out, "ConfigMap "+o.Name)
		}
		for _, o := range s.pods {
			out = append(out, "Pod "+o.Name)
		}
		slices.Sort(out)
		return out
	}
	byLabel := names(false)
	if len(byLabel) < 8 || slices.ContainsFunc(byLabel, func(n string) bool { return strings.Contains(n, "other") }) {
		t.Fatalf("by label: %v, want c's children and pod alone", byLabel)
	}
	if d := cmp.Diff(byLabel, names(true)); d != "" {
		t.Errorf("by index (-label +index):\n%s", d)
	}
}

// A pod list that fails leaves the rest of the reconcile going (issue 57: nothing held it
// there): every child is applied, status is written for the generation, and the reconcile
// returns the error (requeued with backoff), naming the list.
func TestAFailingPodListStillAppliesTheChildren(t *testing.T) {
	p := pdc()
	c := newFakeClient(t).WithObjects(p).WithStatusSubresource(&v1alpha1.PDCluster{}).WithInterceptorFuncs(interceptor.Funcs{
		List: func(ctx context.Context, c client.WithWatch, list client.ObjectList, opts ...client.ListOption) error {
			if _, ok := list.(*corev1.PodList); ok {
				return errors.New("the API server is busy")
			}
			return c.List(ctx, list, opts...)
		},
	}).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Recorder: events.NewFakeRecorder(100), Options: render.DefaultOptions(), Clock: clocktesting.NewFakePassiveClock(start)}
	ctx := context.Background()
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(p)})
	if err == nil || !strings.Contains(err.Error(), "list pods: the API server is busy") {
		t.Errorf("reconcile error %v, want the pod list's", err)
	}
	var deps appsv1.DeploymentList
	if err := c.List(ctx, &deps, client.InNamespace(p.Namespace)); err != nil {
		t.Fatal(err)
	}
	if len(deps.Items) != 3 {
		t.Errorf("%d Deployments applied, want prefill, decode and router", len(deps.Items))
	}
	var got v1alpha1.PDCluster
	if err := c.Get(ctx, client.ObjectKeyFromObject(p), &got); err != nil {
		t.Fatal(err)
	}
	if got.Status.ObservedGeneration != got.Generation || meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionReady) == nil {
		t.Errorf("status %+v: want it written for generation %d, with Ready", got.Status, got.Generation)
	}
}
