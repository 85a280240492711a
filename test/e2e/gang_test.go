package e2e

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// gangNode is a kwok node of 8 GPUs that only this test's pods tolerate.
func gangNode(name string) *corev1.Node {
	capacity := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("64"), corev1.ResourceMemory: resource.MustParse("512Gi"),
		corev1.ResourcePods: resource.MustParse("110"), v1alpha1.GPUResourceName: resource.MustParse("8")}
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name,
			Annotations: map[string]string{"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
			Labels:      map[string]string{"kubernetes.io/hostname": name, "type": "kwok", "pdcluster.dev/gang-test": "true"}},
		Spec:   corev1.NodeSpec{Taints: []corev1.Taint{{Key: "pdcluster.dev/gang-test", Value: "true", Effect: corev1.TaintEffectNoSchedule}}},
		Status: corev1.NodeStatus{Allocatable: capacity, Capacity: capacity},
	}
}

// A prefill replica of two 8-GPU pods, with the real kube-scheduler's gang scheduling
// (GenericWorkload on): with gang None and one free 8-GPU node, one pod binds and the other
// waits, holding nothing; with gang Auto and the same node, no pod binds and GangScheduling
// quotes the scheduler; a second node binds both.
func TestGangScheduling(t *testing.T) {
	if os.Getenv("PDCLUSTER_E2E_REAL_NODE") == "" {
		t.Skip("LeaderWorkerSet runs on the real node (hack/local-node.sh lws)")
	}
	e := setup(t)
	const ns, name = "gangs", "big"
	e.namespace(ns)
	for _, n := range []string{"gang-node-0", "gang-node-1"} {
		t.Cleanup(func() { e.run("delete", "node", n, "--ignore-not-found", "--wait=false") })
	}
	if err := e.c.Create(e.ctx, gangNode("gang-node-0")); err != nil {
		t.Fatal(err)
	}
	p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	p.Spec.Model.Path = "Qwen/Qwen3-0.6B"
	p.Spec.Engine.Image = "vllm/vllm-openai:v0.11.0"
	p.Spec.KVTransfer.Protocol = v1alpha1.ProtocolTCP
	p.Spec.Scheduling.Gang = v1alpha1.GangNone
	// One group at a time: a surge group would need a third node.
	p.Spec.Rollout.MaxSurge, p.Spec.Rollout.MaxUnavailable = ptr.To(intstr.FromInt32(0)), ptr.To(intstr.FromInt32(1))
	p.Spec.Prefill = v1alpha1.PoolSpec{
		Replicas:     ptr.To[int32](1),
		Parallelism:  v1alpha1.Parallelism{Tensor: ptr.To[int32](16), Nodes: ptr.To[int32](2)},
		NodeSelector: v1alpha1.NodeSelector{"pdcluster.dev/gang-test": "true"},
		Tolerations:  []corev1.Toleration{{Key: "pdcluster.dev/gang-test", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}},
	}
	p.Spec.Decode = v1alpha1.PoolSpec{
		Replicas:     ptr.To[int32](1),
		NodeSelector: v1alpha1.NodeSelector{"pdcluster.dev/gpu-pool": "true"},
		Tolerations:  []corev1.Toleration{{Key: "nvidia.com/gpu", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}},
	}
	if err := e.c.Create(e.ctx, p); err != nil {
		t.Fatal(err)
	}
	prefill := func() (pods []corev1.Pod, bound int) {
		pods = e.podsOf(ns, name, v1alpha1.RolePrefill)
		for _, pod := range pods {
			if pod.Spec.NodeName != "" {
				bound++
			}
		}
		return pods, bound
	}
	gangCondition := func() *metav1.Condition {
		var got v1alpha1.PDCluster
		if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: ns, Name: name}, &got); err != nil {
			t.Fatal(err)
		}
		return meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionGangScheduling)
	}

	// gang None: one by one, so one pod takes the node's 8 GPUs and the other waits.
	e.eventually("gang None: one of the two pods bound", func() error {
		if pods, bound := prefill(); len(pods) != 2 || bound != 1 {
			return fmt.Errorf("%d pods, %d bound", len(pods), bound)
		}
		return nil
	})
	if c := gangCondition(); c == nil || c.Reason != v1alpha1.ReasonGangDisabled {
		t.Errorf("GangScheduling %+v with gang None", c)
	}

	// gang Auto: the group is recreated in its PodGroup; with one node, none of it binds.
	e.patchNamed(ns, name, `{"scheduling":{"gang":"Auto"}}`)
	e.eventually("gang Auto: a group of two pods in their PodGroup, none bound, the scheduler quoted", func() error {
		pods, bound := prefill()
		if len(pods) != 2 || bound != 0 {
			return fmt.Errorf("%d pods, %d bound", len(pods), bound)
		}
		for _, pod := range pods {
			if pod.Spec.SchedulingGroup == nil || ptr.Deref(pod.Spec.SchedulingGroup.PodGroupName, "") == "" {
				return fmt.Errorf("%s is in no PodGroup", pod.Name)
			}
		}
		if c := gangCondition(); c == nil || c.Reason != v1alpha1.ReasonGangUnschedulable || !strings.Contains(c.Message, "big-prefill-lws-0") {
			return fmt.Errorf("GangScheduling %+v", c)
		}
		return nil
	})
	// And it stays so: a gang is bound whole or not at all.
	time.Sleep(5 * time.Second)
	if _, bound := prefill(); bound != 0 {
		t.Fatalf("%d pods of an unplaceable gang bound", bound)
	}

	if err := e.c.Create(e.ctx, gangNode("gang-node-1")); err != nil {
		t.Fatal(err)
	}
	e.eventually("a second node: both pods bound, one per node", func() error {
		pods, bound := prefill()
		if len(pods) != 2 || bound != 2 || pods[0].Spec.NodeName == pods[1].Spec.NodeName {
			return fmt.Errorf("%d pods, %d bound", len(pods), bound)
		}
		return nil
	})
}

// patchNamed merge-patches the spec of PDCluster ns/name.
func (e *env) patchNamed(ns, name, spec string) {
	e.t.Helper()
	e.run("patch", "pdcluster", "-n", ns, name, "--type=merge", "-p", `{"spec":`+spec+`}`)
}
