package controllers

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
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
