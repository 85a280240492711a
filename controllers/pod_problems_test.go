package controllers

import (
	"context"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

const gpuMessage = "0/5 nodes are available: 4 Insufficient nvidia.com/gpu, 1 node(s) had untolerated taint {node-role: infra}."

func unschedulable(p *corev1.Pod) *corev1.Pod {
	p.Status = corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{{
		Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonUnschedulable, Message: gpuMessage,
	}}}
	return p
}

func waiting(p *corev1.Pod, container, reason, msg string, last *corev1.ContainerStateTerminated) *corev1.Pod {
	p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{
		Name: container, RestartCount: 4,
		State:                corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: reason, Message: msg}},
		LastTerminationState: corev1.ContainerState{Terminated: last},
	})
	return p
}

func TestPodProblem(t *testing.T) {
	oom := &corev1.ContainerStateTerminated{ExitCode: 137, Reason: "OOMKilled"}
	crashed := &corev1.ContainerStateTerminated{ExitCode: 1, Reason: "Error", Message: "ModuleNotFoundError: No module named 'pdgate'"}
	for _, tc := range []struct {
		name         string
		pods         []*corev1.Pod
		reason, want string
	}{
		{"none", []*corev1.Pod{pod("d-0", v1alpha1.RoleDecode, 0)}, "", ""},
		{"unschedulable, in the scheduler's words", []*corev1.Pod{unschedulable(pod("d-0", v1alpha1.RoleDecode, 0))},
			v1alpha1.ReasonUnschedulable, "pod d-0: " + gpuMessage},
		{"OOMKilled crash loop", []*corev1.Pod{waiting(pod("d-0", v1alpha1.RoleDecode, 0), "engine", "CrashLoopBackOff", "back-off 40s", oom)},
			v1alpha1.ReasonCrashLoopBackOff, "pod d-0 container engine: CrashLoopBackOff (4 restarts); last exit code 137 (OOMKilled)"},
		{"crash loop with the process's last words", []*corev1.Pod{waiting(pod("d-0", v1alpha1.RoleDecode, 0), "engine", "CrashLoopBackOff", "", crashed)},
			v1alpha1.ReasonCrashLoopBackOff, "pod d-0 container engine: CrashLoopBackOff (4 restarts); last exit code 1 (Error): ModuleNotFoundError: No module named 'pdgate'"},
		{"image pull", []*corev1.Pod{waiting(pod("d-0", v1alpha1.RoleDecode, 0), "engine", "ImagePullBackOff", `Back-off pulling image "vllm/vllm-openai:v9"`, nil)},
			v1alpha1.ReasonImagePullFailed, `pod d-0 container engine: ImagePullBackOff: Back-off pulling image "vllm/vllm-openai:v9"`},
		{"missing secret", []*corev1.Pod{waiting(pod("d-0", v1alpha1.RoleDecode, 0), "engine", "CreateContainerConfigError", `secret "hf-token" not found`, nil)},
			v1alpha1.ReasonContainerFailed, `pod d-0 container engine: CreateContainerConfigError: secret "hf-token" not found`},
		{"starting is no problem", []*corev1.Pod{waiting(pod("d-0", v1alpha1.RoleDecode, 0), "engine", "ContainerCreating", "", nil)}, "", ""},
		{"unschedulable outranks a crash in another pod", []*corev1.Pod{
			waiting(pod("d-0", v1alpha1.RoleDecode, 0), "engine", "CrashLoopBackOff", "", oom), unschedulable(pod("d-1", v1alpha1.RoleDecode, 0))},
			v1alpha1.ReasonUnschedulable, "pod d-1: " + gpuMessage},
		{"an image pull outranks a crash in the same pod", []*corev1.Pod{
			waiting(waiting(pod("d-0", v1alpha1.RoleDecode, 0), "connector", "CrashLoopBackOff", "", oom), "engine", "ErrImagePull", "not found", nil)},
			v1alpha1.ReasonImagePullFailed, "pod d-0 container engine: ErrImagePull: not found"},
		{"a terminating pod is not the story", []*corev1.Pod{func() *corev1.Pod {
			p := unschedulable(pod("d-0", v1alpha1.RoleDecode, 0))
			p.DeletionTimestamp = ptr.To(metav1.NewTime(start))
			return p
		}()}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var pods []corev1.Pod
			for _, p := range tc.pods {
				pods = append(pods, *p)
			}
			reason, msg := podProblem(pods)
			if d := cmp.Diff([]string{tc.reason, tc.want}, []string{reason, msg}); d != "" {
				t.Errorf("(-want +got):\n%s", d)
			}
		})
	}
}

// A decode pool asking for more GPUs than any node has: Ready and DecodeReady say why in the
// scheduler's words, with one Warning event, not "ComponentsNotReady: not ready: [decode]".
func TestUnschedulableDecodeIsTheReadyReason(t *testing.T) {
	p := pdc()
	deps := []client.Object{}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode, v1alpha1.RoleRouter} {
		ready := int32(1)
		if role == v1alpha1.RoleDecode {
			ready = 0
		}
		deps = append(deps, &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: render.ObjectName("c", role), Generation: 1},
			Spec:       appsv1.DeploymentSpec{Replicas: ptr.To[int32](1)},
			Status:     appsv1.DeploymentStatus{ObservedGeneration: 1, UpdatedReplicas: 1, ReadyReplicas: ready},
		})
	}
	c := newFakeClient(t).WithObjects(p, unschedulable(pod("d-0", v1alpha1.RoleDecode, 0)), pod("p-0", v1alpha1.RolePrefill, 0)).
		WithObjects(deps...).WithStatusSubresource(&v1alpha1.PDCluster{}).Build()
	rec := events.NewFakeRecorder(100)
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Recorder: rec, Options: render.DefaultOptions(), Clock: clocktesting.NewFakePassiveClock(start)}
	status := p.Status.DeepCopy()
	if err := r.reconcilePoolStatus(context.Background(), p, status, nil); err != nil {
		t.Fatal(err)
	}
	for _, typ := range []string{v1alpha1.ConditionReady, v1alpha1.ConditionDecodeReady} {
		cond := meta.FindStatusCondition(status.Conditions, typ)
		if cond == nil || cond.Status != metav1.ConditionFalse || cond.Reason != v1alpha1.ReasonUnschedulable || !strings.Contains(cond.Message, gpuMessage) {
			t.Errorf("%s = %+v, want False/Unschedulable with the scheduler's message", typ, cond)
		}
	}
	if got := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionReady).Message; !strings.HasPrefix(got, "decode: pod d-0: ") {
		t.Errorf("Ready message %q does not name the pool and the pod", got)
	}
	evs := poolProblemEvents(nil, status)
	if len(evs) != 1 || evs[0].kind != corev1.EventTypeWarning || evs[0].reason != v1alpha1.ReasonUnschedulable {
		t.Fatalf("events = %+v, want one Warning Unschedulable", evs)
	}
	if again := poolProblemEvents(status.Conditions, status); len(again) != 0 {
		t.Errorf("events on an unchanged reason: %+v", again)
	}

	// Through Reconcile: the event is recorded once.
	for range 2 {
		if _, err := r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(p)}); err != nil {
			t.Fatalf("reconcile: %v", err)
		}
	}
	n := 0
	for len(rec.Events) > 0 {
		if e := <-rec.Events; strings.Contains(e, "Unschedulable") {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d Unschedulable events over two reconciles, want 1", n)
	}
}

// Right after a scale from 2 to 3 the cache may still hold the Deployment as it was, fully
// ready: that is not a Ready pool of 3.
func TestStaleCachedDeploymentIsNotReady(t *testing.T) {
	p := pdc() // decode: 2 replicas
	var objs []client.Object
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		dep, err := render.EngineDeployment(p, render.DefaultOptions(), role)
		if err != nil {
			t.Fatal(err)
		}
		dep.Status = appsv1.DeploymentStatus{ObservedGeneration: dep.Generation, Replicas: *dep.Spec.Replicas, UpdatedReplicas: *dep.Spec.Replicas, ReadyReplicas: *dep.Spec.Replicas}
		objs = append(objs, dep)
	}
	c := newFakeClient(t).WithObjects(objs...).Build()
	r := &PDClusterReconciler{Client: c, Scheme: c.Scheme(), Recorder: events.NewFakeRecorder(10), Options: render.DefaultOptions()}
	applied := func() []render.Object {
		objs, err := render.Render(p, render.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		return objs
	}
	status := p.Status.DeepCopy()
	if err := r.reconcilePoolStatus(context.Background(), p, status, applied()); err != nil {
		t.Fatal(err)
	}
	if cond := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionDecodeReady); cond == nil || cond.Status != metav1.ConditionTrue {
		t.Fatalf("DecodeReady = %+v with the cache in step, want True", cond)
	}
	p.Spec.Decode.Replicas = ptr.To[int32](3) // applied; the cache has not seen it yet
	status = p.Status.DeepCopy()
	if err := r.reconcilePoolStatus(context.Background(), p, status, applied()); err != nil {
		t.Fatal(err)
	}
	cond := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionDecodeReady)
	if cond == nil || cond.Status != metav1.ConditionFalse || cond.Reason != v1alpha1.ReasonRollingOut {
		t.Errorf("DecodeReady = %+v, want False/RollingOut while the cache is behind", cond)
	}
}

// A Deployment's counts, read as a pool's readiness. readyReplicas counts old pods too, so a
// rollout whose new pod is not ready yet must not read as ready (seen on the real node).
func TestPoolStatusFromDeploymentCounts(t *testing.T) {
	for _, tc := range []struct {
		name                           string
		generation, observed           int64
		replicas, updated, ready, want int32
		reason                         string
	}{
		{"all new and ready", 2, 2, 1, 1, 1, 1, v1alpha1.ReasonReplicasReady},
		{"spec not observed yet", 3, 2, 1, 1, 1, 1, v1alpha1.ReasonRollingOut},
		{"new pod created, old one still serving", 2, 2, 2, 1, 1, 1, v1alpha1.ReasonRollingOut},
		{"new pods not ready", 2, 2, 2, 2, 1, 2, v1alpha1.ReasonReplicasNotReady},
		{"scaled to zero", 2, 2, 0, 0, 0, 0, v1alpha1.ReasonScaledToZero},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dep := &appsv1.Deployment{
				ObjectMeta: metav1.ObjectMeta{Generation: tc.generation},
				Spec:       appsv1.DeploymentSpec{Replicas: ptr.To(tc.want)},
				Status:     appsv1.DeploymentStatus{ObservedGeneration: tc.observed, Replicas: tc.replicas, UpdatedReplicas: tc.updated, ReadyReplicas: tc.ready},
			}
			if _, _, reason, msg := poolStatus(dep); reason != tc.reason {
				t.Errorf("reason = %s (%s), want %s", reason, msg, tc.reason)
			}
		})
	}
}
