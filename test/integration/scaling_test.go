package integration

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// TestScalingThroughPoolScales: an External pool's PoolScale takes `kubectl scale` (the /scale
// subresource, as an HPA writes it); the pools run the requests within minReplicas, maxReplicas
// and the ratio, and status says both; Static -> External keeps the running count; External ->
// Static deletes the PoolScale; a resync writes nothing.
func TestScalingThroughPoolScales(t *testing.T) {
	f := newFixture(t)
	p := wrappers.MakePDCluster(f.ns, "sc").Replicas(1, 2).Obj()
	p.Spec.Scaling = v1alpha1.ScalingSpec{
		Prefill: v1alpha1.PoolScalingSpec{Mode: v1alpha1.ScalingExternal, MinReplicas: ptr.To[int32](1), MaxReplicas: ptr.To[int32](4)},
		Ratio:   &v1alpha1.ReplicaRatio{Min: "0.5", Max: "2"},
	}
	if err := f.c.Create(f.ctx, p); err != nil {
		t.Fatal(err)
	}
	type counts struct {
		PrefillRuns, DecodeRuns, PrefillAsked, DecodeAsked int32
		Reason                                             string
	}
	check := func(step string, want counts) {
		t.Helper()
		f.reconcile("sc")
		var pdc v1alpha1.PDCluster
		f.get(&pdc, "sc")
		var pd, dd appsv1.Deployment
		f.get(&pd, "sc-prefill")
		f.get(&dd, "sc-decode")
		got := counts{*pd.Spec.Replicas, *dd.Spec.Replicas, ptr.Deref(pdc.Status.Prefill.RequestedReplicas, -1), ptr.Deref(pdc.Status.Decode.RequestedReplicas, -1),
			condition(&pdc, v1alpha1.ConditionRatioConstrained).Reason}
		if d := cmp.Diff(want, got); d != "" {
			t.Errorf("%s (-want +got):\n%s\n%s", step, d, condition(&pdc, v1alpha1.ConditionRatioConstrained).Message)
		}
	}
	scale := func(name string, n int32) {
		t.Helper()
		ps := &v1alpha1.PoolScale{ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, Name: name}}
		if err := f.c.SubResource("scale").Update(f.ctx, ps, client.WithSubResourceBody(&autoscalingv1.Scale{
			ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, Name: name}, Spec: autoscalingv1.ScaleSpec{Replicas: n}})); err != nil {
			t.Fatalf("scale %s to %d: %v", name, n, err)
		}
	}
	update := func(change func(*v1alpha1.PDCluster)) {
		t.Helper()
		var pdc v1alpha1.PDCluster
		f.get(&pdc, "sc")
		change(&pdc)
		if err := f.c.Update(f.ctx, &pdc); err != nil {
			t.Fatal(err)
		}
	}

	check("created: the PoolScale seeded from spec.prefill.replicas", counts{1, 2, 1, 2, v1alpha1.ReasonAsRequested})
	var ps v1alpha1.PoolScale
	f.get(&ps, "sc-prefill")
	if ref := metav1.GetControllerOf(&ps); ref == nil || ref.Name != "sc" || ps.Spec.Replicas != 1 {
		t.Errorf("PoolScale sc-prefill: owner %v, spec.replicas %d, want PDCluster sc and 1", ref, ps.Spec.Replicas)
	}

	scale("sc-prefill", 5)
	check("kubectl scale past maxReplicas", counts{4, 2, 5, 2, v1alpha1.ReasonReplicaBounds})
	// What an HPA reads back through /scale: the count the pool runs and its pods' selector.
	var s autoscalingv1.Scale
	if err := f.c.SubResource("scale").Get(f.ctx, &v1alpha1.PoolScale{ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, Name: "sc-prefill"}}, &s); err != nil {
		t.Fatal(err)
	}
	if s.Spec.Replicas != 5 || s.Status.Replicas != 4 || s.Status.Selector == "" {
		t.Errorf("/scale = spec %d, status %d, selector %q; want 5, 4 and the prefill pods' selector", s.Spec.Replicas, s.Status.Replicas, s.Status.Selector)
	}
	var pd appsv1.Deployment
	f.get(&pd, "sc-prefill")
	sel, err := labels.Parse(s.Status.Selector)
	if err != nil {
		t.Fatal(err)
	}
	if !sel.Matches(labels.Set(pd.Spec.Template.Labels)) {
		t.Errorf("selector %q does not select the prefill pod template %v", s.Status.Selector, pd.Spec.Template.Labels)
	}

	update(func(p *v1alpha1.PDCluster) { p.Spec.Scaling.Ratio.Max = "1" })
	check("ratio max 1: decode raised to prefill's 4", counts{4, 4, 5, 2, v1alpha1.ReasonRatioBounds})

	update(func(p *v1alpha1.PDCluster) { p.Spec.Scaling.Decode.Mode = v1alpha1.ScalingExternal })
	check("decode Static -> External: seeded with the 4 it runs, not spec's 2", counts{4, 4, 5, 4, v1alpha1.ReasonReplicaBounds})
	f.get(&ps, "sc-decode")
	if ps.Spec.Replicas != 4 {
		t.Errorf("PoolScale sc-decode spec.replicas = %d, want 4 (the running count)", ps.Spec.Replicas)
	}

	update(func(p *v1alpha1.PDCluster) { p.Spec.Scaling.Prefill.Mode = v1alpha1.ScalingStatic })
	check("prefill External -> Static: spec.prefill.replicas, raised into the ratio", counts{2, 4, 1, 4, v1alpha1.ReasonRatioBounds})
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: f.ns, Name: "sc-prefill"}, &ps); !apierrors.IsNotFound(err) {
		t.Errorf("PoolScale sc-prefill after External -> Static: %v, want NotFound", err)
	}

	writes.Store(0)
	f.reconcile("sc")
	if n := writes.Load(); n != 0 {
		t.Errorf("a resync made %d writes, want 0", n)
	}

	update(func(p *v1alpha1.PDCluster) { p.Spec.Scaling = v1alpha1.ScalingSpec{} })
	f.reconcile("sc")
	var pdc v1alpha1.PDCluster
	f.get(&pdc, "sc")
	if c := condition(&pdc, v1alpha1.ConditionRatioConstrained); c.Type != "" {
		t.Errorf("RatioConstrained %+v after spec.scaling was removed, want none", c)
	}
}
