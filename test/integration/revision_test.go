package integration

import (
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
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

func (f *fixture) poolsReady(cluster string) {
	f.t.Helper()
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode, v1alpha1.RoleRouter} {
		var d appsv1.Deployment
		f.get(&d, render.ObjectName(cluster, role))
		f.setDeploymentStatus(d.Name, *d.Spec.Replicas, *d.Spec.Replicas)
	}
}

// TestKVRevisionRollout: an image change is a new KV revision; status and Progressing follow
// the engine pods' revisions until every pod serves the new one, and then nothing is written.
func TestKVRevisionRollout(t *testing.T) {
	f := newFixture(t)
	if err := f.c.Create(f.ctx, wrappers.MakePDCluster(f.ns, "rev").Replicas(1, 1).Obj()); err != nil {
		t.Fatal(err)
	}
	f.reconcile("rev")
	templateRevision := func(role v1alpha1.Role) string {
		var d appsv1.Deployment
		f.get(&d, render.ObjectName("rev", role))
		return d.Spec.Template.Labels[v1alpha1.LabelKVRevision]
	}
	first := templateRevision(v1alpha1.RolePrefill)
	if first == "" || templateRevision(v1alpha1.RoleDecode) != first {
		t.Fatalf("engine templates at KV revisions %q and %q: want one", first, templateRevision(v1alpha1.RoleDecode))
	}
	f.enginePods("rev", v1alpha1.RolePrefill, first, "rev-prefill-a")
	f.enginePods("rev", v1alpha1.RoleDecode, first, "rev-decode-a")
	f.poolsReady("rev")
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
	second := templateRevision(v1alpha1.RoleDecode)
	if second == first || templateRevision(v1alpha1.RolePrefill) != second {
		t.Fatalf("after an image change: templates at %q and %q, want one new revision (was %q)", templateRevision(v1alpha1.RolePrefill), second, first)
	}
	f.enginePods("rev", v1alpha1.RolePrefill, second, "rev-prefill-b")
	f.reconcile("rev")
	f.get(&pdc, "rev")
	c := condition(&pdc, v1alpha1.ConditionProgressing)
	if pdc.Status.UpdateRevision != second || pdc.Status.CurrentRevision != first || c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonKVRevisionRollingOut ||
		!strings.Contains(c.Message, first+": 1 prefill, 1 decode") || !strings.Contains(c.Message, second+": 1 prefill, 0 decode") {
		t.Errorf("mid-rollout: update %q current %q Progressing %+v", pdc.Status.UpdateRevision, pdc.Status.CurrentRevision, c)
	}
	if ev := f.events(); !containsPrefix(ev, "Normal KVRevisionRollingOut rolling out KV revision "+second) {
		t.Errorf("events %q: want KVRevisionRollingOut", ev)
	}

	f.deletePods("rev-prefill-a", "rev-decode-a")
	f.enginePods("rev", v1alpha1.RoleDecode, second, "rev-decode-b")
	f.poolsReady("rev")
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
