package controllers

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// rolloutFixture reconciles one PDCluster against a fake API server whose Deployments become
// ready as soon as they are written (the Deployment controller and kubelet, instantly).
type rolloutFixture struct {
	t      *testing.T
	c      client.Client
	r      *PDClusterReconciler
	rec    *events.FakeRecorder
	pdc    *v1alpha1.PDCluster
	writes int
}

func newRolloutFixture(t *testing.T, p *v1alpha1.PDCluster) *rolloutFixture {
	f := &rolloutFixture{t: t, pdc: p, rec: events.NewFakeRecorder(1000)}
	count := func() { f.writes++ }
	c := newFakeClient(t).WithObjects(p).WithStatusSubresource(&v1alpha1.PDCluster{}, &appsv1.Deployment{}).
		WithInterceptorFuncs(interceptor.Funcs{
			Apply: func(ctx context.Context, c client.WithWatch, obj runtime.ApplyConfiguration, opts ...client.ApplyOption) error {
				count()
				return c.Apply(ctx, obj, opts...)
			},
			Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
				count()
				return c.Patch(ctx, obj, patch, opts...)
			},
			Delete: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.DeleteOption) error {
				count()
				return c.Delete(ctx, obj, opts...)
			},
			SubResourceUpdate: func(ctx context.Context, c client.Client, sub string, obj client.Object, opts ...client.SubResourceUpdateOption) error {
				if _, ok := obj.(*v1alpha1.PDCluster); ok {
					count()
				}
				return c.SubResource(sub).Update(ctx, obj, opts...)
			},
		}).Build()
	f.c = c
	f.r = &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Recorder: f.rec, Options: render.DefaultOptions(), Clock: clocktesting.NewFakePassiveClock(start)}
	return f
}

func (f *rolloutFixture) reconcile() {
	f.t.Helper()
	if _, err := f.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.pdc)}); err != nil {
		f.t.Fatalf("reconcile: %v", err)
	}
}

// settle makes every Deployment ready at what it asks, its pods gone when it asks none.
func (f *rolloutFixture) settle() { f.settleBut("") }

// settleBut settles every Deployment but the one named rolling, whose pods all run its
// previous template still (none updated), as right after a change of it.
func (f *rolloutFixture) settleBut(rolling string) {
	f.t.Helper()
	for _, d := range f.deployments() {
		n := ptr.Deref(d.Spec.Replicas, 1)
		d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation, Replicas: n, UpdatedReplicas: n, ReadyReplicas: n, AvailableReplicas: n}
		if d.Name == rolling {
			d.Status.UpdatedReplicas = 0
		}
		if err := f.c.Status().Update(context.Background(), &d); err != nil {
			f.t.Fatal(err)
		}
	}
}

func (f *rolloutFixture) deployments() []appsv1.Deployment {
	var deps appsv1.DeploymentList
	if err := f.c.List(context.Background(), &deps); err != nil {
		f.t.Fatal(err)
	}
	return deps.Items
}

// engines are the engine Deployments' replicas by name.
func (f *rolloutFixture) engines() map[string]int32 {
	out := map[string]int32{}
	for _, d := range f.deployments() {
		if d.Labels[v1alpha1.LabelRole] != string(v1alpha1.RoleRouter) {
			out[d.Name] = *d.Spec.Replicas
		}
	}
	return out
}

func (f *rolloutFixture) routerFile() routerconfig.File {
	f.t.Helper()
	var cm corev1.ConfigMap
	if err := f.c.Get(context.Background(), client.ObjectKey{Namespace: "ns", Name: "c-router"}, &cm); err != nil {
		f.t.Fatal(err)
	}
	var file routerconfig.File
	if err := json.Unmarshal([]byte(cm.Data[routerconfig.FileName]), &file); err != nil {
		f.t.Fatal(err)
	}
	return file
}

func (f *rolloutFixture) services() []string {
	var svcs corev1.ServiceList
	if err := f.c.List(context.Background(), &svcs); err != nil {
		f.t.Fatal(err)
	}
	var names []string
	for _, s := range svcs.Items {
		names = append(names, s.Name)
	}
	slices.Sort(names)
	return names
}

// A new KV revision gets its own Deployments and Services beside the old ones, which the
// router lists as two revisions; the old revision shrinks only once the router runs that
// list, both pools step in lockstep with a serving revision at every step, the drained
// revision's objects go, and a resync after the rollout writes nothing. Each revision's prefill
// data-parallel ranks are its own in router.json (the router trusts only those ranks).
func TestKVRevisionRollsOutInLockstep(t *testing.T) {
	p := pdc() // 1 prefill, 2 decode
	p.Spec.Prefill.Parallelism.Data = ptr.To[int32](2)
	p.Spec.Rollout.MaxSurge = ptr.To(intstr.FromInt32(1))
	p.Spec.Rollout.MaxUnavailable = ptr.To(intstr.FromInt32(0))
	f := newRolloutFixture(t, p)
	f.reconcile()
	f.settle()
	f.reconcile()
	if d := cmp.Diff(map[string]int32{"c-prefill": 1, "c-decode": 2}, f.engines()); d != "" {
		t.Fatalf("first revision's Deployments (-want +got):\n%s", d)
	}
	oldRev, err := render.KVRevision(p)
	if err != nil {
		t.Fatal(err)
	}

	if err := f.c.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
		t.Fatal(err)
	}
	p.Spec.Engine.Image = "vllm/vllm-openai:v0.12.0"
	p.Spec.Prefill.Parallelism.Data = ptr.To[int32](3)
	p.Generation++
	if err := f.c.Update(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	newRev, err := render.KVRevision(p)
	if err != nil || newRev == oldRev {
		t.Fatalf("revision %q -> %q (%v): an image change must make a new one", oldRev, newRev, err)
	}
	newPrefill, newDecode := "c-prefill-"+newRev, "c-decode-"+newRev
	f.reconcile()
	// The router has not restarted with both revisions yet: the new one surges, the old one stays.
	if d := cmp.Diff(map[string]int32{"c-prefill": 1, "c-decode": 2, newPrefill: 1, newDecode: 1}, f.engines()); d != "" {
		t.Errorf("first step, router not current (-want +got):\n%s", d)
	}
	file := f.routerFile()
	want := []routerconfig.RevisionHosts{
		{Revision: oldRev, PrefillHost: "c-prefill.ns.svc", DecodeHost: "c-decode.ns.svc", PrefillDataParallel: 2},
		{Revision: newRev, PrefillHost: newPrefill + ".ns.svc", DecodeHost: newDecode + ".ns.svc", PrefillDataParallel: 3},
	}
	if d := cmp.Diff(want, file.Revisions); d != "" {
		t.Errorf("router.json revisions (-want +got):\n%s", d)
	}
	var svc corev1.Service
	if err := f.c.Get(context.Background(), client.ObjectKey{Namespace: "ns", Name: newPrefill}, &svc); err != nil || svc.Spec.Selector[v1alpha1.LabelKVRevision] != newRev {
		t.Errorf("new prefill Service %v selects %v, want the new revision's pods only", err, svc.Spec.Selector)
	}

	// The new revision ready, the router still restarting with the new router.json: the old
	// revision keeps every pod (the old router pods would find none of the new ones).
	f.settleBut("c-router")
	f.reconcile()
	if d := cmp.Diff(map[string]int32{"c-prefill": 1, "c-decode": 2, newPrefill: 1, newDecode: 1}, f.engines()); d != "" {
		t.Errorf("new revision ready, router not current (-want +got):\n%s", d)
	}

	// Step until nothing moves, checking that some revision serves at every step.
	for i := 0; i < 20; i++ {
		before := f.engines()
		f.settle()
		f.reconcile()
		after := f.engines()
		serving := false
		for _, rev := range []struct{ p, d string }{{"c-prefill", "c-decode"}, {newPrefill, newDecode}} {
			serving = serving || (after[rev.p] > 0 && after[rev.d] > 0)
		}
		if !serving {
			t.Fatalf("step %d: no revision has both pools: %v", i, after)
		}
		if cmp.Equal(before, after) && len(after) == 2 {
			break
		}
	}
	f.settle()
	f.reconcile()
	if d := cmp.Diff(map[string]int32{newPrefill: 1, newDecode: 2}, f.engines()); d != "" {
		t.Fatalf("after the rollout (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]string{newDecode, newPrefill, "c-router"}, f.services()); d != "" {
		t.Errorf("Services after the rollout (-want +got):\n%s", d)
	}
	if file := f.routerFile(); len(file.Revisions) != 0 || file.PrefillHost != newPrefill+".ns.svc" || file.DecodeHost != newDecode+".ns.svc" {
		t.Errorf("router.json after the rollout: %+v, want the new revision's Services alone", file)
	}
	var events []string
	for len(f.rec.Events) > 0 {
		e := <-f.rec.Events
		if strings.Contains(e, v1alpha1.ReasonKVRevisionRollingOut) {
			events = append(events, e)
		}
	}
	if !slices.ContainsFunc(events, func(e string) bool { return strings.Contains(e, "scaled prefill c-prefill 1 -> 0") }) ||
		!slices.ContainsFunc(events, func(e string) bool {
			// Each object named with its kind: a revision of LeaderWorkerSets has no Deployment.
			return strings.HasSuffix(e, "has drained: deleted Deployment c-prefill, Service c-prefill, Deployment c-decode, Service c-decode") ||
				strings.HasSuffix(e, "has drained: deleted Deployment c-decode, Service c-decode, Deployment c-prefill, Service c-prefill")
		}) {
		t.Errorf("rollout events %q, want the scale steps and the deletion", events)
	}

	f.settle()
	f.reconcile()
	f.writes = 0
	f.reconcile()
	if f.writes != 0 {
		t.Errorf("a resync after the rollout wrote %d times, want 0", f.writes)
	}
}

// Engine Deployments made before revisions had their own (selectors without the KV revision)
// are rolled away from, even at the same revision: their selectors cannot change. Their
// Services are narrowed to their revision's pods, so the router never finds the new pods
// behind the old revision's name.
func TestUnpinnedDeploymentsRollToRevisionDeployments(t *testing.T) {
	p := pdc()
	p.Spec.Rollout.MaxSurge = ptr.To(intstr.FromInt32(1))
	p.Spec.Rollout.MaxUnavailable = ptr.To(intstr.FromInt32(0))
	f := newRolloutFixture(t, p)
	objs, err := render.Render(p, render.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	rev, err := render.KVRevision(p)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, o := range objs {
		switch x := o.(type) {
		case *appsv1.Deployment:
			if x.Name != "c-router" {
				delete(x.Spec.Selector.MatchLabels, v1alpha1.LabelKVRevision)
			}
		case *corev1.Service:
			delete(x.Spec.Selector, v1alpha1.LabelKVRevision)
		default:
			continue
		}
		if err := controllerutil.SetControllerReference(p, o, f.c.Scheme()); err != nil {
			t.Fatal(err)
		}
		if err := f.c.Create(ctx, o.(client.Object)); err != nil {
			t.Fatal(err)
		}
	}
	f.settle()
	f.reconcile()
	newPrefill, newDecode := "c-prefill-"+rev, "c-decode-"+rev
	if d := cmp.Diff(map[string]int32{"c-prefill": 1, "c-decode": 2, newPrefill: 1, newDecode: 1}, f.engines()); d != "" {
		t.Errorf("first step (-want +got):\n%s", d)
	}
	var svc corev1.Service
	if err := f.c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: "c-decode"}, &svc); err != nil || svc.Spec.Selector[v1alpha1.LabelKVRevision] != rev {
		t.Errorf("the unpinned decode Service selects %v (%v), want its revision's pods only", svc.Spec.Selector, err)
	}
	for range 10 {
		f.settle()
		f.reconcile()
	}
	if d := cmp.Diff(map[string]int32{newPrefill: 1, newDecode: 2}, f.engines()); d != "" {
		t.Errorf("after the rollout (-want +got):\n%s", d)
	}
}

// The old KV revision shrinks only once every router pod is updated and available: a pod
// updated but not yet available may still be starting on the new router.json, and the
// pods it replaces may still serve with the old one, which lists none of the new pods.
func TestOldRevisionWaitsForEveryRouterPod(t *testing.T) {
	cases := []struct {
		name   string
		router appsv1.DeploymentStatus // of 2 replicas, at the Deployment's generation
		shrink bool
	}{
		{"every pod updated and available", appsv1.DeploymentStatus{Replicas: 2, UpdatedReplicas: 2, ReadyReplicas: 2, AvailableReplicas: 2}, true},
		{"every pod updated, one not available", appsv1.DeploymentStatus{Replicas: 2, UpdatedReplicas: 2, ReadyReplicas: 1, AvailableReplicas: 1}, false},
		{"every pod updated, none available", appsv1.DeploymentStatus{Replicas: 2, UpdatedReplicas: 2}, false},
		{"one pod not updated", appsv1.DeploymentStatus{Replicas: 2, UpdatedReplicas: 1, ReadyReplicas: 2, AvailableReplicas: 2}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc() // 1 prefill, 2 decode
			p.Spec.Router.Replicas = ptr.To[int32](2)
			p.Spec.Rollout.MaxSurge = ptr.To(intstr.FromInt32(1))
			p.Spec.Rollout.MaxUnavailable = ptr.To(intstr.FromInt32(0))
			f, newPrefill, newDecode := startKVRollout(t, p)
			ctx := context.Background()
			f.reconcile() // the new revision surges; the router's Deployment gets the new router.json

			// The new revision ready, the router's pods as the case has them.
			f.settle()
			var router appsv1.Deployment
			if err := f.c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: "c-router"}, &router); err != nil {
				t.Fatal(err)
			}
			if got := ptr.Deref(router.Spec.Replicas, 1); got != 2 {
				t.Fatalf("router Deployment asks %d replicas, want 2", got)
			}
			router.Status = tc.router
			router.Status.ObservedGeneration = router.Generation
			if err := f.c.Status().Update(ctx, &router); err != nil {
				t.Fatal(err)
			}
			f.reconcile()

			f.checkFirstStep(t, newPrefill, newDecode, tc.shrink)
		})
	}
}

// The reconcile that starts a rollout finds the router Deployment as it was: every pod updated
// and available, but to the router.json without the new revision, which this reconcile only
// now applies. No older pod goes in that reconcile, even where maxUnavailable would let one go
// before the new revision has any: the router could send its clients nowhere.
func TestOldRevisionWaitsForTheRouterToRunTheNewList(t *testing.T) {
	p := pdc() // 1 prefill, 2 decode
	p.Spec.Rollout.MaxSurge = ptr.To(intstr.FromInt32(1))
	p.Spec.Rollout.MaxUnavailable = ptr.To(intstr.FromInt32(1))
	f, newPrefill, newDecode := startKVRollout(t, p)
	var router appsv1.Deployment
	if err := f.c.Get(context.Background(), client.ObjectKey{Namespace: "ns", Name: "c-router"}, &router); err != nil {
		t.Fatal(err)
	}
	if st := router.Status; st.UpdatedReplicas != 1 || st.AvailableReplicas != 1 || st.ObservedGeneration != router.Generation {
		t.Fatalf("router before the rollout: %+v, want every pod updated and available", st)
	}
	f.reconcile()
	f.checkFirstStep(t, newPrefill, newDecode, false)
}

// An older revision's pod goes only once the new revision's pods are available (ready for
// their Deployment's minReadySeconds), not as soon as they are ready: the routers resolve
// their pools every few seconds, and until they have found the new pods, the old pod's
// clients have nowhere else to go (measured on the real node: 5 s of 503s in a rollout under
// load).
func TestOldRevisionWaitsForTheNewOneAvailable(t *testing.T) {
	for _, tc := range []struct {
		name      string
		available bool
		shrink    bool
	}{
		{"new revision ready, not yet available", false, false},
		{"new revision available", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc() // 1 prefill, 2 decode
			p.Spec.Rollout.MaxSurge = ptr.To(intstr.FromInt32(1))
			p.Spec.Rollout.MaxUnavailable = ptr.To(intstr.FromInt32(0))
			f, newPrefill, newDecode := startKVRollout(t, p)
			ctx := context.Background()
			f.reconcile() // the new revision surges
			f.settle()    // everything ready and available, the router current
			if !tc.available {
				for _, name := range []string{newPrefill, newDecode} {
					var d appsv1.Deployment
					if err := f.c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: name}, &d); err != nil {
						t.Fatal(err)
					}
					if d.Spec.MinReadySeconds != render.EngineMinReadySeconds {
						t.Errorf("%s minReadySeconds %d, want %d", name, d.Spec.MinReadySeconds, render.EngineMinReadySeconds)
					}
					d.Status.AvailableReplicas = 0
					if err := f.c.Status().Update(ctx, &d); err != nil {
						t.Fatal(err)
					}
				}
			}
			f.reconcile()
			f.checkFirstStep(t, newPrefill, newDecode, tc.shrink)
		})
	}
}

// startKVRollout runs p settled at its first KV revision, then changes its image (a new KV
// revision) and returns the fixture with the new revision's Deployment names, before the
// reconcile that starts the rollout.
func startKVRollout(t *testing.T, p *v1alpha1.PDCluster) (f *rolloutFixture, newPrefill, newDecode string) {
	t.Helper()
	f = newRolloutFixture(t, p)
	f.reconcile()
	f.settle()
	f.reconcile()
	ctx := context.Background()
	if err := f.c.Get(ctx, client.ObjectKeyFromObject(p), p); err != nil {
		t.Fatal(err)
	}
	p.Spec.Engine.Image = "vllm/vllm-openai:v0.12.0"
	p.Generation++
	if err := f.c.Update(ctx, p); err != nil {
		t.Fatal(err)
	}
	newRev, err := render.KVRevision(p)
	if err != nil {
		t.Fatal(err)
	}
	return f, "c-prefill-" + newRev, "c-decode-" + newRev
}

// checkFirstStep checks the engine Deployments after the rollout's first step from 1 prefill
// and 2 decode with a surge of 1: the new revision at 1 and 1 beside the old one, whose decode
// steps down by the surge when shrink (prefill keeps its one pod beside decode's).
func (f *rolloutFixture) checkFirstStep(t *testing.T, newPrefill, newDecode string, shrink bool) {
	t.Helper()
	want := map[string]int32{"c-prefill": 1, "c-decode": 2, newPrefill: 1, newDecode: 1}
	if shrink {
		want["c-decode"] = 1
	}
	if d := cmp.Diff(want, f.engines()); d != "" {
		t.Errorf("engine Deployments after the step (-want +got):\n%s", d)
	}
}
