package integration

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// enginePods stands in for the ReplicaSet controller and kubelet: n running, ready pods of
// role at KV revision rev.
func (f *fixture) enginePods(cluster string, role v1alpha1.Role, rev string, names ...string) {
	f.t.Helper()
	for _, name := range names {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, Name: name, Labels: render.Labels(cluster, role)},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: v1alpha1.EngineContainerName, Image: "x"}}},
		}
		p.Labels[v1alpha1.LabelKVRevision] = rev
		if err := f.c.Create(f.ctx, p); err != nil {
			f.t.Fatal(err)
		}
		p.Status = corev1.PodStatus{Phase: corev1.PodRunning}
		if err := f.c.Status().Update(f.ctx, p); err != nil {
			f.t.Fatal(err)
		}
	}
}

func (f *fixture) deletePods(names ...string) {
	f.t.Helper()
	for _, name := range names {
		if err := f.c.Delete(f.ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, Name: name}}, client.GracePeriodSeconds(0)); err != nil {
			f.t.Fatal(err)
		}
	}
}

// settle stands in for the Deployment controller: every Deployment of the namespace is ready
// at what it asks.
func (f *fixture) settle() {
	f.t.Helper()
	var deps appsv1.DeploymentList
	if err := f.c.List(f.ctx, &deps, client.InNamespace(f.ns)); err != nil {
		f.t.Fatal(err)
	}
	for _, d := range deps.Items {
		f.setDeploymentStatus(d.Name, *d.Spec.Replicas, *d.Spec.Replicas)
	}
}

// engines are the engine Deployments' replicas by name.
func (f *fixture) engines() map[string]int32 {
	f.t.Helper()
	var deps appsv1.DeploymentList
	if err := f.c.List(f.ctx, &deps, client.InNamespace(f.ns)); err != nil {
		f.t.Fatal(err)
	}
	out := map[string]int32{}
	for _, d := range deps.Items {
		if d.Labels[v1alpha1.LabelRole] != string(v1alpha1.RoleRouter) {
			out[d.Name] = *d.Spec.Replicas
		}
	}
	return out
}

func (f *fixture) routerRevisions(cluster string) []routerconfig.RevisionHosts {
	f.t.Helper()
	var cm corev1.ConfigMap
	f.get(&cm, render.ObjectName(cluster, v1alpha1.RoleRouter))
	var file routerconfig.File
	if err := json.Unmarshal([]byte(cm.Data[routerconfig.FileName]), &file); err != nil {
		f.t.Fatal(err)
	}
	return file.Revisions
}

// TestKVRevisionRollout: an image change is a new KV revision with Deployments and Services of
// its own, which router.json lists beside the old ones; the rollout steps as readiness
// arrives, the old revision's objects go once drained, status and Progressing follow the
// engine pods' revisions, and then nothing is written.
func TestKVRevisionRollout(t *testing.T) {
	f := newFixture(t)
	if err := f.c.Create(f.ctx, wrappers.MakePDCluster(f.ns, "rev").Replicas(2, 2).Obj()); err != nil {
		t.Fatal(err)
	}
	f.reconcile("rev")
	templateRevision := func(name string) string {
		var d appsv1.Deployment
		f.get(&d, name)
		return d.Spec.Template.Labels[v1alpha1.LabelKVRevision]
	}
	first := templateRevision("rev-prefill")
	if first == "" || templateRevision("rev-decode") != first {
		t.Fatalf("engine templates at KV revisions %q and %q: want one", first, templateRevision("rev-decode"))
	}
	f.enginePods("rev", v1alpha1.RolePrefill, first, "rev-prefill-a", "rev-prefill-a2")
	f.enginePods("rev", v1alpha1.RoleDecode, first, "rev-decode-a", "rev-decode-a2")
	f.settle()
	f.reconcile("rev")
	var pdc v1alpha1.PDCluster
	f.get(&pdc, "rev")
	if pdc.Status.UpdateRevision != first || pdc.Status.CurrentRevision != first || condition(&pdc, v1alpha1.ConditionProgressing).Reason != v1alpha1.ReasonRolloutComplete {
		t.Fatalf("after the first pods: update %q current %q Progressing %+v, want %s, %s, RolloutComplete",
			pdc.Status.UpdateRevision, pdc.Status.CurrentRevision, condition(&pdc, v1alpha1.ConditionProgressing), first, first)
	}
	f.events()

	pdc.Spec.Engine.Image = "vllm/vllm-openai:v0.12.0"
	if err := f.c.Update(f.ctx, &pdc); err != nil {
		t.Fatal(err)
	}
	f.reconcile("rev")
	f.get(&pdc, "rev")
	second := pdc.Status.UpdateRevision
	newPrefill, newDecode := "rev-prefill-"+second, "rev-decode-"+second
	if second == first || templateRevision(newPrefill) != second || templateRevision(newDecode) != second {
		t.Fatalf("after an image change: update revision %q (was %q), want new Deployments %s and %s at it", second, first, newPrefill, newDecode)
	}
	// maxSurge 25% of 2 is 1 pod per pool; the router still runs the old router.json, so the
	// old revision keeps its pods.
	if d := cmp.Diff(map[string]int32{"rev-prefill": 2, "rev-decode": 2, newPrefill: 1, newDecode: 1}, f.engines()); d != "" {
		t.Errorf("first step (-want +got):\n%s", d)
	}
	wantHosts := []routerconfig.RevisionHosts{
		{Revision: first, PrefillHost: "rev-prefill." + f.ns + ".svc", DecodeHost: "rev-decode." + f.ns + ".svc"},
		{Revision: second, PrefillHost: newPrefill + "." + f.ns + ".svc", DecodeHost: newDecode + "." + f.ns + ".svc"},
	}
	if d := cmp.Diff(wantHosts, f.routerRevisions("rev")); d != "" {
		t.Errorf("router.json revisions (-want +got):\n%s", d)
	}
	for name, rev := range map[string]string{"rev-prefill": first, newDecode: second} {
		var svc corev1.Service
		f.get(&svc, name)
		if svc.Spec.Selector[v1alpha1.LabelKVRevision] != rev {
			t.Errorf("Service %s selects %v, want the pods of revision %s only", name, svc.Spec.Selector, rev)
		}
	}
	f.enginePods("rev", v1alpha1.RolePrefill, second, "rev-prefill-b")
	f.reconcile("rev")
	f.get(&pdc, "rev")
	c := condition(&pdc, v1alpha1.ConditionProgressing)
	if pdc.Status.UpdateRevision != second || pdc.Status.CurrentRevision != first || c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonKVRevisionRollingOut ||
		!strings.Contains(c.Message, first+": 2 prefill, 2 decode") || !strings.Contains(c.Message, second+": 1 prefill, 0 decode") {
		t.Errorf("mid-rollout: update %q current %q Progressing %+v", pdc.Status.UpdateRevision, pdc.Status.CurrentRevision, c)
	}
	if ev := f.events(); !containsPrefix(ev, "Normal KVRevisionRollingOut rolling out KV revision "+second) {
		t.Errorf("events %q: want KVRevisionRollingOut", ev)
	}

	// Readiness arrives step by step; some revision serves both pools at every step.
	var steps []map[string]int32
	for range 10 {
		f.settle()
		f.reconcile("rev")
		e := f.engines()
		steps = append(steps, e)
		if e["rev-prefill"]+e["rev-decode"] > 0 && (e["rev-prefill"] == 0 || e["rev-decode"] == 0) {
			t.Fatalf("the old revision left with one pool: %v", e)
		}
		if (e["rev-prefill"] == 0 || e["rev-decode"] == 0) && (e[newPrefill] == 0 || e[newDecode] == 0) {
			t.Fatalf("no revision serves: %v", e)
		}
		if len(e) == 2 {
			break
		}
	}
	if d := cmp.Diff(map[string]int32{newPrefill: 2, newDecode: 2}, steps[len(steps)-1]); d != "" {
		t.Fatalf("after the steps %v (-want +got):\n%s", steps, d)
	}
	if len(steps) < 3 {
		t.Errorf("steps %v: a surge of 1 per pool takes more than two", steps)
	}
	var svcs corev1.ServiceList
	if err := f.c.List(f.ctx, &svcs, client.InNamespace(f.ns)); err != nil {
		t.Fatal(err)
	}
	for _, svc := range svcs.Items {
		if svc.Name == "rev-prefill" || svc.Name == "rev-decode" {
			t.Errorf("the drained revision's Service %s is still there", svc.Name)
		}
	}
	f.reconcile("rev")
	if revs := f.routerRevisions("rev"); len(revs) != 0 {
		t.Errorf("router.json after the rollout lists %v, want the new revision's Services alone", revs)
	}
	if ev := f.events(); !slices.ContainsFunc(ev, func(e string) bool { return strings.Contains(e, "has drained: deleted Deployment ") }) {
		t.Errorf("events %q: want the drained revision's deletion", ev)
	}

	f.deletePods("rev-prefill-a", "rev-prefill-a2", "rev-decode-a", "rev-decode-a2")
	f.enginePods("rev", v1alpha1.RolePrefill, second, "rev-prefill-b2")
	f.enginePods("rev", v1alpha1.RoleDecode, second, "rev-decode-b", "rev-decode-b2")
	f.settle()
	f.reconcile("rev")
	f.get(&pdc, "rev")
	if pdc.Status.CurrentRevision != second || condition(&pdc, v1alpha1.ConditionProgressing).Status != metav1.ConditionFalse {
		t.Errorf("after the rollout: current %q Progressing %+v, want %s, False", pdc.Status.CurrentRevision, condition(&pdc, v1alpha1.ConditionProgressing), second)
	}
	if ev := f.events(); !containsPrefix(ev, "Normal RolloutComplete every engine pod serves KV revision "+second) {
		t.Errorf("events %q: want RolloutComplete", ev)
	}
	writes.Store(0)
	f.reconcile("rev")
	if n := writes.Load(); n != 0 {
		t.Errorf("a resync after the rollout made %d writes, want 0", n)
	}
}

func containsPrefix(list []string, prefix string) bool {
	for _, s := range list {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}
