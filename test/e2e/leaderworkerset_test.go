package e2e

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// A prefill replica across two kwok GPU nodes (the model sharded tensor 2 over 2 pods), with
// the real LeaderWorkerSet controller and its webhooks (hack/local-node.sh lws): the operator's
// LeaderWorkerSet runs one group of two pods, each with its GPU share and the group's variables
// from LWS's pod webhook; the group counts as the pool's one ready replica; the pool Service
// serves the leader only; a worker pod deleted recreates the whole group.
func TestLeaderWorkerSetGroups(t *testing.T) {
	if os.Getenv("PDCLUSTER_E2E_REAL_NODE") == "" {
		t.Skip("LeaderWorkerSet runs on the real node (hack/local-node.sh lws)")
	}
	e := setup(t)
	const ns, name = "groups", "sharded"
	e.namespace(ns)
	gpu := v1alpha1.PoolSpec{
		NodeSelector: v1alpha1.NodeSelector{"pdcluster.dev/gpu-pool": "true"},
		Tolerations:  []corev1.Toleration{{Key: "nvidia.com/gpu", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}},
	}
	p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	p.Spec.Model.Path = "Qwen/Qwen3-0.6B"
	p.Spec.Engine.Image = "vllm/vllm-openai:v0.11.0"
	p.Spec.KVTransfer.Protocol = v1alpha1.ProtocolTCP
	p.Spec.Prefill, p.Spec.Decode = *gpu.DeepCopy(), *gpu.DeepCopy()
	p.Spec.Prefill.Replicas, p.Spec.Decode.Replicas = ptr.To[int32](1), ptr.To[int32](1)
	p.Spec.Prefill.Parallelism = v1alpha1.Parallelism{Tensor: ptr.To[int32](2), Nodes: ptr.To[int32](2)}
	if err := e.c.Create(e.ctx, p); err != nil {
		t.Fatal(err)
	}

	groupSet := render.GroupSetName(render.ObjectName(name, v1alpha1.RolePrefill))
	prefillPods := func() []corev1.Pod { return e.podsOf(ns, name, v1alpha1.RolePrefill) }
	e.eventually("the PDCluster Ready on one group of 2 prefill pods", func() error {
		var got v1alpha1.PDCluster
		if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: ns, Name: name}, &got); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("Ready %+v", c)
		}
		if got.Status.Prefill.Ready != "1/1" {
			return fmt.Errorf("prefill %q ready, want the one group", got.Status.Prefill.Ready)
		}
		if n := len(prefillPods()); n != 2 {
			return fmt.Errorf("%d prefill pods, want 2", n)
		}
		return nil
	})
	var lws lwsv1.LeaderWorkerSet
	if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: ns, Name: groupSet}, &lws); err != nil {
		t.Fatal(err)
	}
	if lws.Status.ReadyReplicas != 1 {
		t.Errorf("LeaderWorkerSet status %+v: want its one group ready", lws.Status)
	}

	pods := prefillPods()
	var leader string
	uidsBefore := map[types.UID]bool{}
	for _, pod := range pods {
		uidsBefore[pod.UID] = true
		index := pod.Labels[lwsv1.WorkerIndexLabelKey]
		if index == "0" {
			leader = pod.Name
		}
		engine := pod.Spec.Containers[slices.IndexFunc(pod.Spec.Containers, func(c corev1.Container) bool { return c.Name == v1alpha1.EngineContainerName })]
		if got := engine.Resources.Requests[v1alpha1.GPUResourceName]; got.Value() != 1 {
			t.Errorf("%s asks %s GPUs, want its share 1 (tensor 2 over 2 pods)", pod.Name, got.String())
		}
		env := map[string]string{}
		for _, v := range engine.Env {
			env[v.Name] = v.Value
		}
		// What `connector launch` reads, injected by LeaderWorkerSet's pod webhook.
		if env[vllm.EnvLWSGroupSize] != "2" || env[vllm.EnvLWSWorkerIndex] != index ||
			!strings.HasPrefix(env[vllm.EnvLWSLeaderAddress], groupSet+"-0."+groupSet+"."+ns) {
			t.Errorf("%s (worker index %q) engine env %v: want the group's variables", pod.Name, index, env)
		}
		if len(pod.Spec.InitContainers) != 1 || engine.Command[0] != render.Launcher {
			t.Errorf("%s: init containers %d, engine command %q: want the launcher", pod.Name, len(pod.Spec.InitContainers), engine.Command)
		}
	}
	if leader == "" {
		t.Fatalf("no leader among %v", podNames(pods))
	}
	// The router's pool is the leader: a headless worker serves nothing.
	e.eventually("the prefill Service's endpoints are the leader's", func() error {
		var slices_ discoveryv1.EndpointSliceList
		if err := e.c.List(e.ctx, &slices_, client.InNamespace(ns), client.MatchingLabels{discoveryv1.LabelServiceName: render.ObjectName(name, v1alpha1.RolePrefill)}); err != nil {
			return err
		}
		var targets []string
		for _, s := range slices_.Items {
			for _, ep := range s.Endpoints {
				if ep.TargetRef != nil {
					targets = append(targets, ep.TargetRef.Name)
				}
			}
		}
		if len(targets) != 1 || targets[0] != leader {
			return fmt.Errorf("endpoints %v, want the leader %s only", targets, leader)
		}
		return nil
	})

	// A worker lost is the replica lost: LeaderWorkerSet recreates the whole group.
	for _, pod := range pods {
		if pod.Labels[lwsv1.WorkerIndexLabelKey] == "1" {
			e.run("delete", "pod", "-n", ns, pod.Name, "--wait=false")
		}
	}
	e.eventually("the group recreated, both pods new, and Ready again", func() error {
		now := prefillPods()
		if len(now) != 2 {
			return fmt.Errorf("%d prefill pods", len(now))
		}
		for _, pod := range now {
			if uidsBefore[pod.UID] {
				return fmt.Errorf("%s is the pod from before the worker was deleted", pod.Name)
			}
		}
		var got v1alpha1.PDCluster
		if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: ns, Name: name}, &got); err != nil {
			return err
		}
		if got.Status.Prefill.Ready != "1/1" {
			return fmt.Errorf("prefill %q ready", got.Status.Prefill.Ready)
		}
		return nil
	})
}
