package controllers

import (
	"strings"
	"testing"
	"unicode/utf8"

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

// TestClipKeepsTheCause: the kubelet's and the engine's messages say what failed first and why
// last (containerd's cause, Python's exception); a clipped message keeps both ends, within the
// bound, on rune boundaries. The cut-off cause of an image pull once hid a full disk in CI.
func TestClipKeepsTheCause(t *testing.T) {
	pull := `failed to pull and unpack image "127.0.0.1:5000/pdcluster/vllm-cpu:0.30.0": failed to prepare extraction snapshot ` +
		`"extract-906790786-MhIZ sha256:dce7eae2bbc9355daa9761fc9c834244556e8b1c27e058b55d0d7243efb8a992": ` +
		`failed to create temp dir: mkdir /root/.cache/pdcluster/cluster/node/containerd/root/io.containerd.snapshotter.v1.overlayfs/snapshots/new-1234: no space left on device`
	traceback := "Traceback (most recent call last):\n" + strings.Repeat("  File \"/opt/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py\", line 1, in run\n", 8) +
		"AssertionError: assert req_id in self.requests"
	wide := "a" + strings.Repeat("é", 400) // two bytes each, from an odd offset: a cut at a byte bound splits one
	for _, tc := range []struct {
		name, in, head, tail string
	}{
		{"short is whole", "not found", "not found", "not found"},
		{"an image pull keeps its image and its cause", pull, `failed to pull and unpack image "127.0.0.1:5000/pdcluster/vllm-cpu:0.30.0"`, "no space left on device"},
		{"a traceback keeps its exception", traceback, "Traceback (most recent call last):", "AssertionError: assert req_id in self.requests"},
		{"multi-byte runes stay whole", wide, "aé", "éé"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := clip(tc.in)
			if !strings.HasPrefix(got, tc.head) || !strings.HasSuffix(got, tc.tail) {
				t.Errorf("clip(%q) = %q: want it to start %q and end %q", tc.in, got, tc.head, tc.tail)
			}
			if len(got) > maxProblemMessage+len(clipped) {
				t.Errorf("clip gave %d bytes, more than %d", len(got), maxProblemMessage+len(clipped))
			}
			if !utf8.ValidString(got) {
				t.Errorf("clip(%q) = %q: not valid UTF-8", tc.in, got)
			}
			if len(tc.in) > maxProblemMessage && !strings.Contains(got, clipped) {
				t.Errorf("clip(%q) = %q: a clipped message says so (%q)", tc.in, got, clipped)
			}
		})
	}
}
