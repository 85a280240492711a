// Package wrappers builds the fixtures the tests share: PDClusters, engine pods, pulls and a
// recorder of what a connector reports. Each Make* starts from a valid object; the methods
// change one thing and return the wrapper, and Obj returns the result.
package wrappers

import (
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// PDClusterWrapper builds a PDCluster.
type PDClusterWrapper struct{ v1alpha1.PDCluster }

// MakePDCluster is a valid PDCluster serving Qwen3-8B with 64-token blocks, two prefill and one
// decode replica.
func MakePDCluster(ns, name string) *PDClusterWrapper {
	return &PDClusterWrapper{v1alpha1.PDCluster{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.PDClusterSpec{
			Model:      v1alpha1.ModelSpec{Path: "Qwen/Qwen3-8B"},
			Engine:     v1alpha1.EngineSpec{Image: "vllm/vllm-openai:v0.11.0", BlockSize: ptr.To[int32](64)},
			KVTransfer: v1alpha1.KVTransferSpec{RDMADevices: []string{"mlx5_0"}},
			Prefill:    v1alpha1.PoolSpec{Replicas: ptr.To[int32](2)},
			Decode:     v1alpha1.PoolSpec{Replicas: ptr.To[int32](1)},
		},
	}}
}

// Obj returns a copy of the PDCluster as the API server stores it: defaulted.
func (w *PDClusterWrapper) Obj() *v1alpha1.PDCluster {
	pdc := w.DeepCopy()
	pdc.SetDefaults()
	return pdc
}

// Generation sets metadata.generation, as the API server would.
// Pairing sets spec.scheduling.pairing.
func (w *PDClusterWrapper) Pairing(key string, mode v1alpha1.PairingMode) *PDClusterWrapper {
	w.Spec.Scheduling.Pairing = &v1alpha1.PairingSpec{TopologyKey: key, Mode: mode}
	return w
}

func (w *PDClusterWrapper) Generation(g int64) *PDClusterWrapper {
	w.PDCluster.Generation = g
	return w
}

// Replicas sets the prefill and decode replica counts.
func (w *PDClusterWrapper) Replicas(prefill, decode int32) *PDClusterWrapper {
	w.Spec.Prefill.Replicas, w.Spec.Decode.Replicas = ptr.To(prefill), ptr.To(decode)
	return w
}

// Protocol sets the transfer protocol and the RDMA devices.
func (w *PDClusterWrapper) Protocol(p v1alpha1.TransferProtocol, devices ...string) *PDClusterWrapper {
	w.Spec.KVTransfer.Protocol, w.Spec.KVTransfer.RDMADevices = p, devices
	return w
}

// Health sets the connector health policy.
func (w *PDClusterWrapper) Health(h v1alpha1.ConnectorHealthPolicy) *PDClusterWrapper {
	w.Spec.Connector.Health = h
	return w
}

// Verification sets how KV transfer is verified.
func (w *PDClusterWrapper) Verification(v v1alpha1.KVVerification) *PDClusterWrapper {
	w.Spec.KVTransfer.Verification = v
	return w
}

// PodWrapper builds an engine pod as the kubelet reports it.
type PodWrapper struct{ corev1.Pod }

// MakeEnginePod is a Running pod of cluster's role pool, its engine and connector ready, the
// connector started at started.
func MakeEnginePod(ns, name, cluster string, role v1alpha1.Role, started time.Time) *PodWrapper {
	return &PodWrapper{corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("uid-" + name), Labels: render.Labels(cluster, role)},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning,
			ContainerStatuses: []corev1.ContainerStatus{
				{Name: v1alpha1.EngineContainerName, Ready: true},
				{Name: v1alpha1.ConnectorContainerName, Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(started)}}},
			},
		},
	}}
}

// Obj returns a copy of the pod.
func (w *PodWrapper) Obj() *corev1.Pod { return w.DeepCopy() }

func (w *PodWrapper) connector() *corev1.ContainerStatus {
	for i := range w.Status.ContainerStatuses {
		if w.Status.ContainerStatuses[i].Name == v1alpha1.ConnectorContainerName {
			return &w.Status.ContainerStatuses[i]
		}
	}
	panic("wrappers: pod has no connector container")
}

// ConnectorUnready marks the connector unready and ContainersReady False since at.
func (w *PodWrapper) ConnectorUnready(at time.Time) *PodWrapper {
	w.connector().Ready = false
	w.Status.Conditions = append(w.Status.Conditions, corev1.PodCondition{Type: corev1.ContainersReady, Status: corev1.ConditionFalse, LastTransitionTime: metav1.NewTime(at)})
	return w
}

// ConnectorStartedAt sets when the connector container last started.
func (w *PodWrapper) ConnectorStartedAt(at time.Time) *PodWrapper {
	w.connector().State.Running.StartedAt = metav1.NewTime(at)
	return w
}

// ConnectorRestarts sets the kubelet's restart count of the connector container.
func (w *PodWrapper) ConnectorRestarts(n int32) *PodWrapper { w.connector().RestartCount = n; return w }

// Phase sets the pod phase.
func (w *PodWrapper) Phase(p corev1.PodPhase) *PodWrapper { w.Status.Phase = p; return w }

// OnNode binds the pod to node.
func (w *PodWrapper) OnNode(node string) *PodWrapper { w.Spec.NodeName = node; return w }

// Deleting marks the pod as being deleted since at.
func (w *PodWrapper) Deleting(at time.Time) *PodWrapper {
	w.DeletionTimestamp = ptr.To(metav1.NewTime(at))
	return w
}

// Ready sets the pod's Ready condition True, as the kubelet does once every container is ready.
func (w *PodWrapper) Ready() *PodWrapper {
	w.Status.Conditions = append(w.Status.Conditions, corev1.PodCondition{Type: corev1.PodReady, Status: corev1.ConditionTrue})
	return w
}

// KVRevision sets the KV revision label the pod was created with.
func (w *PodWrapper) KVRevision(rev string) *PodWrapper {
	w.Labels[v1alpha1.LabelKVRevision] = rev
	return w
}

// WithoutConnector drops the connector's status, as for a pod rendered before the sidecar.
func (w *PodWrapper) WithoutConnector() *PodWrapper {
	w.Status.ContainerStatuses = w.Status.ContainerStatuses[:1]
	return w
}

// PullWrapper builds the metadata of one pull.
type PullWrapper struct{ kvtransfer.PullMeta }

// MakePull is a pull of request id (transfer x-id) with no local blocks, not waiting for
// remote KV: a notify-only pull until changed.
func MakePull(id string) *PullWrapper {
	return &PullWrapper{kvtransfer.PullMeta{Request: kvtransfer.RequestID(id), Transfer: kvtransfer.TransferID("x-" + id)}}
}

// Obj returns the pull.
func (w *PullWrapper) Obj() kvtransfer.PullMeta { return w.PullMeta }

// Waiting marks the request as waiting for remote KV.
func (w *PullWrapper) Waiting() *PullWrapper { w.WaitingForRemote = true; return w }

// Blocks sets the local destination blocks, one slice per KV-cache group.
func (w *PullWrapper) Blocks(groups ...[]kvtransfer.BlockID) *PullWrapper {
	w.LocalBlock = groups
	return w
}

// Sink records what a connector reports to its engine: completions (finished receiving) and
// releases (finished sending). It is safe for concurrent use.
type Sink struct {
	mu          sync.Mutex
	completions []kvtransfer.Completion
	releases    []kvtransfer.Release
	wake        chan struct{}
}

// NewSink returns an empty Sink.
func NewSink() *Sink { return &Sink{wake: make(chan struct{}, 1)} }

// FinishedReceiving implements kvtransfer.CompletionSink.
func (s *Sink) FinishedReceiving(c kvtransfer.Completion) {
	s.mu.Lock()
	s.completions = append(s.completions, c)
	s.mu.Unlock()
	s.signal()
}

// FinishedSending implements kvtransfer.ReleaseSink.
func (s *Sink) FinishedSending(r kvtransfer.Release) {
	s.mu.Lock()
	s.releases = append(s.releases, r)
	s.mu.Unlock()
	s.signal()
}

func (s *Sink) signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Completions returns a copy of the completions so far.
func (s *Sink) Completions() []kvtransfer.Completion {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]kvtransfer.Completion(nil), s.completions...)
}

// Releases returns a copy of the releases so far.
func (s *Sink) Releases() []kvtransfer.Release {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]kvtransfer.Release(nil), s.releases...)
}

// Wait fails t unless n reports (completions and releases) have arrived within 10 s.
func (s *Sink) Wait(t testing.TB, n int, what string) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		s.mu.Lock()
		got := len(s.completions) + len(s.releases)
		s.mu.Unlock()
		if got >= n {
			return
		}
		select {
		case <-s.wake:
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// RenderRouter is the router's ConfigMap and Deployment render gives pdc, with the default
// options.
func RenderRouter(t testing.TB, pdc *v1alpha1.PDCluster) (*corev1.ConfigMap, *appsv1.Deployment) {
	t.Helper()
	cm, err := render.RouterConfigMap(pdc, render.Serving{})
	if err != nil {
		t.Fatal(err)
	}
	dep, err := render.RouterDeployment(pdc, render.DefaultOptions(), cm)
	if err != nil {
		t.Fatal(err)
	}
	return cm, dep
}

// ContainerArgs are c's arguments as the kubelet runs them: each $(VAR) of c's env expanded,
// status.podIP to podIP and a resourceFieldRef to the container's resource (over its divisor).
// It fails the test on a variable c does not define, or one it cannot resolve here.
func ContainerArgs(t testing.TB, c corev1.Container, podIP string) []string {
	t.Helper()
	values := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			values[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIP":
			values[e.Name] = podIP
		case e.ValueFrom.ResourceFieldRef != nil:
			v, ok := ResourceFieldValue(c, e.ValueFrom.ResourceFieldRef, nil)
			if !ok {
				t.Fatalf("container %s: %s's %s is not set here (the kubelet would give the node's)", c.Name, e.Name, e.ValueFrom.ResourceFieldRef.Resource)
			}
			values[e.Name] = v
		}
	}
	out := make([]string, 0, len(c.Args))
	for _, a := range c.Args {
		for k, v := range values {
			a = strings.ReplaceAll(a, "$("+k+")", v)
		}
		if strings.Contains(a, "$(") {
			t.Fatalf("container %s argument %q names a variable the container does not define", c.Name, a)
		}
		out = append(out, a)
	}
	return out
}

// ResourceFieldValue is what the kubelet gives a resourceFieldRef of c: the container's request
// or limit divided by the divisor. Unset, the kubelet gives the node's allocatable: node is it
// (nil: none; ok false).
func ResourceFieldValue(c corev1.Container, ref *corev1.ResourceFieldSelector, node corev1.ResourceList) (string, bool) {
	kind, name, _ := strings.Cut(ref.Resource, ".")
	list := map[string]corev1.ResourceList{"limits": c.Resources.Limits, "requests": c.Resources.Requests}[kind]
	q, ok := list[corev1.ResourceName(name)]
	if !ok {
		if q, ok = node[corev1.ResourceName(name)]; !ok {
			return "", false
		}
	}
	divisor := int64(1)
	if !ref.Divisor.IsZero() {
		divisor = ref.Divisor.Value()
	}
	return strconv.FormatInt(q.Value()/divisor, 10), true
}
